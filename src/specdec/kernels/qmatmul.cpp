// Matrix products with GGUF-quantized weights on the CPU: y = x W^T, W held as integer codes.
//
// Terms:
//   code      a weight's integer value, unsigned: stored in 4 bits (two to a byte), 6 bits (5-
//             and 6-bit codes: a 4-bit part and a 2-bit part) or 8 bits (one to a byte)
//   sub-block S consecutive inputs (k) of one output row sharing a scale (S = 16 or 32)
//   super-block SB inputs sharing the float scales d and dmin (SB = 256 for k-quants; for
//             the legacy types SB = S = 32)
//   weight    w = d * sc * (code - z) + dmin * mn, with sc (int8 or uint8) and mn (uint8) per
//             sub-block (1 where a type has none) and z a constant of the type. Every GGUF type
//             read here is exactly of this form.
//   group     16 consecutive output rows n, stored together: the kernel's 16 lanes are 16 rows
//             of W, so a product never needs a horizontal sum.
//   step      the codes of one group for a few inputs: 4-bit: 64 bytes for 8 inputs x 16 rows
//             (byte 4n+j holds input j in its low nibble, input 4+j in its high one); 6-bit: 192
//             bytes for 16 inputs: the low 4 bits of inputs 0-7 and of 8-15, 64 bytes each as in
//             the 4-bit layout, then 64 bytes of top 2 bits (byte q holds, at bits 2v and 2v+1,
//             those of byte q's code in vector v: inputs j, 4+j, 8+j, 12+j for v = 0..3);
//             8-bit: 64 bytes for 4 inputs x 16 rows (byte 4n+j holds input j).
//
// Activations are quantized per row to int8 in blocks of AB inputs (scale dx = max|x| / 127):
// AB = 256 where K allows (llama.cpp's Q8_K, what it multiplies its k-quants by), else 32. With
// one dx per super-block, a k-quant's super-block is
//   sum_k w x = dx * (d * sum_s sc_s * dot_s  +  cc * sum_s c_s * xs_s)
// dot_s: the sub-block's codes times activation codes (vpdpbusd; maddubs + madd on AVX2), xs_s:
// the sub-block's sum of activation codes, and the correction c_s = mn_s with cc = dmin, or
// c_s = sc_s with cc = -z * d (no k-quant has both), two sub-blocks per vpdpwssd (madd on AVX2).
// Q4_K and Q5_K (S = 32, sc 0..63) sum sc_s * dot_s over a super-block in integers on every
// kernel: AVX2 by the madd that widens (sc_s the int16 multiplier), AVX-512 by a float FMA by sc_s
// over runs of sub-blocks whose products and partial sums stay below 2^24 (exact), AMX with sc
// folded into the codes (amx.h); from that integer all take the same float steps, so the three
// give the same bits. The 16-input k-quants pay per sub-block one conversion and one FMA on
// AVX-512 (sc_s * d as a float; an integer vpmulld measured slower on Q6_K: docs/runner.md), and
// per super-block one FMA by dx. The legacy types (no sc) sum in floats per sub-block of 32.
//
// The prologue (optional) is what a layer did to its input before the product: an RMSNorm, an
// MLP's gate (silu(gate) * up); the kernel does it in float32 while quantizing the input.
//
// Each row's result depends on that row alone (the arithmetic per row does not depend on how many
// rows there are, and threads split output rows, never inputs), so a batch of rows gets the same
// results as the rows one at a time.
//
// The kernel reads every weight chunk once for up to MAX_TILE activation rows: with AVX-512
// VNNI, one vpdpbusd multiplies 64 codes by 4 broadcast int8 activations per row.

#include <torch/library.h>
#include <torch/python.h>  // pybind11 with at::Tensor: the module
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <cmath>
#include <string>
#include <vector>
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>  // amx.h: arch_prctl
#include <unistd.h>
#include <algorithm>
#include <type_traits>
#endif

#include "kernels.h"
#include "vec16.h"

using namespace specdec_kernels;

namespace {

constexpr int SUM_BLOCK = 16;   // inputs per activation sum of a 16-input sub-block (also kept per 32)
constexpr int64_t K_SUPER = 256;  // a k-quant's super-block SB (every GGUF k-quant's; checked at load)

// inputs per activation scale for K inputs
inline int64_t act_block(int64_t K) { return K % 256 == 0 ? 256 : 32; }


typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;
// 4 activation codes (or 2 int16 sums) as one int32 (the compiler folds it into the broadcast)
inline int32_t load_i32(const void* p) { return *reinterpret_cast<const unaligned_i32*>(p); }

// ---- activations ---------------------------------------------------------------------------


// Row m's activation (K inputs, after the prologue) in float32 into out [K].
template <typename scalar_t>
void prepare_row(const scalar_t* x, int64_t m, int64_t K, const Prologue& pro, float* out) {
  using namespace specdec_vec;
  if (pro.gated) {
    const scalar_t* gate = x + m * 2 * K;
    const scalar_t* up = gate + K;
    float g16[LANES16], u16[LANES16];
    for (int64_t i0 = 0; i0 < K; i0 += LANES16) {  // K is a multiple of 32
      for (int l = 0; l < LANES16; ++l) g16[l] = (float)gate[i0 + l], u16[l] = (float)up[i0 + l];
      const vfloat g = load16(g16);
      store16(out + i0, g / (1.f + exp16(-g)) * load16(u16));  // silu(gate) * up
    }
  } else {
    for (int64_t i = 0; i < K; ++i) out[i] = (float)x[m * K + i];
  }
  if (pro.norm_weight != nullptr) {
    double squares = 0.0;
    for (int64_t i = 0; i < K; ++i) squares += (double)out[i] * out[i];
    const float inverse_rms = 1.f / std::sqrt((float)(squares / K) + pro.eps);
    for (int64_t i = 0; i < K; ++i) out[i] = out[i] * inverse_rms * pro.norm_weight[i];
  }
}

// q's 16 lanes (integers in -127..127) stored as int8 at p; returns their sum
inline int32_t store_codes(const specdec_vec::vint& q, int8_t* p) {
#if defined(__AVX512F__)
  const __m512i lanes = (__m512i)q;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(lanes));
  return _mm512_reduce_add_epi32(lanes);
#else
  const __m256i lo = (__m256i)q.lo, hi = (__m256i)q.hi;
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // lanes 0-15 as int16
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
  const __m256i pairs = _mm256_add_epi32(lo, hi);
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
  return _mm_cvtsi128_si32(sum);
#endif
}

// x [M, K] (or [M, 2K] gated) -> xq [M, K] int8, dx [M, K/AB] (scales), xsum [M, K/16 + K/32] int16
// (sums of codes: per 16 inputs, then per 32)
template <typename scalar_t>
void quantize_rows(const scalar_t* x, int64_t M, int64_t K, const Prologue& pro, int8_t* xq, float* dx,
                   int16_t* xsum) {
  using namespace specdec_vec;
  const int64_t AB = act_block(K);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      prepare_row(x, m, K, pro, row.data());
      int16_t* row_sums = xsum + m * (K / SUM_BLOCK + K / 32);
      for (int64_t b = 0; b < K / AB; ++b) {
        const float* xb = row.data() + b * AB;
        vfloat amax16 = splat(0.f);
        for (int64_t i = 0; i < AB; i += LANES16) {
          const vfloat v = load16(xb + i);
          amax16 = vmax(vabs(v), amax16);
        }
        float amax = 0.f;
        for (int l = 0; l < LANES16; ++l) amax = std::max(amax, amax16[l]);
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = xq + m * K + b * AB;
        const vfloat rounder = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to the nearest integer (ties even)
        for (int64_t i = 0; i < AB; i += SUM_BLOCK) {  // SUM_BLOCK = 16 = LANES16
          const vint q = to_int((load16(xb + i) * id + rounder) - rounder);
          row_sums[(b * AB + i) / SUM_BLOCK] = (int16_t)store_codes(q, qb + i);
        }
        dx[m * (K / AB) + b] = d;
      }
      for (int64_t s = 0; s < K / 32; ++s) row_sums[K / SUM_BLOCK + s] = row_sums[2 * s] + row_sums[2 * s + 1];
    }
  });
}


struct Acts {
  const int8_t* xq; const float* dx; const int16_t* xsum; int64_t M, AB;
  const int8_t* xt = nullptr;  // AMX: xq packed as A tiles (amx.h, pack_tile_activations), or null
  int64_t xt_rows = 0;         // rows per A tile there
};

// the activation sums of row r's sub-blocks of size S
inline const int16_t* sub_sums(const Acts& a, const Layout& L, int64_t r) {
  const int16_t* row_sums = a.xsum + r * (L.K / SUM_BLOCK + L.K / 32);
  return L.S == 32 ? row_sums + L.K / SUM_BLOCK : row_sums;
}

// row r's activation scales: the one at input k is [k >> act_shift(a)] (no integer division in the
// tiles: one per row and super-block was a measurable share of a 7-row tile, docs/runner.md)
inline const float* act_scales(const Acts& a, const Layout& L, int64_t r) { return a.dx + r * (L.K / a.AB); }
inline int act_shift(const Acts& a) { return a.AB == 256 ? 8 : 5; }

// Software prefetch: codes PREFETCH_BYTES ahead, for tiles of at least prefetch_rows rows.
// With several rows a tile computes long enough between loads that the hardware prefetcher falls
// behind, and a 7-row verify forward is faster with it. Whether a one-row tile gains depends on
// the machine: on a Zen 4 a plain streaming read was slower with software prefetches ahead of it
// and steps measured the same either way; on a Sapphire Rapids a one-row step took 28-35% less
// time with them. So prefetch_rows is 2 until set_prefetch_rows says otherwise, which the runner
// does after timing a step both ways (worker/prefetch.py; docs/runner.md, "GGUF weights, run
// quantized"). The results are the same either way: a prefetch only moves when bytes arrive.
constexpr int64_t PREFETCH_BYTES = 4096;
int64_t prefetch_rows = 2;

void set_prefetch_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "prefetch rows must be at least 1, got ", rows);
  prefetch_rows = rows;
}
int64_t get_prefetch_rows() { return prefetch_rows; }

template <int BITS> constexpr int64_t step_k() { return BITS == 8 ? 4 : BITS == 4 ? 8 : 16; }
template <int BITS> constexpr int64_t step_bytes() { return BITS == 6 ? 192 : 64; }

// Rows of activations a tile reads each weight chunk once for. A verify forward's 7 rows in one tile
// of AVX2 took less time than tiles of 4 and 3, spilled registers and all (AVX2 has 16 registers;
// docs/runner.md has the measurements).
constexpr int MAX_TILE = 8;

// ---- AVX-512 VNNI ------------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int LANES = 16;

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i load_int16x(const uint8_t* p, bool is_signed) {  // 16 bytes -> 16 int32
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

// One step's codes as rows of 4 inputs x 16 outputs, one byte each (byte 4n+j: input 4r+j of
// output n in rows[r]): 4-bit codes 2 rows, 6-bit codes 4 (the low 4 bits joined with the top 2),
// 8-bit codes 1 (as stored): what the AMX tiles store as B rows, and what dot_sub multiplies.
template <int BITS>
inline void step_rows(const uint8_t* chunk, __m512i* rows) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  const __m512i raw = _mm512_loadu_si512(chunk);
  if constexpr (BITS == 6) {
    const __m512i raw2 = _mm512_loadu_si512(chunk + 64), top = _mm512_loadu_si512(chunk + 128);
    rows[0] = _mm512_or_si512(_mm512_and_si512(raw, low4), _mm512_and_si512(_mm512_slli_epi16(top, 4), bits45));
    rows[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4), _mm512_and_si512(_mm512_slli_epi16(top, 2), bits45));
    rows[2] = _mm512_or_si512(_mm512_and_si512(raw2, low4), _mm512_and_si512(top, bits45));
    rows[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw2, 4), low4), _mm512_and_si512(_mm512_srli_epi16(top, 2), bits45));
  } else if constexpr (BITS == 4) {
    rows[0] = _mm512_and_si512(raw, low4), rows[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  } else {
    rows[0] = raw;
  }
}

// iacc[t] += one sub-block's codes (steps of the layout) times row t's activation codes at k0
// (the unpacking is step_rows', written out here: through step_rows the compiler stopped inlining
// the one-row tiles of 6-bit codes into their callers, a call per group of a decode step)
template <int T, int BITS>
inline void dot_sub(const uint8_t* codes, int64_t steps, const int8_t* const* xr, int64_t k0, __m512i* iacc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  for (int64_t c = 0; c < steps; ++c) {
    const uint8_t* chunk = codes + c * step_bytes<BITS>();
    const int64_t k = k0 + c * step_k<BITS>();
    if (T >= prefetch_rows)
      for (int64_t b = 0; b < step_bytes<BITS>(); b += 64) _mm_prefetch((const char*)chunk + PREFETCH_BYTES + b, _MM_HINT_T0);
    const __m512i raw = _mm512_loadu_si512(chunk);
    if (BITS == 6) {
      const __m512i raw2 = _mm512_loadu_si512(chunk + 64), top = _mm512_loadu_si512(chunk + 128);
      const __m512i v0 = _mm512_or_si512(_mm512_and_si512(raw, low4), _mm512_and_si512(_mm512_slli_epi16(top, 4), bits45));
      const __m512i v1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                         _mm512_and_si512(_mm512_slli_epi16(top, 2), bits45));
      const __m512i v2 = _mm512_or_si512(_mm512_and_si512(raw2, low4), _mm512_and_si512(top, bits45));
      const __m512i v3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw2, 4), low4),
                                         _mm512_and_si512(_mm512_srli_epi16(top, 2), bits45));
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], v0, _mm512_set1_epi32(load_i32(xr[t] + k)));
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], v1, _mm512_set1_epi32(load_i32(xr[t] + k + 4)));
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], v2, _mm512_set1_epi32(load_i32(xr[t] + k + 8)));
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], v3, _mm512_set1_epi32(load_i32(xr[t] + k + 12)));
    } else if (BITS == 4) {
      const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], lo, _mm512_set1_epi32(load_i32(xr[t] + k)));
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], hi, _mm512_set1_epi32(load_i32(xr[t] + k + 4)));
    } else {
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_dpbusd_epi32(iacc[t], raw, _mm512_set1_epi32(load_i32(xr[t] + k)));
    }
  }
}

inline __m512 super_block_d(const Layout& L, const Weights& w, int64_t g, int64_t sb) {
  return load_half16(w.d + (g * (L.K / K_SUPER) + sb) * LANES);
}

// A k-quant super-block's correction for T rows (xs[t]: row t's sub-block sums of activation codes):
// icorr[t] = sum_s c_s xs_s, two sub-blocks per vpdpwssd (int16 pairs c_s, c_s+1 per lane); returns
// its float factor cc (from the super-block's scale d where the type has no dmin). S and the
// super-block are constants, so that the loop over the pairs unrolls (with a length known only at
// run time GCC kept two divisions per super-block and a register copy per row and pair in it:
// docs/runner.md, "A verify in steps, by kernel")
template <int T, int S>
inline __m512 k_correction_sums(const Layout& L, const Weights& w, int64_t g, int64_t sb, __m512 d,
                                const int16_t* const* xs, __m512i* icorr) {
  constexpr int64_t subs_per_sb = K_SUPER / S;
  const int64_t s0 = sb * subs_per_sb;
  const uint8_t* coefs = (L.has_mn ? w.mn : w.sc) + (g * (L.K / S) + s0) * LANES;  // the correction's c_s
  const bool coef_signed = !L.has_mn && L.sc_signed;
  for (int t = 0; t < T; ++t) icorr[t] = _mm512_setzero_si512();
  for (int64_t s = 0; s < subs_per_sb; s += 2) {
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(coefs + s * LANES));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(coefs + (s + 1) * LANES));
    const __m256i pairs8 = _mm256_set_m128i(_mm_unpackhi_epi8(c0, c1), _mm_unpacklo_epi8(c0, c1));
    const __m512i pairs = coef_signed ? _mm512_cvtepi8_epi16(pairs8) : _mm512_cvtepu8_epi16(pairs8);
    for (int t = 0; t < T; ++t)
      icorr[t] = _mm512_dpwssd_epi32(icorr[t], pairs, _mm512_set1_epi32(load_i32(xs[t] + s0 + s)));
  }
  return L.has_mn ? load_half16(w.dmin + (g * (L.K / K_SUPER) + sb) * LANES)
                  : _mm512_mul_ps(d, _mm512_set1_ps(-(float)L.z));
}

// A k-quant super-block's start for T rows with float sums per sub-block: fsum[t] = cc * sum_s c_s xs_s;
// returns the super-block's scale d
template <int T, int S>
inline __m512 k_correction(const Layout& L, const Weights& w, int64_t g, int64_t sb, const int16_t* const* xs,
                           __m512* fsum) {
  __m512i icorr[T];
  const __m512 d = super_block_d(L, w, g, sb);
  const __m512 cc = k_correction_sums<T, S>(L, w, g, sb, d, xs, icorr);
  for (int t = 0; t < T; ++t) fsum[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(icorr[t]), cc);
  return d;
}

// k-quants (sc per sub-block, SB = AB): integer sums per super-block
template <int T, int BITS, int S>
void group_tile_k(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* y, int64_t ldy,
                  int64_t col0) {
  constexpr int64_t steps_per_sub = S / step_k<BITS>(), subs_per_sb = K_SUPER / S;
  const int64_t nsub = L.K / S, super_blocks = L.K / K_SUPER;
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  const int8_t* xr[T];
  const int16_t* xs[T];
  const float* dx[T];
  for (int t = 0; t < T; ++t) xr[t] = a.xq + (r0 + t) * L.K, xs[t] = sub_sums(a, L, r0 + t), dx[t] = act_scales(a, L, r0 + t);
  // the rows' sums so far live in y (a load and a store per super-block), which leaves the
  // registers to the super-block's sums
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (r0 + t) * ldy + col0 + g * LANES, _mm512_setzero_ps());
  for (int64_t sb = 0; sb < super_blocks; ++sb) {
    const int64_t s0 = sb * subs_per_sb;
    if constexpr (S == 32) {
      // sum_s sc_s * dot_s in floats of P sub-blocks: every product and partial sum an integer
      // below 2^24, so exact; the parts then summed as integers (all but the last part's wait in
      // memory: in registers beside the parts and the dots they cost spills)
      constexpr int64_t P = BITS == 4 ? 4 : 2;
      alignas(64) int32_t earlier[T][LANES];
      __m512i isum[T];
      for (int64_t p0 = s0; p0 < s0 + subs_per_sb; p0 += P) {
        __m512 part[T];
        for (int t = 0; t < T; ++t) part[t] = _mm512_setzero_ps();
        for (int64_t s = p0; s < p0 + P; ++s) {
          const __m512 sc = _mm512_cvtepi32_ps(load_int16x(w.sc + (g * nsub + s) * LANES, false));
          __m512i iacc[T];
          for (int t = 0; t < T; ++t) iacc[t] = _mm512_setzero_si512();
          dot_sub<T, BITS>(codes + s * steps_per_sub * step_bytes<BITS>(), steps_per_sub, xr, s * S, iacc);
          for (int t = 0; t < T; ++t) part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[t]), sc, part[t]);
        }
        for (int t = 0; t < T; ++t) {
          const __m512i ipart = _mm512_cvtps_epi32(part[t]);
          isum[t] = p0 == s0 ? ipart : _mm512_add_epi32(_mm512_load_si512(earlier[t]), ipart);
          if (p0 + P < s0 + subs_per_sb) _mm512_store_si512(earlier[t], isum[t]);
        }
      }
      __m512i icorr[T];
      const __m512 d = super_block_d(L, w, g, sb);
      const __m512 cc = k_correction_sums<T, S>(L, w, g, sb, d, xs, icorr);
      for (int t = 0; t < T; ++t) {
        float* out = y + (r0 + t) * ldy + col0 + g * LANES;
        const __m512 dxt = _mm512_set1_ps(dx[t][sb]);
        const __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(icorr[t]), _mm512_mul_ps(cc, dxt), _mm512_loadu_ps(out));
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dxt), o));
      }
      continue;
    }
    __m512 fsum[T];
    const __m512 d = k_correction<T, S>(L, w, g, sb, xs, fsum);
    for (int64_t s = s0; s < s0 + subs_per_sb; ++s) {
      const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(load_int16x(w.sc + (g * nsub + s) * LANES, L.sc_signed)), d);
      __m512i iacc[T];
      for (int t = 0; t < T; ++t) iacc[t] = _mm512_setzero_si512();
      dot_sub<T, BITS>(codes + s * steps_per_sub * step_bytes<BITS>(), steps_per_sub, xr, s * S, iacc);
      for (int t = 0; t < T; ++t) fsum[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[t]), scale, fsum[t]);
    }
    for (int t = 0; t < T; ++t) {
      float* out = y + (r0 + t) * ldy + col0 + g * LANES;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(fsum[t], _mm512_set1_ps(dx[t][sb]),
                                            _mm512_loadu_ps(out)));
    }
  }
}

// legacy types (no sc; SB = S = 32): float sums per sub-block
template <int T, int BITS>
void group_tile_legacy(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* y,
                       int64_t ldy, int64_t col0) {
  const int64_t nsub = L.K / L.S, steps_per_sub = L.S / step_k<BITS>();
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  const int8_t* xr[T];
  const int16_t* xs[T];
  const float* dxr[T];
  for (int t = 0; t < T; ++t) xr[t] = a.xq + (r0 + t) * L.K, xs[t] = sub_sums(a, L, r0 + t), dxr[t] = act_scales(a, L, r0 + t);
  const int shift = act_shift(a);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsub; ++s) {
    const __m512 scale = load_half16(w.d + (g * nsub + s) * LANES);
    __m512 offset = _mm512_mul_ps(scale, _mm512_set1_ps(-(float)L.z));
    if (L.has_dmin) offset = _mm512_add_ps(offset, load_half16(w.dmin + (g * nsub + s) * LANES));
    __m512i iacc[T];
    for (int t = 0; t < T; ++t) iacc[t] = _mm512_setzero_si512();
    dot_sub<T, BITS>(codes + s * steps_per_sub * step_bytes<BITS>(), steps_per_sub, xr, s * L.S, iacc);
    for (int t = 0; t < T; ++t) {
      const float dx = dxr[t][(s * 32) >> shift];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[t]), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc[t]);
      acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(dx * (float)xs[t][s]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (r0 + t) * ldy + col0 + g * LANES, acc[t]);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include "amx.h"
#endif

#else  // ---- AVX2 ---------------------------------------------------------------------------------
constexpr int LANES = 16;    // a group is still 16 rows, done as two halves of 8

inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 bytes -> 8 int32 lanes, each holding the value twice as int16 (a madd_epi16 multiplier per row)
inline __m256i load_twice16(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  return _mm256_or_si256(_mm256_and_si256(wide, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(wide, 16));
}

// the 6-bit codes of one step's half group (8 rows): inputs j, 4+j, 8+j, 12+j as v[0..3]
inline void unpack6_half(const uint8_t* chunk, int half, __m256i* v) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + half * 32));
  const __m256i raw2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 + half * 32));
  const __m256i tops = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 128 + half * 32));
  v[0] = _mm256_or_si256(_mm256_and_si256(raw, low4), _mm256_and_si256(_mm256_slli_epi16(tops, 4), bits45));
  v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), _mm256_and_si256(_mm256_slli_epi16(tops, 2), bits45));
  v[2] = _mm256_or_si256(_mm256_and_si256(raw2, low4), _mm256_and_si256(tops, bits45));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw2, 4), low4), _mm256_and_si256(_mm256_srli_epi16(tops, 2), bits45));
}

// One 32-input sub-block's products of a group: f(t, h, pairs) is called with int16 pairs of
// products of row t and half h (rows 8h to 8h + 7) (maddubs of codes <= 127 by int8 activations;
// each int16 pair belongs to one row), each small enough for one more int16 addition of its like.
// 8-bit codes above 127 (Q8_0's, z = 128) would overflow maddubs: they are taken back to signed
// values and multiplied by |code| with the activation's sign moved.
template <int T, int BITS, typename F>
inline void pairs_sub(const uint8_t* codes, const int8_t* const* xr, int64_t k0, bool signed8, F&& f) {
  constexpr int64_t STEPS = 32 / step_k<BITS>();
  const __m256i low4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8((char)0x80);
  for (int64_t c = 0; c < STEPS; ++c) {
    const uint8_t* chunk = codes + c * step_bytes<BITS>();
    const int64_t k = k0 + c * step_k<BITS>();
    if (T >= prefetch_rows)
      for (int64_t b = 0; b < step_bytes<BITS>(); b += 64) _mm_prefetch((const char*)chunk + PREFETCH_BYTES + b, _MM_HINT_T0);
    auto x4 = [&](int t, int64_t kk) { return _mm256_set1_epi32(load_i32(xr[t] + kk)); };
    for (int h = 0; h < 2; ++h) {
      if (BITS == 6) {  // products <= 63 * 127: two pairs of them fit int16
        __m256i v[4];
        unpack6_half(chunk, h, v);
        for (int t = 0; t < T; ++t) {
          f(t, h, _mm256_add_epi16(_mm256_maddubs_epi16(v[0], x4(t, k)), _mm256_maddubs_epi16(v[1], x4(t, k + 4))));
          f(t, h, _mm256_add_epi16(_mm256_maddubs_epi16(v[2], x4(t, k + 8)), _mm256_maddubs_epi16(v[3], x4(t, k + 12))));
        }
        continue;
      }
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + h * 32));
      if (BITS == 4) {  // products <= 15 * 127: a 32-input sub-block's 8 pairs of them fit int16
        const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int t = 0; t < T; ++t)
          f(t, h, _mm256_add_epi16(_mm256_maddubs_epi16(lo, x4(t, k)), _mm256_maddubs_epi16(hi, x4(t, k + 4))));
      } else if (signed8) {
        const __m256i value = _mm256_xor_si256(raw, top);  // code - 128, as int8
        const __m256i magnitude = _mm256_abs_epi8(value);
        for (int t = 0; t < T; ++t) f(t, h, _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x4(t, k), value)));
      } else {
        for (int t = 0; t < T; ++t) f(t, h, _mm256_maddubs_epi16(raw, x4(t, k)));
      }
    }
  }
}

#if defined(__AVX2__) && defined(__AVXVNNI__)
// 8 bytes -> 8 int32 lanes
inline __m256i load_int32x8(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

// AVX-VNNI (Alder Lake and later, and Sapphire Rapids held to 256 bits): isum[t] += sc_s * dot_s for
// one sub-block's codes (STEPS steps) and half group h, dot_s summed by vpdpbusd in int32 (one
// instruction where AVX2 takes maddubs and an add), then times sc_s by vpmulld: the same integers
// as AVX2's int16 pairs widened by madd, so the same bits
template <int T, int BITS, int64_t STEPS>
inline void sub_dot_vnni(const uint8_t* sub_codes, int h, const int8_t* const* xr, int64_t k0, __m256i sc,
                         __m256i* isum) {
  // each row's sum in CHAINS accumulators: vpdpbusd's latency would otherwise hold a row or two
  // to one instruction every 5 cycles (a one-row step was 7-11% slower than AVX2's with one)
  constexpr int CHAINS = T < 4 ? 2 : 1;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  auto x4 = [&](int t, int64_t k) { return _mm256_set1_epi32(load_i32(xr[t] + k)); };
  __m256i iacc[CHAINS][T];
  for (int i = 0; i < CHAINS; ++i)
    for (int t = 0; t < T; ++t) iacc[i][t] = _mm256_setzero_si256();
  for (int64_t c = 0; c < STEPS; ++c) {
    const int64_t k = k0 + c * step_k<BITS>();
    if (BITS == 4) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub_codes + c * 64 + 32 * h));
      const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int t = 0; t < T; ++t) iacc[0][t] = _mm256_dpbusd_avx_epi32(iacc[0][t], lo, x4(t, k));
      for (int t = 0; t < T; ++t) iacc[CHAINS - 1][t] = _mm256_dpbusd_avx_epi32(iacc[CHAINS - 1][t], hi, x4(t, k + 4));
    } else {
      __m256i v[4];
      unpack6_half(sub_codes + c * 192, h, v);
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < T; ++t)
          iacc[i % CHAINS][t] = _mm256_dpbusd_avx_epi32(iacc[i % CHAINS][t], v[i], x4(t, k + 4 * i));
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m256i dot = CHAINS == 2 ? _mm256_add_epi32(iacc[0][t], iacc[CHAINS - 1][t]) : iacc[0][t];
    isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot, sc));
  }
}
#endif

// k-quants (sc per sub-block of S inputs, SB = AB): integer sums per super-block, the sub-block
// scale applied by the madd that widens the int16 pairs; the rows' sums so far live in y. A
// super-block is done a half group at a time (rows 0-7, then 8-15: its codes, 2-3 KB, are in L1
// for the second half), so that a half's 7 row sums, its unpacked codes and the temporaries fit
// AVX2's 16 registers: with both halves in one pass, GCC kept the 14 int16 pair sums on the stack,
// a load and a store per step (docs/runner.md has the measurements).
// 4-bit codes are widened every two steps (8 inputs x 2), so that 4 code registers suffice.
template <int T, int BITS, int S>
void group_tile_k(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* y, int64_t ldy,
                  int64_t col0) {
  constexpr int64_t STEPS = S / step_k<BITS>();  // steps per sub-block
  static_assert(BITS != 4 || STEPS % 2 == 0, "4-bit codes are taken two steps at a time");
  const int64_t nsub = L.K / S, subs_per_sb = L.SB / S;
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  const uint8_t* coefs = L.has_mn ? w.mn : w.sc;
  const bool coef_signed = !L.has_mn && L.sc_signed;
  const int8_t* xr[T];
  const int16_t* xs[T];
  const float* dxr[T];
  float* out[T];
  for (int t = 0; t < T; ++t) {
    xr[t] = a.xq + (r0 + t) * L.K, xs[t] = sub_sums(a, L, r0 + t), out[t] = y + (r0 + t) * ldy + col0 + g * LANES;
    dxr[t] = act_scales(a, L, r0 + t);
    _mm256_storeu_ps(out[t], _mm256_setzero_ps());
    _mm256_storeu_ps(out[t] + 8, _mm256_setzero_ps());
  }
  auto x4 = [&](int t, int64_t k) { return _mm256_set1_epi32(load_i32(xr[t] + k)); };
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < L.K / L.SB; ++sb) {
    const int64_t s0 = sb * subs_per_sb, meta_sb = (g * (L.K / L.SB) + sb) * LANES;
    for (int h = 0; h < 2; ++h) {
      // the correction sum_s c_s xs_s, two sub-blocks per madd
      __m256i isum[T];
      for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
      for (int64_t s = s0; s < s0 + subs_per_sb; s += 2) {
        const __m128i c0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(coefs + (g * nsub + s) * LANES + 8 * h));
        const __m128i c1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(coefs + (g * nsub + s + 1) * LANES + 8 * h));
        const __m128i pairs8 = _mm_unpacklo_epi8(c0, c1);
        const __m256i pairs = coef_signed ? _mm256_cvtepi8_epi16(pairs8) : _mm256_cvtepu8_epi16(pairs8);
        for (int t = 0; t < T; ++t)
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(pairs, _mm256_set1_epi32(load_i32(xs[t] + s))));
      }
      const __m256 d = load_half8(w.d + meta_sb + 8 * h);
      const __m256 cc = L.has_mn ? load_half8(w.dmin + meta_sb + 8 * h) : _mm256_mul_ps(d, _mm256_set1_ps(-(float)L.z));
      for (int t = 0; t < T; ++t) {
        const __m256 dx = _mm256_set1_ps(dxr[t][sb]);
        _mm256_storeu_ps(out[t] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(cc, dx),
                                                         _mm256_loadu_ps(out[t] + 8 * h)));
        isum[t] = _mm256_setzero_si256();
      }
      // the codes: sum_s sc_s dot_s per row
      for (int64_t s = s0; s < s0 + subs_per_sb; ++s) {
        const uint8_t* sub_codes = codes + s * STEPS * step_bytes<BITS>();
        if (T >= prefetch_rows && h == 0)
          for (int64_t b = 0; b < STEPS * step_bytes<BITS>(); b += 64) _mm_prefetch((const char*)sub_codes + PREFETCH_BYTES + b, _MM_HINT_T0);
#if defined(__AVXVNNI__)
        if constexpr (T >= 2) {  // one row (a decode step, memory-bound) keeps AVX2's instructions: the same bits
          sub_dot_vnni<T, BITS, STEPS>(sub_codes, h, xr, s * S,
                                       load_int32x8(w.sc + (g * nsub + s) * LANES + 8 * h, L.sc_signed), isum);
          continue;
        }
#endif
        const __m256i sc = load_twice16(w.sc + (g * nsub + s) * LANES + 8 * h, L.sc_signed);
        if (BITS == 4) {  // products <= 15 * 127: 4 pairs of them fit int16
          for (int64_t c = 0; c < STEPS; c += 2) {
            const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub_codes + c * 64 + 32 * h));
            const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub_codes + (c + 1) * 64 + 32 * h));
            const __m256i lo0 = _mm256_and_si256(raw0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low4);
            const __m256i lo1 = _mm256_and_si256(raw1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low4);
            const int64_t k = s * S + c * 8;
            for (int t = 0; t < T; ++t) {
              const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x4(t, k)), _mm256_maddubs_epi16(hi0, x4(t, k + 4)));
              const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x4(t, k + 8)), _mm256_maddubs_epi16(hi1, x4(t, k + 12)));
              isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), sc));
            }
          }
        } else {  // 6-bit: products <= 63 * 127, two pairs of them fit int16
          for (int64_t c = 0; c < STEPS; ++c) {
            const int64_t k = s * S + c * 16;
            __m256i v[4];
            unpack6_half(sub_codes + c * 192, h, v);
            for (int t = 0; t < T; ++t) {
              const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], x4(t, k)), _mm256_maddubs_epi16(v[1], x4(t, k + 4)));
              const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], x4(t, k + 8)), _mm256_maddubs_epi16(v[3], x4(t, k + 12)));
              isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc)));
            }
          }
        }
      }
      for (int t = 0; t < T; ++t)
        _mm256_storeu_ps(out[t] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, _mm256_set1_ps(dxr[t][sb])),
                                                         _mm256_loadu_ps(out[t] + 8 * h)));
    }
  }
}

// legacy types (no sc; SB = S = 32): float sums per sub-block, both halves in one pass
template <int T, int BITS>
void group_tile_legacy(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* y,
                       int64_t ldy, int64_t col0) {
  const int64_t nsub = L.K / 32, sub_bytes = 32 / step_k<BITS>() * step_bytes<BITS>();
  const uint8_t* codes = w.codes + g * (L.K / step_k<BITS>()) * step_bytes<BITS>();
  // Q8_0 (codes above 127): pairs_sub sums x (code - 128), and the sums start at 128 xs, which takes
  // them to the sums of x code that the AVX-512 kernel makes, so that both take the same float steps
  // (z = 128) and give the same bits
  const bool signed8 = BITS == 8 && L.z == 128;
  const float z = (float)L.z;
  const __m256i ones16 = _mm256_set1_epi16(1);
  const int8_t* xr[T];
  const int16_t* xs[T];
  const float* dxr[T];
  for (int t = 0; t < T; ++t) xr[t] = a.xq + (r0 + t) * L.K, xs[t] = sub_sums(a, L, r0 + t), dxr[t] = act_scales(a, L, r0 + t);
  const int shift = act_shift(a);
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsub; ++s) {
    __m256i iacc[T][2];
    for (int t = 0; t < T; ++t)
      iacc[t][0] = iacc[t][1] = signed8 ? _mm256_set1_epi32(128 * (int32_t)xs[t][s]) : _mm256_setzero_si256();
    if (BITS == 4) {
      __m256i pairs16[T][2];
      for (int t = 0; t < T; ++t) pairs16[t][0] = pairs16[t][1] = _mm256_setzero_si256();
      pairs_sub<T, BITS>(codes + s * sub_bytes, xr, s * 32, false,
                         [&](int t, int h, __m256i p) { pairs16[t][h] = _mm256_add_epi16(pairs16[t][h], p); });
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h) iacc[t][h] = _mm256_madd_epi16(pairs16[t][h], ones16);
    } else {
      pairs_sub<T, BITS>(codes + s * sub_bytes, xr, s * 32, signed8, [&](int t, int h, __m256i p) {
        iacc[t][h] = _mm256_add_epi32(iacc[t][h], _mm256_madd_epi16(p, ones16));
      });
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = load_half8(w.d + (g * nsub + s) * LANES + h * 8);
      __m256 offset = _mm256_mul_ps(scale, _mm256_set1_ps(-z));
      if (L.has_dmin) offset = _mm256_add_ps(offset, load_half8(w.dmin + (g * nsub + s) * LANES + h * 8));
      for (int t = 0; t < T; ++t) {
        const float dx = dxr[t][(s * 32) >> shift];
        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t][h]), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), acc[t][h]);
        acc[t][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(dx * (float)xs[t][s]), acc[t][h]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (r0 + t) * ldy + col0 + g * LANES + h * 8, acc[t][h]);
}
#endif

template <int T, int BITS>
void group_tile(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r0, float* y, int64_t ldy,
                int64_t col0) {
  if constexpr (BITS == 8) {
    group_tile_legacy<T, BITS>(L, w, g, a, r0, y, ldy, col0);
  } else {
    if (L.has_sc && L.S == 16) group_tile_k<T, BITS, 16>(L, w, g, a, r0, y, ldy, col0);
    else if (L.has_sc) group_tile_k<T, BITS, 32>(L, w, g, a, r0, y, ldy, col0);
    else group_tile_legacy<T, BITS>(L, w, g, a, r0, y, ldy, col0);
  }
}

// the last rows (fewer than MAX_TILE) as one tile of T = rows
template <int BITS, int T = 1>
void run_last_rows(const Layout& L, const Weights& w, int64_t g, const Acts& a, int64_t r, float* y, int64_t ldy,
                   int64_t col0) {
  if constexpr (T < MAX_TILE) {
    if (a.M - r == T) group_tile<T, BITS>(L, w, g, a, r, y, ldy, col0);
    else run_last_rows<BITS, T + 1>(L, w, g, a, r, y, ldy, col0);
  }
}

template <int BITS>
void run_group(const Layout& L, const Weights& w, int64_t g, const Acts& a, float* y, int64_t ldy, int64_t col0) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (amx_takes(a, L)) return amx_run_group<BITS>(L, w, g, a, y, ldy, col0);
#endif
  int64_t r = 0;
  for (; r + MAX_TILE <= a.M; r += MAX_TILE) group_tile<MAX_TILE, BITS>(L, w, g, a, r, y, ldy, col0);
  if (r < a.M) run_last_rows<BITS>(L, w, g, a, r, y, ldy, col0);
}

// a, with its activation codes packed as A tiles where the AMX kernel takes the product of a's rows
// by some of the weights laid out as layouts (their bytes in storage, which must outlive the product)
inline Acts with_tiles(Acts a, const Layout* layouts, size_t count, std::vector<int8_t>& storage) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  for (size_t i = 0; i < count; ++i)
    if (amx_takes(a, layouts[i])) {
      pack_tile_activations(a, layouts[i].K, storage);
      break;
    }
#else
  (void)layouts, (void)count, (void)storage;
#endif
  return a;
}

const uint8_t* bytes_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<uint8_t>() : nullptr;
}

}  // namespace

// Quantize activations once for several products: x [M, K] (gated: [M, 2K]) float32 or bfloat16 ->
// (xq int8 [M, K], dx float32 [M, K/AB], xsum int16 [M, K/16 + K/32]), after the prologue.
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, const Prologue& pro = Prologue()) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = pro.gated ? x.size(1) / 2 : x.size(1);
  TORCH_CHECK(K % 32 == 0 && (!pro.gated || x.size(1) % 2 == 0), "K must be a multiple of 32");
  const int64_t AB = act_block(K);
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto dx = at::empty({M, K / AB}, x.options().dtype(at::kFloat));
  auto xsum = at::empty({M, K / SUM_BLOCK + K / 32}, x.options().dtype(at::kShort));
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x.data_ptr<float>(), M, K, pro, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xsum.data_ptr<int16_t>());
  else
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, pro, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                  xsum.data_ptr<int16_t>());
  return {xq, dx, xsum};
}

// y[:, col0 : col0 + N] = x W^T for quantized x (from quantize_activations) and W in the layout above.
void qmatmul_into(const at::Tensor& xq, const at::Tensor& dx, const at::Tensor& xsum, const at::Tensor& codes,
                  const c10::optional<at::Tensor>& sc, const c10::optional<at::Tensor>& mn, const at::Tensor& d,
                  const c10::optional<at::Tensor>& dmin, int64_t bits, int64_t S, int64_t SB, int64_t z,
                  bool sc_signed, at::Tensor& y, int64_t col0) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(), "xq: contiguous int8 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(S == 16 || S == 32, "S must be 16 or 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && d.scalar_type() == at::kHalf,
              "codes: uint8, d: float16");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == xq.size(0),
              "y: contiguous float32 [M, N_total]");
  Layout L;
  L.K = xq.size(1);
  L.N = codes.size(0) * LANES;
  L.bits = bits; L.S = S; L.SB = SB; L.z = z;
  L.has_sc = sc.has_value() && sc->defined(); L.sc_signed = sc_signed;
  L.has_mn = mn.has_value() && mn->defined(); L.has_dmin = dmin.has_value() && dmin->defined();
  TORCH_CHECK(codes.numel() == L.N * L.K * bits / 8, "codes do not hold N x K codes");
  TORCH_CHECK(L.K % SB == 0 && SB % S == 0 && d.numel() == L.N / LANES * (L.K / SB) * LANES, "d: [G, K/SB, 16]");
  TORCH_CHECK(col0 >= 0 && col0 + L.N <= y.size(1), "y too narrow");
  Weights w{codes.data_ptr<uint8_t>(), bytes_or_null(sc), bytes_or_null(mn),
            reinterpret_cast<const at::Half*>(d.data_ptr()),
            L.has_dmin ? reinterpret_cast<const at::Half*>(dmin->data_ptr()) : nullptr};
  TORCH_CHECK(dx.size(1) == L.K / act_block(L.K) && xsum.scalar_type() == at::kShort, "dx, xsum: from quantize_activations");
  TORCH_CHECK(!L.has_sc || (L.SB == K_SUPER && act_block(L.K) == K_SUPER),
              "k-quants need super-blocks of 256 inputs, one activation scale each");
  std::vector<int8_t> tiles;
  const Acts a = with_tiles(Acts{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xsum.data_ptr<int16_t>(), xq.size(0), act_block(L.K)},
                            &L, 1, tiles);
  float* out = y.data_ptr<float>();
  const int64_t ldy = y.size(1), groups = L.N / LANES;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (bits == 4) run_group<4>(L, w, g, a, out, ldy, col0);
      else if (bits == 6) run_group<6>(L, w, g, a, out, ldy, col0);
      else run_group<8>(L, w, g, a, out, ldy, col0);
    }
  });
}

specdec_kernels::QLinear::QLinear(const std::vector<at::Tensor>& codes, const Optionals& sc, const Optionals& mn,
                                   const std::vector<at::Tensor>& d, const Optionals& dmin,
                                   const std::vector<int64_t>& layouts, const c10::optional<at::Tensor>& bias_) {
  const int64_t parts = (int64_t)codes.size();
  TORCH_CHECK(parts > 0 && (int64_t)d.size() == parts && (int64_t)sc.size() == parts && (int64_t)mn.size() == parts &&
              (int64_t)dmin.size() == parts && (int64_t)layouts.size() == 5 * parts,
              "one codes, sc, mn, d, dmin and 5 layout numbers (bits, S, SB, z, sc_signed) per part");
  first_group.assign(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t bits = layouts[5 * p], S = layouts[5 * p + 1], SB = layouts[5 * p + 2];
    TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
    TORCH_CHECK(S == 16 || S == 32, "S must be 16 or 32");
    TORCH_CHECK(codes[p].scalar_type() == at::kByte && codes[p].is_contiguous() && d[p].scalar_type() == at::kHalf,
                "codes: uint8, d: float16");
    Layout l;
    l.N = codes[p].size(0) * LANES; l.bits = bits; l.S = S; l.SB = SB;
    l.K = codes[p].numel() * 8 / bits / l.N;
    l.z = layouts[5 * p + 3]; l.sc_signed = layouts[5 * p + 4] != 0;
    const c10::optional<at::Tensor> sc_p = sc[p], mn_p = mn[p], dmin_p = dmin[p];
    l.has_sc = sc_p.has_value() && sc_p->defined();
    l.has_mn = mn_p.has_value() && mn_p->defined();
    l.has_dmin = dmin_p.has_value() && dmin_p->defined();
    TORCH_CHECK(p == 0 || l.K == K, "stacked parts must have one input size");
    K = l.K;
    TORCH_CHECK(codes[p].numel() == l.N * K * bits / 8 && K % 32 == 0, "codes do not hold N x K codes");
    TORCH_CHECK(K % SB == 0 && SB % S == 0 && d[p].numel() == l.N / LANES * (K / SB) * LANES, "d: [G, K/SB, 16]");
    TORCH_CHECK(!l.has_sc || (SB == K_SUPER && act_block(K) == K_SUPER),
                "k-quants need super-blocks of 256 inputs, one activation scale each");
    TORCH_CHECK(!(l.has_mn && l.z != 0), "a type with both mn and z is not of the kernel's forms");
    L.push_back(l);
    W.push_back(Weights{codes[p].data_ptr<uint8_t>(), bytes_or_null(sc_p), bytes_or_null(mn_p),
                        reinterpret_cast<const at::Half*>(d[p].data_ptr()),
                        l.has_dmin ? reinterpret_cast<const at::Half*>(dmin_p->data_ptr()) : nullptr});
    first_group[p + 1] = first_group[p] + l.N / LANES;
    for (const auto& t : {c10::optional<at::Tensor>(codes[p]), sc_p, mn_p, c10::optional<at::Tensor>(d[p]), dmin_p})
      if (t.has_value() && t->defined()) keep_alive.push_back(*t);
  }
  N = first_group[parts] * LANES;
  if (bias_.has_value() && bias_->defined()) {
    TORCH_CHECK(bias_->scalar_type() == at::kFloat && bias_->is_contiguous() && bias_->numel() == N,
                "bias: float32 [N padded]");
    keep_alive.push_back(*bias_);
    bias = bias_->data_ptr<float>();
  }
}

void specdec_kernels::QLinear::run_into(const int8_t* xq, const float* dx, const int16_t* xsum, int64_t M, float* out,
                                       const std::function<void(int64_t, int64_t)>* after_group) const {
  std::vector<int8_t> tiles;
  const Acts a = with_tiles(Acts{xq, dx, xsum, M, act_block(K)}, L.data(), L.size(), tiles);
  const int64_t parts = (int64_t)L.size();
  at::parallel_for(0, first_group[parts], 1, [&](int64_t g0, int64_t g1) {
    int64_t p = 0;
    for (int64_t g = g0; g < g1; ++g) {
      while (g >= first_group[p + 1]) ++p;
      const int64_t local = g - first_group[p], col0 = first_group[p] * LANES;
      if (L[p].bits == 4) run_group<4>(L[p], W[p], local, a, out, N, col0);
      else if (L[p].bits == 6) run_group<6>(L[p], W[p], local, a, out, N, col0);
      else run_group<8>(L[p], W[p], local, a, out, N, col0);
      if (bias)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = g * LANES; n < (g + 1) * LANES; ++n) out[m * N + n] += bias[n];
      if (after_group != nullptr) (*after_group)(g * LANES, (g + 1) * LANES);
    }
  });
}

at::Tensor specdec_kernels::QLinear::run_plus(const at::Tensor& x, const Prologue& pro, const at::Tensor& residual) const {
  const int64_t M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == (pro.gated ? 2 * K : K), "x: [M, ", pro.gated ? 2 * K : K, "]");
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N && residual.is_contiguous(),
              "residual: contiguous [M, N]");
  auto acts = quantize_activations(x, pro);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  auto sum = at::empty_like(residual);
  float* yp = y.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "qlinear_plus", [&] {
    const scalar_t* r = residual.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    const std::function<void(int64_t, int64_t)> add = [&](int64_t n0, int64_t n1) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) s[m * N + n] = static_cast<scalar_t>(yp[m * N + n] + static_cast<float>(r[m * N + n]));
    };
    run_into(acts[0].data_ptr<int8_t>(), acts[1].data_ptr<float>(), acts[2].data_ptr<int16_t>(), M, yp, &add);
  });
  return sum;
}

at::Tensor specdec_kernels::QLinear::run(const at::Tensor& x, const Prologue& pro) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == (pro.gated ? 2 * K : K), "x: [M, ", pro.gated ? 2 * K : K, "]");
  auto acts = quantize_activations(x, pro);
  auto y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  run_into(acts[0].data_ptr<int8_t>(), acts[1].data_ptr<float>(), acts[2].data_ptr<int16_t>(), x.size(0),
           y.data_ptr<float>());
  return y;
}

Prologue specdec_kernels::make_prologue(const c10::optional<at::Tensor>& norm_weight, double eps, bool gated, int64_t K) {
  Prologue pro;
  pro.gated = gated;
  if (norm_weight.has_value() && norm_weight->defined()) {
    TORCH_CHECK(norm_weight->scalar_type() == at::kFloat && norm_weight->is_contiguous() && norm_weight->numel() == K,
                "norm_weight: float32 [K]");
    pro.norm_weight = norm_weight->data_ptr<float>();
    pro.eps = (float)eps;
  }
  return pro;
}

// A whole linear layer: x [M, K] (float32 or bfloat16; gated: [M, 2K]), after the prologue (gated,
// norm_weight: see Prologue), times the parts stacked by rows, plus the bias (float32 [N padded], or
// none): [M, N padded] float32. One pass of activation quantization and one parallel loop over every
// part's groups.
at::Tensor qlinear(const at::Tensor& x, at::TensorList codes, const c10::List<c10::optional<at::Tensor>>& sc,
                   const c10::List<c10::optional<at::Tensor>>& mn, at::TensorList d,
                   const c10::List<c10::optional<at::Tensor>>& dmin, at::IntArrayRef layouts,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& norm_weight, double eps,
                   bool gated) {
  auto optionals = [](const c10::List<c10::optional<at::Tensor>>& list) {
    QLinear::Optionals out;
    for (size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i));
    return out;
  };
  const QLinear linear(codes.vec(), optionals(sc), optionals(mn), d.vec(), optionals(dmin), layouts.vec(), bias);
  return linear.run(x, make_prologue(norm_weight, eps, gated, linear.K));
}

// Rows `ids` of W as float32 [len(ids), K]: an embedding's lookup (W = d * sc * (code - z) + dmin * mn).
at::Tensor dequantize_rows(const at::Tensor& ids, const at::Tensor& codes, const c10::optional<at::Tensor>& sc,
                           const c10::optional<at::Tensor>& mn, const at::Tensor& d,
                           const c10::optional<at::Tensor>& dmin, int64_t K, int64_t bits, int64_t S, int64_t SB,
                           int64_t z, bool sc_signed) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 [n]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && d.scalar_type() == at::kHalf, "codes, d");
  const int64_t N = codes.size(0) * LANES, n_ids = ids.size(0);
  auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_ids; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "token id ", id[i], " out of range");
  auto out = at::empty({n_ids, K}, d.options().dtype(at::kFloat));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* s = bytes_or_null(sc);
  const uint8_t* m = bytes_or_null(mn);
  const at::Half* dp = reinterpret_cast<const at::Half*>(d.data_ptr());
  const at::Half* dminp = dmin.has_value() && dmin->defined() ? reinterpret_cast<const at::Half*>(dmin->data_ptr()) : nullptr;
  const int64_t step_k = bits == 8 ? 4 : bits == 4 ? 8 : 16, step_bytes = bits == 6 ? 192 : 64;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n_ids, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = id[i] / LANES, lane = id[i] % LANES;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = k % step_k, q = lane * 4 + j % 4, v = j / 4;  // v: the vector of 4 inputs
        const uint8_t* step = c + (g * (K / step_k) + k / step_k) * step_bytes;
        int code = bits == 8 ? step[q] : (v % 2 == 0 ? step[64 * (v / 2) + q] & 0x0F : step[64 * (v / 2) + q] >> 4);
        if (bits == 6) code |= ((step[128 + q] >> (2 * v)) & 3) << 4;
        const int64_t meta = (g * (K / S) + k / S) * LANES + lane, super = (g * (K / SB) + k / SB) * LANES + lane;
        float scale = (float)dp[super];
        if (s) scale *= sc_signed ? (float)(int8_t)s[meta] : (float)s[meta];
        float w = scale * (float)(code - z);
        if (dminp) w += (float)dminp[super] * (m ? (float)m[meta] : 1.f);
        o[i * K + k] = w;
      }
    }
  });
  return out;
}

// the kernel multiplying products of several rows: "amx", "avx512_vnni+amx" (VNNI, and the tiles
// for Q4_K and Q5_K products of 32 rows or more: amx.h, AmxUse), "avx512_vnni", "avx_vnni" or "avx2"
std::string isa() {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (amx_use == AmxUse::always) return "amx";
  if (amx_use == AmxUse::wide) return "avx512_vnni+amx";
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVXVNNI__)
  return "avx_vnni";
#else
  return "avx2";
#endif
}

// Choose the kernel for products of several rows among those this build holds: "amx" (every type
// on the tiles), "auto" (the tiles where they are faster: isa() "avx512_vnni+amx"), both asking Linux
// for the tile state (an error where it refuses), or this build's vector kernel (isa() without AMX).
void set_kernel(const std::string& name) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  const std::string vector_kernel = "avx512_vnni";
  if (name == "amx" || name == "auto") {
    TORCH_CHECK(amx_request(), "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): ",
                "a kernel older than 5.16, or a VM that hides AMX; use SPECDEC_KERNEL=avx512_vnni");
  } else {
    TORCH_CHECK(name == vector_kernel, "this build of specdec's kernels has no ", name, " kernel (it has amx, auto and ",
                vector_kernel, ")");
  }
  amx_use = name == "amx" ? AmxUse::always : name == "auto" ? AmxUse::wide : AmxUse::never;
#else
  TORCH_CHECK(name == isa(), "this build of specdec's kernels has no ", name, " kernel (it has ", isa(), ")");
#endif
}

// x W^T for x quantized by quantize_activations: [M, N padded to 16] float32.
at::Tensor qmatmul(const at::Tensor& xq, const at::Tensor& dx, const at::Tensor& xsum, const at::Tensor& codes,
                   const c10::optional<at::Tensor>& sc, const c10::optional<at::Tensor>& mn, const at::Tensor& d,
                   const c10::optional<at::Tensor>& dmin, int64_t bits, int64_t S, int64_t SB, int64_t z,
                   bool sc_signed) {
  auto y = at::empty({xq.size(0), codes.size(0) * LANES}, dx.options());
  qmatmul_into(xq, dx, xsum, codes, sc, mn, d, dmin, bits, S, SB, z, sc_signed, y, 0);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations_op(const at::Tensor& x) {
  auto parts = quantize_activations(x);
  return {parts[0], parts[1], parts[2]};
}

// torch.ops.specdec.*: dispatcher ops, so that torch.compile can put them in a graph
TORCH_LIBRARY(specdec, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qmatmul(Tensor xq, Tensor dx, Tensor xsum, Tensor codes, Tensor? sc, Tensor? mn, Tensor d, Tensor? dmin, "
        "int bits, int S, int SB, int z, bool sc_signed) -> Tensor");
  m.def("qlinear(Tensor x, Tensor[] codes, Tensor?[] sc, Tensor?[] mn, Tensor[] d, Tensor?[] dmin, int[] layouts, "
        "Tensor? bias, Tensor? norm_weight=None, float eps=0.0, bool gated=False) -> Tensor");
  m.def("dequantize_rows(Tensor ids, Tensor codes, Tensor? sc, Tensor? mn, Tensor d, Tensor? dmin, int K, int bits, "
        "int S, int SB, int z, bool sc_signed) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("quantize_activations", &quantize_activations_op);
  m.impl("qmatmul", &qmatmul);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("qlinear", &qlinear);
}

void register_decoder_layer(pybind11::module& m);  // layer.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decoder_layer(m);
  m.def("quantize_activations", [](const at::Tensor& x) { return quantize_activations(x); });
  m.def("qmatmul_into", &qmatmul_into);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("isa", &isa);
  m.def("set_kernel", &set_kernel);
  m.def("set_prefetch_rows", &set_prefetch_rows);
  m.def("prefetch_rows", &get_prefetch_rows);
}
