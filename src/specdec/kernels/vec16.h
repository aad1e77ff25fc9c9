// 16-float vectors (GCC's vector extension) and the elementwise functions specdec's kernels share.
// The compiler lowers a vfloat to one AVX-512 register or two AVX2 ones: the same lanes either way.

#pragma once

#include <cstdint>
#include <cstring>

namespace specdec_vec {

constexpr int LANES16 = 16;
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));

inline vfloat splat(float x) { return vfloat{} + x; }
inline vfloat load16(const float* p) { vfloat v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// exp(x), 16 at a time, for x in [-87, 88] (clamped there): 2^n e^r with |r| <= ln2 / 2 and e^r by
// a degree-6 polynomial (relative error ~2e-7).
inline vfloat exp16(vfloat x) {
  const vfloat lowest = splat(-87.f), highest = splat(88.f);
  vfloat clamped = x < lowest ? lowest : x;
  clamped = clamped > highest ? highest : clamped;
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
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat power;
  std::memcpy(&power, &bits, sizeof(power));
  return p * power;
}

}  // namespace specdec_vec
