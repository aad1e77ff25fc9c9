// A quantized decoder layer's step in one call: what a decode step or a verify forward of up to 16
// tokens does in each layer of a GGUF model, without a Python op between its parts.
//
//   x -> RMSNorm -> q, k, v (one product) -> RoPE on q and k -> k, v into the cache
//     -> attention over the cache (each query alone) -> o projection -> + x = h
//   h -> RMSNorm -> gate, up (one product) -> silu(gate) * up -> down projection -> + h
//
// The same function as models/llama.py's DecoderLayer with the norms and the gate fused into the
// products (models/gguf_model.py), computed in float32 between the products; the residual stream,
// the cache and the result are in x's dtype. In the model, a step's serial Python and PyTorch ops
// between the products cost more than their own work: each runs after a product has streamed tens
// of megabytes of weights through the caches.

#include <torch/python.h>  // pybind11 with at::Tensor: the classes registered here
#include <ATen/Parallel.h>
#include <vector>

#include "kernels.h"

using namespace specdec_kernels;

namespace {

template <typename scalar_t>
inline void store_row(scalar_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

}  // namespace

struct DecoderLayerPlan {
  QLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;  // float32 [hidden]
  double eps;
  int64_t H, Hkv, D;

  DecoderLayerPlan(QLinear qkv_, QLinear o_, QLinear gate_up_, QLinear down_, at::Tensor input_norm_,
                   at::Tensor post_norm_, double eps_, int64_t H_, int64_t Hkv_, int64_t D_)
      : qkv(std::move(qkv_)), o(std::move(o_)), gate_up(std::move(gate_up_)), down(std::move(down_)),
        input_norm(input_norm_.contiguous()), post_norm(post_norm_.contiguous()), eps(eps_), H(H_), Hkv(Hkv_), D(D_) {
    const int64_t hidden = qkv.K;
    TORCH_CHECK(qkv.N == (H + 2 * Hkv) * D && o.K == H * D && o.N == hidden && gate_up.K == hidden &&
                    gate_up.N == 2 * down.K && down.N == hidden,
                "the layer's products do not fit together (padded rows?)");
    TORCH_CHECK(input_norm.scalar_type() == at::kFloat && input_norm.numel() == hidden &&
                post_norm.scalar_type() == at::kFloat && post_norm.numel() == hidden, "norms: float32 [hidden]");
  }

  // x [B, T, hidden]; cos, signed_sin [B, T, 1, D] (rotate-half RoPE: x * cos + roll(x, D/2) * signed_sin);
  // keys, values: this layer's cache [blocks, 16, Hkv, D]; blocks [B, max_blocks]: each batch row's
  // block table row (position p in block blocks[b, p / 16] at offset p % 16); write_positions [B, T]:
  // where each token's key and value go; mask [B or 1, 1, T, num_keys] or none.
  // Rows packed (row_starts given): x [1, N, hidden] holds the R rows' tokens one after another
  // (row r's are row_starts[r]..row_starts[r+1]-1, int64 [R + 1]; it reads its positions
  // 0..row_keys[r]-1, int64 [R]) and blocks is [R, max_blocks]; mask [1, 1, N, num_keys] or none.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor keys,
                     at::Tensor values, const at::Tensor& blocks, const at::Tensor& write_positions,
                     const c10::optional<at::Tensor>& mask, int64_t num_keys,
                     const c10::optional<at::Tensor>& row_starts, const c10::optional<at::Tensor>& row_keys) const {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == qkv.K, "x: [B, T, hidden]");
    const int64_t B = x.size(0), T = x.size(1), M = B * T, hidden = x.size(2);
    const bool packed = row_starts.has_value() && row_starts->defined();
    TORCH_CHECK(packed == (row_keys.has_value() && row_keys->defined()), "row_starts and row_keys come together");
    TORCH_CHECK(keys.scalar_type() == x.scalar_type() && values.scalar_type() == x.scalar_type(),
                "the cache must be in x's dtype");
    TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && (packed || blocks.size(0) == B) &&
                    write_positions.scalar_type() == at::kLong && write_positions.sizes() == at::IntArrayRef({B, T}),
                "blocks [B, max_blocks], write_positions [B, T]: int64");
    const int64_t rows = blocks.size(0);  // the block table's rows: B, or the packed rows
    at::Tensor starts_c, row_keys_c;
    std::vector<int64_t> row_of(M);  // each token's block table row
    if (packed) {
      TORCH_CHECK(B == 1 && row_starts->scalar_type() == at::kLong && row_starts->numel() == rows + 1 &&
                      row_keys->scalar_type() == at::kLong && row_keys->numel() == rows,
                  "packed rows: x [1, N, hidden], row_starts int64 [R + 1], row_keys int64 [R]");
      starts_c = row_starts->contiguous();
      row_keys_c = row_keys->contiguous();
      const int64_t* starts = starts_c.data_ptr<int64_t>();
      TORCH_CHECK(starts[0] == 0 && starts[rows] == M, "row_starts must run from 0 to the tokens' count");
      for (int64_t r = 0; r < rows; ++r) {
        TORCH_CHECK(starts[r] <= starts[r + 1], "row_starts must not decrease");
        for (int64_t m = starts[r]; m < starts[r + 1]; ++m) row_of[m] = r;
      }
    } else {
      for (int64_t m = 0; m < M; ++m) row_of[m] = m / T;
    }
    TORCH_CHECK(keys.size(1) == 16 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
                "the cache: contiguous [blocks, 16, Hkv, D]");
    auto x2 = x.reshape({M, hidden}).contiguous();                       // [M, hidden]
    auto qkv_out = qkv.run(x2, make_prologue(input_norm, eps, false, hidden));  // [M, (H + 2 Hkv) D] float32
    auto q = at::empty({M, H * D}, x.options().dtype(at::kFloat));       // [M, H*D] = [B, T, H, D]
    auto cos32 = cos.reshape({M, D}).to(at::kFloat).contiguous(), sin32 = signed_sin.reshape({M, D}).to(at::kFloat).contiguous();
    auto blocks_c = blocks.contiguous(), positions = write_positions.contiguous();
    const int64_t max_blocks = blocks.size(1);
    const int64_t* block_of = blocks_c.data_ptr<int64_t>();
    const int64_t* position_of = positions.data_ptr<int64_t>();
    std::vector<int64_t> entry_of(M);  // the write's block x 16 + offset
    for (int64_t m = 0; m < M; ++m) {
      const int64_t p = position_of[m];
      TORCH_CHECK(p >= 0 && p < max_blocks * 16, "a write position out of range");
      const int64_t block = block_of[row_of[m] * max_blocks + p / 16];
      TORCH_CHECK(block >= 0 && block < keys.size(0), "a cache block out of range");
      entry_of[m] = block * 16 + p % 16;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "decoder_layer_rope", [&] {
      const float* in = qkv_out.data_ptr<float>();
      float* q_out = q.data_ptr<float>();
      std::vector<float> rotated(D);
      for (int64_t m = 0; m < M; ++m) {
        const float* c = cos32.data_ptr<float>() + m * D;
        const float* s = sin32.data_ptr<float>() + m * D;
        const float* row = in + m * qkv.N;
        auto rope = [&](const float* v, float* out) {
          for (int64_t d = 0; d < D; ++d) out[d] = v[d] * c[d] + v[(d + D / 2) % D] * s[d];
        };
        for (int64_t h = 0; h < H; ++h) rope(row + h * D, q_out + m * H * D + h * D);
        scalar_t* k_dst = keys.data_ptr<scalar_t>() + entry_of[m] * keys.stride(1);  // contiguous: a block is 16 entries
        scalar_t* v_dst = values.data_ptr<scalar_t>() + entry_of[m] * values.stride(1);
        for (int64_t h = 0; h < Hkv; ++h) {
          rope(row + (H + h) * D, rotated.data());
          store_row(k_dst + h * keys.stride(2), rotated.data(), D);
          store_row(v_dst + h * values.stride(2), row + (H + Hkv + h) * D, D);
        }
      }
    });
    auto attention = at::empty({M, H * D}, x.options().dtype(at::kFloat));  // [B, T, H, D]
    const at::Tensor* mask_ptr = mask.has_value() && mask->defined() ? &*mask : nullptr;
    const RowSpans spans{packed ? starts_c.data_ptr<int64_t>() : nullptr, packed ? row_keys_c.data_ptr<int64_t>() : nullptr};
    attend_cache(q.data_ptr<float>(), packed ? rows : B, T, H, keys, values, block_of, max_blocks, num_keys, mask_ptr,
                 (float)(1.0 / std::sqrt((double)D)), attention.data_ptr<float>(), packed ? &spans : nullptr);
    auto h = o.run_plus(attention, Prologue(), x2);  // [M, hidden] in x's dtype
    auto gate_up_out = gate_up.run(h, make_prologue(post_norm, eps, false, hidden));  // [M, 2I] float32
    Prologue gated;
    gated.gated = true;
    auto out = down.run_plus(gate_up_out, gated, h);
    return out.view({B, T, hidden});
  }
};

void register_decoder_layer(pybind11::module& m) {
  pybind11::class_<QLinear>(m, "QLinear")
      .def(pybind11::init<const std::vector<at::Tensor>&, const QLinear::Optionals&, const QLinear::Optionals&,
                          const std::vector<at::Tensor>&, const QLinear::Optionals&, const std::vector<int64_t>&,
                          const c10::optional<at::Tensor>&>());
  pybind11::class_<DecoderLayerPlan>(m, "DecoderLayerPlan")
      .def(pybind11::init<QLinear, QLinear, QLinear, QLinear, at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t>())
      .def("forward", &DecoderLayerPlan::forward);
}
