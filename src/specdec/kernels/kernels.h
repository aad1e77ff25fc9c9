// What specdec's kernels share across files: a quantized linear layer (qmatmul.cpp), the
// attention over a cache (attention.cpp), used by the decoder layer (layer.cpp).

#pragma once

#include <ATen/ATen.h>
#include <functional>
#include <vector>

namespace specdec_kernels {

// One packed part's shape and type (see qmatmul.cpp's header for the terms).
struct Layout {
  int64_t N, K;         // output rows (a multiple of 16), inputs
  int64_t bits;         // 4, 6 or 8: how codes are stored
  int64_t S, SB;        // sub-block and super-block sizes
  int64_t z;            // the code offset
  bool has_sc, sc_signed, has_mn, has_dmin;
};

struct Weights {
  const uint8_t* codes;   // [G, K*bits/8/64 chunks, 64]
  const uint8_t* sc;      // [G, K/S, 16] or null
  const uint8_t* mn;      // [G, K/S, 16] or null
  const at::Half* d;      // [G, K/SB, 16]
  const at::Half* dmin;   // [G, K/SB, 16] or null
};

// What a layer does to its input before the product (each optional, in this order):
//   gated  the input is [gate; up] ([M, 2K]) and the activation silu(gate) * up: an MLP's
//          down projection, fused with the gate
//   norm   RMSNorm: x * weight / sqrt(mean(x^2) + eps), in float32: the norm before a layer,
//          fused with it
struct Prologue {
  bool gated = false;
  const float* norm_weight = nullptr;  // [K] float32, or null
  float eps = 0.f;
};

// A linear layer of packed parts stacked by rows (a fused q/k/v, say), ready to run.
struct QLinear {
  std::vector<Layout> L;
  std::vector<Weights> W;
  std::vector<int64_t> first_group;    // part p's groups start at first_group[p]
  int64_t K = 0, N = 0;                // inputs; outputs (padded to whole groups)
  const float* bias = nullptr;         // float32 [N] or null
  std::vector<at::Tensor> keep_alive;  // the tensors the pointers point into

  using Optionals = std::vector<c10::optional<at::Tensor>>;
  // per part: codes, sc, mn, d, dmin and 5 layout numbers (bits, S, SB, z, sc_signed); the bias
  QLinear(const std::vector<at::Tensor>& codes, const Optionals& sc, const Optionals& mn,
          const std::vector<at::Tensor>& d, const Optionals& dmin, const std::vector<int64_t>& layouts,
          const c10::optional<at::Tensor>& bias);
  // y [M, N] float32 = prologue(x) W^T + bias, x [M, K] (gated: [M, 2K]) float32 or bfloat16
  at::Tensor run(const at::Tensor& x, const Prologue& pro) const;
  // residual [M, N] + prologue(x) W^T + bias, in residual's dtype (float32, bfloat16 or float16): the
  // sum made by the thread that made each group's columns, in the same parallel loop
  at::Tensor run_plus(const at::Tensor& x, const Prologue& pro, const at::Tensor& residual) const;
  // the product of activations quantize_activations made, into out [M, N]; then, per group,
  // after_group(first column, end column) in the thread that made it (if given)
  void run_into(const int8_t* xq, const float* dx, const int16_t* xsum, int64_t M, float* out,
                const std::function<void(int64_t, int64_t)>* after_group = nullptr) const;
};

Prologue make_prologue(const c10::optional<at::Tensor>& norm_weight, double eps, bool gated, int64_t K);

// Attention of q [B, T, H, D] float32 (contiguous) over keys and values (float32, bfloat16 or float16):
// blocks null: keys [B, S, Hkv, D], batch row b reads row b; else a cache's pool [blocks, 16, Hkv,
// D] and blocks [B, max_blocks] (a block table's rows, int64): batch row b's position j is in block
// blocks[b * max_blocks + j / 16] at offset j % 16. Each row reads positions 0..num_keys-1, those
// mask [B or 1, 1, T, num_keys] lets it (null: all); out [B, T, H, D] float32. Each query is
// computed alone (see attention.cpp).
//
// Rows packed (spans given): the B rows' queries one run of N = starts[B] (q [N, H, D], out likewise,
// mask [1, 1, N, num_keys]): row b's queries are starts[b]..starts[b+1]-1 and read its positions
// 0..keys[b]-1 (keys[b] <= num_keys); T is ignored. The same bits as each row run alone.
struct RowSpans {
  const int64_t* starts;  // [B + 1]
  const int64_t* keys;    // [B]
};
void attend_cache(const float* q, int64_t B, int64_t T, int64_t H, const at::Tensor& keys, const at::Tensor& values,
                  const int64_t* blocks, int64_t max_blocks, int64_t num_keys, const at::Tensor* mask, float scale,
                  float* out, const RowSpans* spans = nullptr);

}  // namespace specdec_kernels
