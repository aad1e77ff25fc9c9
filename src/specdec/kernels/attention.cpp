// Attention of queries over a key/value cache, each query computed alone.
//
// out[b, t, h] = sum_j p_j v[b, j, h / G]  with  p_j = exp(s_j - max s) / sum exp(s - max s),
// s_j = scale * q[b, t, h] . k[b, j, h / G], over the keys j that mask[b, t, j] lets the query see
// (G = query heads per key/value head).
//
// Why not PyTorch's scaled_dot_product_attention: its CPU kernels compute the scores of a block
// of queries as one matrix product, so a query's result depends on how many queries share its
// forward and how many (masked) keys follow its own; a verify forward of k + 1 tokens then rounds
// differently from k + 1 decode steps, and a near-tie in the target's greedy choice can flip.
// Here every sum runs in one fixed order that depends only on the keys the query sees: a score
// is summed over the head dimension in order (16 keys at a time, one to a lane); the softmax's
// sum in 16 lanes by the key's rank among those seen (the n-th in lane n mod 16) and then a
// fixed tree; the values in key order. Keys a query cannot see are skipped, never multiplied by
// zero. So a query's output is bit-identical whatever the batch, the query length, the cache
// length, or where a tree's verify forward wrote the ancestors it sees.
//
// The arithmetic is on 16-float vectors (vec16.h; FMA contraction by the compiler): one AVX-512
// register, or two AVX2 ones, the same lanes.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <array>
#include <vector>

#include "kernels.h"
#include "vec16.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// 16 consecutive values as float32
inline specdec_vec::vfloat load16_float(const float* p) { return specdec_vec::load16(p); }
inline specdec_vec::vfloat load16_float(const c10::BFloat16* p) {  // a bfloat16 is a float32's top 16 bits
  uint16_t bits[16];
  std::memcpy(bits, p, sizeof(bits));
  return specdec_vec::from_top_bits(bits);
}
inline specdec_vec::vfloat load16_float(const c10::Half* p) {
  float f[16];
  for (int l = 0; l < 16; ++l) f[l] = static_cast<float>(p[l]);
  return specdec_vec::load16(f);
}

using namespace specdec_vec;
constexpr int KEY_LANES = LANES16;  // scores or keys a vector holds
// a value's weighing: query rows sharing each value vector, and 16-dimension vectors of a row in
// registers (AVX2's 16 registers hold a vector in two)
constexpr int VALUE_ROWS = 4;
#if defined(__AVX512F__)
constexpr int VALUE_VECTORS = 4;
#else
constexpr int VALUE_VECTORS = 1;
#endif

// exp(x) for x <= 0 (a score minus its row's maximum; above 0 taken as 0); below -87, 0
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat zero = splat(0.f);
  return where_less(x, splat(-87.f), zero, exp16(vmin(x, zero)));
}

// The keys a query sees, as far as they run from the first: keys 0..lead-1 all seen, and whether
// those are all (a chain's causal mask, a step's none) or more follow here and there (a tree's node
// sees its ancestors among the other nodes)
struct KeysSeen {
  int64_t lead;
  bool only_lead;
};

// The work of one (batch row b, key/value head): its R = G x T query rows (query head g of the
// group, query t: row g * T + t) against the keys and values of that head.
template <typename scalar_t>
struct HeadTask {
  const float* query;        // [R, D], already scaled
  const scalar_t* keys;      // blocks null: key j at keys + j * key_stride; else at
                             // keys + blocks[j / 16] * key_block_stride + (j % 16) * key_stride
  const scalar_t* values;    // likewise
  const int64_t* blocks;     // the row's blocks (a block table's row), or null
  int64_t key_stride, value_stride, key_block_stride, value_block_stride;
  const bool* mask;          // visible(t, j) = mask[t * mask_t + j * mask_j]; null: every key
  int64_t mask_t, mask_j;
  int64_t G, T, S, S16, D;   // S16: S rounded up to 16
  const KeysSeen* seen;      // per query t, from keys_seen: the keys below seen[t].lead need no mask check

  bool visible(int64_t t, int64_t j) const { return mask == nullptr || mask[t * mask_t + j * mask_j]; }

  KeysSeen keys_seen(int64_t t) const {
    int64_t lead = 0;
    while (lead < S && visible(t, lead)) ++lead;
    for (int64_t j = lead; j < S; ++j)
      if (visible(t, j)) return {lead, false};
    return {lead, true};
  }

  const scalar_t* key(int64_t j) const {
    return blocks == nullptr ? keys + j * key_stride : keys + blocks[j / KEY_LANES] * key_block_stride + (j % KEY_LANES) * key_stride;
  }
  const scalar_t* value(int64_t j) const {
    return blocks == nullptr ? values + j * value_stride
                             : values + blocks[j / KEY_LANES] * value_block_stride + (j % KEY_LANES) * value_stride;
  }

  // scores [R, S16]: 16 keys at a time, transposed to [D, 16] so that each lane is one key's dot
  // product summed over d in order (no sum across lanes); keys past S score 0
  void scores(float* out, float* block) const {
    const int64_t R = G * T;
    for (int64_t j0 = 0; j0 < S; j0 += KEY_LANES) {
      const int64_t n = std::min<int64_t>(KEY_LANES, S - j0);
      for (int64_t l = 0; l < KEY_LANES; ++l) {
        if (l >= n) {
          for (int64_t d = 0; d < D; ++d) block[d * KEY_LANES + l] = 0.f;
          continue;
        }
        const scalar_t* k = key(j0 + l);
        for (int64_t d = 0; d < D; ++d) block[d * KEY_LANES + l] = to_float(k[d]);
      }
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) score_rows<4>(query + r * D, block, out + r * S16 + j0);
      for (; r < R; ++r) score_rows<1>(query + r * D, block, out + r * S16 + j0);
    }
  }

  // N query rows' scores against a block of 16 transposed keys: N independent sums over d in
  // order (one row's is the same whatever N; several hide the FMAs' latency)
  template <int N>
  void score_rows(const float* q, const float* block, float* out) const {
    vfloat acc[N];
    for (int i = 0; i < N; ++i) acc[i] = splat(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const vfloat key_lanes = load16(block + d * KEY_LANES);
      for (int i = 0; i < N; ++i) acc[i] += q[i * D + d] * key_lanes;
    }
    for (int i = 0; i < N; ++i) store16(out + i * S16, acc[i]);
  }

  // scores -> exp(score - the row's largest visible score), 0 where not visible or past S
  void exponentiate(float* s_all) const {
    for (int64_t r = 0; r < G * T; ++r) {
      const int64_t t = r % T;
      float* s = s_all + r * S16;
      const KeysSeen& seen_t = seen[t];
      const int64_t lead = seen_t.lead;
      // the largest of s[0..lead-1] in vectors (a maximum is the same in any order; a score takes a
      // lane only where it is larger, as the scalar test below: a NaN never does), then the rest
      vfloat lanes = splat(-INFINITY);
      int64_t j = 0;
      for (; j + KEY_LANES <= lead; j += KEY_LANES) lanes = vmax(load16(s + j), lanes);
      float best = -INFINITY;
      for (int l = 0; l < KEY_LANES; ++l) best = std::max(best, lanes[l]);
      for (; j < lead; ++j) best = std::max(best, s[j]);
      if (!seen_t.only_lead)
        for (j = lead; j < S; ++j)
          if (visible(t, j) && s[j] > best) best = s[j];
      for (int64_t j0 = 0; j0 < S16; j0 += KEY_LANES) store16(s + j0, exp_nonpositive(load16(s + j0) - best));
      if (seen_t.only_lead) {
        std::fill(s + lead, s + S16, 0.f);
      } else {
        for (j = lead; j < S16; ++j)
          if (j >= S || !visible(t, j)) s[j] = 0.f;
      }
    }
  }

  // sum of query t's probabilities: the n-th key it sees in lane n mod 16, then a fixed tree
  // across the lanes. Counting only the keys it sees, a tree's node (which sees its ancestors,
  // wherever the verify forward wrote them) sums as the same token in a chain would, and as a
  // decode step would: its keys are the same values in the same order.
  float denominator(const float* s, int64_t t) const {
    float sums[KEY_LANES];
    const KeysSeen& seen_t = seen[t];
    // the leading keys, all seen, in vectors of 16 (key j the j-th seen: lane j mod 16; where the lead
    // is all, past it the zeros add nothing), then the rest one by one in the lane of their rank
    const int64_t whole = seen_t.only_lead ? S16 : seen_t.lead / KEY_LANES * KEY_LANES;
    vfloat lanes = splat(0.f);
    for (int64_t j0 = 0; j0 < whole; j0 += KEY_LANES) lanes += load16(s + j0);
    store16(sums, lanes);
    if (!seen_t.only_lead) {
      int64_t rank = whole;
      for (int64_t j = whole; j < S; ++j)
        if (visible(t, j)) sums[rank++ % KEY_LANES] += s[j];
    }
    for (int width = KEY_LANES / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
    return sums[0];
  }

  // acc [R, D] = sum over visible j, in key order, of p_j v_j. The G rows of one query t (its
  // query heads, which see the same keys) go VALUE_ROWS at a time, so that each value vector is
  // loaded and widened once for them, VALUE_VECTORS x 16 dimensions held in registers over all
  // keys; each row's sums are the ones it would get alone, in the same order.
  void weigh_values(const float* p, float* acc) const {
    for (int64_t t = 0; t < T; ++t) {
      int64_t g = 0;
      for (; g + VALUE_ROWS <= G; g += VALUE_ROWS) weigh_rows<VALUE_ROWS>(p, t, g, acc);
      weigh_last_rows(p, t, g, acc);
    }
  }

  // rows g0.. of query t, fewer than VALUE_ROWS, as one call of NR = their count
  template <int NR = 1>
  void weigh_last_rows(const float* p, int64_t t, int64_t g0, float* acc) const {
    if constexpr (NR < VALUE_ROWS) {
      if (G - g0 == NR) weigh_rows<NR>(p, t, g0, acc);
      else if (G - g0 > NR) weigh_last_rows<NR + 1>(p, t, g0, acc);
    }
  }

  // acc's rows of query t and query heads g0 .. g0 + NR - 1 of the group
  template <int NR>
  void weigh_rows(const float* p, int64_t t, int64_t g0, float* acc) const {
    const float* row_probs[NR];
    float* row_acc[NR];
    for (int i = 0; i < NR; ++i) {
      const int64_t r = (g0 + i) * T + t;
      row_probs[i] = p + r * S16, row_acc[i] = acc + r * D;
    }
    int64_t d0 = 0;
    for (; d0 + VALUE_VECTORS * KEY_LANES <= D; d0 += VALUE_VECTORS * KEY_LANES)
      weigh_dims<NR, VALUE_VECTORS>(row_probs, t, d0, row_acc);
    for (; d0 + KEY_LANES <= D; d0 += KEY_LANES) weigh_dims<NR, 1>(row_probs, t, d0, row_acc);
    if (d0 < D)
      for (int i = 0; i < NR; ++i) weigh_last_dims(row_probs[i], t, d0, row_acc[i] + d0);
  }

  // out[i][d0 : d0 + 16 N] = sum over visible j of p[i][j] v_j[d0 : d0 + 16 N], for NR rows of query t;
  // a block's keys by their offset from its first (no block-table lookup per key)
  template <int NR, int N>
  void weigh_dims(const float* const* p, int64_t t, int64_t d0, float* const* out) const {
    vfloat sum[NR][N];
    for (int k = 0; k < NR; ++k)
      for (int i = 0; i < N; ++i) sum[k][i] = splat(0.f);
    const int64_t lead = seen[t].lead, end = seen[t].only_lead ? lead : S;  // below lead, no key to skip
    for (int64_t j0 = 0; j0 < end; j0 += KEY_LANES) {
      const scalar_t* block_values = value(j0) + d0;  // key j0's; key j0 + l's at l * value_stride on
      const int64_t n = std::min<int64_t>(KEY_LANES, end - j0);
      for (int64_t l = 0; l < n; ++l) {
        if (j0 + l >= lead && !visible(t, j0 + l)) continue;
        const scalar_t* v = block_values + l * value_stride;
        for (int i = 0; i < N; ++i) {
          const vfloat v_i = load16_float(v + i * KEY_LANES);
          for (int k = 0; k < NR; ++k) sum[k][i] += p[k][j0 + l] * v_i;
        }
      }
    }
    for (int k = 0; k < NR; ++k)
      for (int i = 0; i < N; ++i) store16(out[k] + d0 + i * KEY_LANES, sum[k][i]);
  }

  // out[0 : D - d0] likewise for a head size not a multiple of 16: its last D - d0 < 16 dimensions,
  // one to a lane (the lanes past D sum zeros), the same sum in the same order as weigh_dims'
  void weigh_last_dims(const float* p, int64_t t, int64_t d0, float* out) const {
    const int64_t n = D - d0;
    float v16[KEY_LANES] = {}, sum16[KEY_LANES];
    vfloat sum = splat(0.f);
    for (int64_t j = 0; j < S; ++j) {
      if (!visible(t, j)) continue;
      const scalar_t* v = value(j) + d0;
      for (int64_t l = 0; l < n; ++l) v16[l] = to_float(v[l]);
      sum += p[j] * load16(v16);
    }
    store16(sum16, sum);
    std::memcpy(out, sum16, n * sizeof(float));
  }
};

// Batch row b's queries: the first query's index in q (rows of T queries, or packed rows' spans),
// how many, and the keys it reads
struct RowQueries {
  int64_t first, T, S;
};

inline RowQueries row_queries(int64_t b, int64_t T, int64_t S, const specdec_kernels::RowSpans* spans) {
  if (spans == nullptr) return {b * T, T, S};
  return {spans->starts[b], spans->starts[b + 1] - spans->starts[b], spans->keys[b]};
}

template <typename scalar_t>
void attend_heads(const float* q, int64_t B, int64_t T, int64_t H, const at::Tensor& keys, const at::Tensor& values,
                  const int64_t* blocks, int64_t max_blocks, int64_t S, const at::Tensor* mask, float scale, float* out,
                  const specdec_kernels::RowSpans* spans) {
  const int64_t D = keys.size(3), Hkv = keys.size(2), G = H / Hkv, S16_max = (S + KEY_LANES - 1) / KEY_LANES * KEY_LANES;
  int64_t T_max = T;  // the scratch rows' count: the longest row's queries
  if (spans != nullptr) {
    T_max = 0;
    for (int64_t b = 0; b < B; ++b) T_max = std::max(T_max, spans->starts[b + 1] - spans->starts[b]);
  }
  const bool* mask_ptr = mask == nullptr ? nullptr : mask->data_ptr<bool>();
  const int64_t mask_b = mask == nullptr || mask->size(0) == 1 ? 0 : mask->stride(0);
  const int64_t mask_t = mask == nullptr ? 0 : mask->stride(2), mask_j = mask == nullptr ? 0 : mask->stride(3);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> query(G * T_max * D), probs(G * T_max * S16_max), acc(G * T_max * D), block(KEY_LANES * D);
    std::vector<KeysSeen> seen(T_max);
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t b = task / Hkv, hkv = task % Hkv;
      const RowQueries rq = row_queries(b, T, S, spans);
      const int64_t R = G * rq.T, S16 = (rq.S + KEY_LANES - 1) / KEY_LANES * KEY_LANES;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < rq.T; ++t) {
          const float* qr = q + ((rq.first + t) * H + hkv * G + g) * D;
          for (int64_t d = 0; d < D; ++d) query[(g * rq.T + t) * D + d] = qr[d] * scale;
        }
      const int64_t row = blocks == nullptr ? b : 0;  // contiguous: keys [B, S, Hkv, D]; blocks: the pool's
      // packed rows share one mask [1, 1, N, S]: the row's queries from its first
      const bool* row_mask = mask_ptr == nullptr ? nullptr
                             : spans == nullptr  ? mask_ptr + b * mask_b
                                                 : mask_ptr + rq.first * mask_t;
      const HeadTask<scalar_t> head{query.data(),
                                    keys.data_ptr<scalar_t>() + row * keys.stride(0) + hkv * keys.stride(2),
                                    values.data_ptr<scalar_t>() + row * values.stride(0) + hkv * values.stride(2),
                                    blocks == nullptr ? nullptr : blocks + b * max_blocks,
                                    keys.stride(1), values.stride(1), keys.stride(0), values.stride(0),
                                    row_mask, mask_t, mask_j,
                                    G, rq.T, rq.S, S16, D, seen.data()};
      for (int64_t t = 0; t < rq.T; ++t) seen[t] = head.keys_seen(t);
      head.scores(probs.data(), block.data());
      head.exponentiate(probs.data());
      head.weigh_values(probs.data(), acc.data());
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / rq.T, t = r % rq.T;
        const float total = head.denominator(&probs[r * S16], t);
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        float* o = out + ((rq.first + t) * H + hkv * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inverse;
      }
    }
  });
}

}  // namespace

void specdec_kernels::attend_cache(const float* q, int64_t B, int64_t T, int64_t H, const at::Tensor& keys,
                                   const at::Tensor& values, const int64_t* blocks, int64_t max_blocks,
                                   int64_t num_keys, const at::Tensor* mask, float scale, float* out,
                                   const specdec_kernels::RowSpans* spans) {
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.scalar_type() == values.scalar_type(),
              "keys and values: [rows or blocks, positions, Hkv, D] of one dtype");
  TORCH_CHECK(H % keys.size(2) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "the head dimension must be contiguous");
  if (blocks == nullptr) {
    TORCH_CHECK(keys.size(0) == B && num_keys <= keys.size(1), "keys [B, S, Hkv, D]: position ", num_keys - 1,
                " is past them");
  } else {
    TORCH_CHECK(keys.size(1) == KEY_LANES, "a block holds 16 positions");
    TORCH_CHECK(num_keys <= max_blocks * KEY_LANES, "position ", num_keys - 1, " is past the cache");
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < (num_keys + KEY_LANES - 1) / KEY_LANES; ++i)
        TORCH_CHECK(blocks[b * max_blocks + i] >= 0 && blocks[b * max_blocks + i] < keys.size(0), "cache block out of range");
  }
  if (spans != nullptr) {
    TORCH_CHECK(spans->starts[0] == 0, "packed rows start at query 0");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(spans->starts[b + 1] >= spans->starts[b] && spans->keys[b] >= 0 && spans->keys[b] <= num_keys,
                  "packed row ", b, ": its queries or keys are out of range");
    if (mask != nullptr)
      TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(0) == 1 && mask->size(1) == 1 &&
                      mask->size(2) == spans->starts[B] && mask->size(3) == num_keys,
                  "packed rows' mask: bool [1, 1, N, S]");
  } else if (mask != nullptr) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == T &&
                    mask->size(3) == num_keys && (mask->size(0) == B || mask->size(0) == 1),
                "mask: bool [B or 1, 1, T, S]");
  }
  switch (keys.scalar_type()) {
    case at::kFloat:
      attend_heads<float>(q, B, T, H, keys, values, blocks, max_blocks, num_keys, mask, scale, out, spans);
      break;
    case at::kBFloat16:
      attend_heads<c10::BFloat16>(q, B, T, H, keys, values, blocks, max_blocks, num_keys, mask, scale, out, spans);
      break;
    case at::kHalf:
      attend_heads<c10::Half>(q, B, T, H, keys, values, blocks, max_blocks, num_keys, mask, scale, out, spans);
      break;
    default: TORCH_CHECK(false, "attend: float32, bfloat16 or float16 keys, got ", keys.scalar_type());
  }
}

// q [B, T, H, D], keys and values [B, S, Hkv, D] (the last dimension contiguous), mask [B, 1, T, S]
// bool (True = may attend; broadcastable over B) or none (every key): [B, T, H, D] in q's dtype.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "q, keys, values: [B, T|S, H|Hkv, D]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(),
              "q, keys and values must share a dtype");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == q.size(0) && keys.size(3) == q.size(3),
              "keys and values [B, S, Hkv, D] for q [B, T, H, D]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  auto q32 = q.to(at::kFloat).contiguous();
  auto out = at::empty({B, T, H, q.size(3)}, q.options().dtype(at::kFloat));
  const at::Tensor* mask_ptr = mask.has_value() && mask->defined() ? &*mask : nullptr;
  specdec_kernels::attend_cache(q32.data_ptr<float>(), B, T, H, keys, values, nullptr, 0, keys.size(1), mask_ptr,
                                (float)scale, out.data_ptr<float>());
  return out.to(q.scalar_type());
}

// q [B, T, H, D]; keys and values a cache's pool [blocks, 16, Hkv, D]; blocks [B, max_blocks] int64
// (each row's block table row); each row reads positions 0..num_keys-1 through its blocks, those
// mask [B or 1, 1, T, num_keys] lets it (or none): [B, T, H, D] in q's dtype. No copy of the keys.
at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& blocks,
                        const c10::optional<at::Tensor>& mask, int64_t num_keys, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "q [B, T, H, D], keys and values [blocks, 16, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(),
              "q, keys and values must share a dtype");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.size(0) == q.size(0),
              "blocks: int64 [B, max_blocks]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  auto q32 = q.to(at::kFloat).contiguous();
  auto blocks_c = blocks.contiguous();
  auto out = at::empty({B, T, H, q.size(3)}, q.options().dtype(at::kFloat));
  const at::Tensor* mask_ptr = mask.has_value() && mask->defined() ? &*mask : nullptr;
  specdec_kernels::attend_cache(q32.data_ptr<float>(), B, T, H, keys, values, blocks_c.data_ptr<int64_t>(),
                                blocks_c.size(1), num_keys, mask_ptr, (float)scale, out.data_ptr<float>());
  return out.to(q.scalar_type());
}

// attend_paged with rows packed: q [1, N, H, D], the B rows' queries one after another (row b's
// are row_starts[b]..row_starts[b+1]-1, int64 [B + 1]), row b reading its positions
// 0..row_keys[b]-1 (int64 [B]) through blocks [B, max_blocks], those mask [1, 1, N, num_keys]
// lets it: [1, N, H, D] in q's dtype, each query's bits those of its row run alone.
at::Tensor attend_packed(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& blocks,
                         const at::Tensor& row_starts, const at::Tensor& row_keys, const c10::optional<at::Tensor>& mask,
                         int64_t num_keys, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && keys.dim() == 4 && values.dim() == 4,
              "q [1, N, H, D], keys and values [blocks, 16, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(),
              "q, keys and values must share a dtype");
  const int64_t B = blocks.size(0), N = q.size(1), H = q.size(2);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2, "blocks: int64 [B, max_blocks]");
  TORCH_CHECK(row_starts.scalar_type() == at::kLong && row_starts.dim() == 1 && row_starts.size(0) == B + 1 &&
                  row_keys.scalar_type() == at::kLong && row_keys.dim() == 1 && row_keys.size(0) == B,
              "row_starts int64 [B + 1], row_keys int64 [B]");
  auto starts = row_starts.contiguous(), row_key_counts = row_keys.contiguous();
  TORCH_CHECK(starts.data_ptr<int64_t>()[B] == N, "row_starts must end at the queries' count");
  auto q32 = q.to(at::kFloat).contiguous();
  auto blocks_c = blocks.contiguous();
  auto out = at::empty({1, N, H, q.size(3)}, q.options().dtype(at::kFloat));
  const at::Tensor* mask_ptr = mask.has_value() && mask->defined() ? &*mask : nullptr;
  const specdec_kernels::RowSpans spans{starts.data_ptr<int64_t>(), row_key_counts.data_ptr<int64_t>()};
  specdec_kernels::attend_cache(q32.data_ptr<float>(), B, 0, H, keys, values, blocks_c.data_ptr<int64_t>(),
                                blocks_c.size(1), num_keys, mask_ptr, (float)scale, out.data_ptr<float>(), &spans);
  return out.to(q.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("attend(Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor");
  m.def("attend_paged(Tensor q, Tensor keys, Tensor values, Tensor blocks, Tensor? mask, int num_keys, float scale) -> Tensor");
  m.def("attend_packed(Tensor q, Tensor keys, Tensor values, Tensor blocks, Tensor row_starts, Tensor row_keys, "
        "Tensor? mask, int num_keys, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("attend", &attend);
  m.impl("attend_paged", &attend_paged);
  m.impl("attend_packed", &attend_packed);
}
