// 16-float vectors and the elementwise functions specdec's kernels share: one AVX-512 register,
// or two AVX2 ones holding the same lanes (0-7 and 8-15).
//
// Why two types: GCC lowers its 64-byte vector extension without AVX-512 by keeping every value
// in memory and moving it through general registers between operations: the attention of a
// verify forward held to AVX2 took a large share of the forward that way (perf: stack stores and
// reloads; docs/runner.md, "GGUF weights, run quantized"); a pair of native 8-float vectors keeps
// the values in registers.

#pragma once

#include <cstdint>
#include <cstring>

namespace specdec_vec {

constexpr int LANES16 = 16;

#if defined(__AVX512F__)
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));

inline vfloat splat(float x) { return vfloat{} + x; }
inline vfloat vmin(vfloat a, vfloat b) { return a < b ? a : b; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
inline vfloat vabs(vfloat a) { return a < 0.f ? -a : a; }
// x < bound ? a : b, lane by lane
inline vfloat where_less(vfloat x, vfloat bound, vfloat a, vfloat b) { return x < bound ? a : b; }
// the lanes' values (integers in float) as int32
inline vint to_int(vfloat x) { return __builtin_convertvector(x, vint); }
// int32 lanes' bits as floats
inline vfloat as_float(vint x) { return (vfloat)x; }
// floats whose top 16 bits are bits[0..15] (bfloat16 values as float32)
inline vfloat from_top_bits(const uint16_t* bits) {
  typedef uint16_t v16u __attribute__((vector_size(32)));
  v16u b;
  std::memcpy(&b, bits, sizeof(b));
  return as_float(__builtin_convertvector(b, vint) << 16);
}
inline vfloat load16(const float* p) { vfloat v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
#else
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

struct vfloat {
  v8f lo, hi;
  float operator[](int l) const { return l < 8 ? lo[l] : hi[l - 8]; }
};
struct vint {
  v8i lo, hi;
  int32_t operator[](int l) const { return l < 8 ? lo[l] : hi[l - 8]; }
};

inline vfloat operator+(vfloat a, vfloat b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline vfloat operator-(vfloat a, vfloat b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline vfloat operator*(vfloat a, vfloat b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline vfloat operator/(vfloat a, vfloat b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline vfloat operator-(vfloat a) { return {-a.lo, -a.hi}; }
inline vfloat operator+(vfloat a, float b) { return {a.lo + b, a.hi + b}; }
inline vfloat operator-(vfloat a, float b) { return {a.lo - b, a.hi - b}; }
inline vfloat operator*(vfloat a, float b) { return {a.lo * b, a.hi * b}; }
inline vfloat operator+(float a, vfloat b) { return {a + b.lo, a + b.hi}; }
inline vfloat operator*(float a, vfloat b) { return {a * b.lo, a * b.hi}; }
inline vfloat& operator+=(vfloat& a, vfloat b) { a.lo += b.lo; a.hi += b.hi; return a; }
inline vint operator+(vint a, int32_t b) { return {a.lo + b, a.hi + b}; }
inline vint operator<<(vint a, int b) { return {a.lo << b, a.hi << b}; }

inline vfloat splat(float x) { return {v8f{} + x, v8f{} + x}; }
inline vfloat vmin(vfloat a, vfloat b) { return {a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi}; }
inline vfloat vmax(vfloat a, vfloat b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline vfloat vabs(vfloat a) { return {a.lo < 0.f ? -a.lo : a.lo, a.hi < 0.f ? -a.hi : a.hi}; }
inline vfloat where_less(vfloat x, vfloat bound, vfloat a, vfloat b) {
  return {x.lo < bound.lo ? a.lo : b.lo, x.hi < bound.hi ? a.hi : b.hi};
}
inline vint to_int(vfloat x) { return {__builtin_convertvector(x.lo, v8i), __builtin_convertvector(x.hi, v8i)}; }
inline vfloat as_float(vint x) { return {(v8f)x.lo, (v8f)x.hi}; }
inline vfloat from_top_bits(const uint16_t* bits) {
  typedef uint16_t v8u __attribute__((vector_size(16)));
  v8u lo, hi;
  std::memcpy(&lo, bits, sizeof(lo));
  std::memcpy(&hi, bits + 8, sizeof(hi));
  return as_float(vint{__builtin_convertvector(lo, v8i) << 16, __builtin_convertvector(hi, v8i) << 16});
}
// half by half: a copy of the whole struct goes through the stack
inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v.lo, p, sizeof(v8f));
  std::memcpy(&v.hi, p + 8, sizeof(v8f));
  return v;
}
inline void store16(float* p, vfloat v) {
  std::memcpy(p, &v.lo, sizeof(v8f));
  std::memcpy(p + 8, &v.hi, sizeof(v8f));
}
#endif

static_assert(sizeof(vfloat) == 64 && sizeof(vint) == 64, "16 lanes of 4 bytes");

// exp(x), 16 at a time, for x in [-87, 88] (clamped there): 2^n e^r with |r| <= ln2 / 2 and e^r by
// a degree-6 polynomial (relative error ~2e-7).
inline vfloat exp16(vfloat x) {
  const vfloat clamped = vmin(vmax(x, splat(-87.f)), splat(88.f));
  const vfloat rounder = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vfloat n = (clamped * 1.44269504f + rounder) - rounder;
  const vfloat r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  vfloat p = splat(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * as_float((to_int(n) + 127) << 23);  // p * 2^n
}

}  // namespace specdec_vec
