// Vectorisable elementwise math for the hot loops (libm's expf is a scalar call per element,
// which keeps GCC from vectorising the loop around it).
#pragma once

#include <cstdint>
#include <cstring>

#include "moeplug/dtype.h"
#include "moeplug/vec8.h"

namespace moeplug {

// e^x for x = n ln2 + r: the reduction of r and the degree-5 polynomial, for a float or a
// v8f (the same operations in the same order, so a lane equals the scalar bit for bit).
template <class V>
MOEPLUG_INLINE V exp_of_reduced(V x, V n) {
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// Cephes-style expf: range reduction to [-ln2/2, ln2/2] plus a degree-5 polynomial, ~1 ulp.
// Inputs are clamped so 2^n never overflows the exponent field; sigmoid only needs the
// saturated ends to be 0 or huge, which the clamp preserves.
MOEPLUG_INLINE float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float fx = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(fx + (fx >= 0.0f ? 0.5f : -0.5f));
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_of_reduced(x, static_cast<float>(ni)) * scale;
}

// exp_approx on eight lanes (the SwiGLU loops' body; their scalar tails use exp_approx).
MOEPLUG_INLINE v8f exp_approx8(v8f x) {
  x = x < -87.0f ? splat8(-87.0f) : x;  // NaN passes through both, as in the scalar
  x = x > 88.0f ? splat8(88.0f) : x;
  const v8f fx = x * 1.44269504088896341f;
  // +-0.5 with fx's sign, by its sign bit rather than a compare. Differs from the scalar's
  // `fx >= 0` only at fx = -0.0, where both round to n = 0.
  v8u32 fx_bits;
  std::memcpy(&fx_bits, &fx, sizeof fx_bits);
  const v8u32 half_bits = (fx_bits & 0x80000000u) | 0x3F000000u;  // 0x3F000000 = 0.5f
  v8f half;
  std::memcpy(&half, &half_bits, sizeof half);
  const v8i32 ni = __builtin_convertvector(fx + half, v8i32);
  const v8i32 bits = (ni + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_of_reduced(x, __builtin_convertvector(ni, v8f)) * scale;
}

}  // namespace moeplug
