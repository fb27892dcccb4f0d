// Vectorisable elementwise math for the hot loops (libm's expf is a scalar call per element,
// which keeps GCC from vectorising the loop around it).
#pragma once

#include <cstdint>
#include <cstring>

#include "moeplug/dtype.h"

namespace moeplug {

// Cephes-style expf: range reduction to [-ln2/2, ln2/2] plus a degree-5 polynomial, ~1 ulp.
// Inputs are clamped so 2^n never overflows the exponent field; sigmoid only needs the
// saturated ends to be 0 or huge, which the clamp preserves.
MOEPLUG_INLINE float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float fx = x * 1.44269504088896341f;
  const float n = static_cast<float>(static_cast<int32_t>(fx + (fx >= 0.0f ? 0.5f : -0.5f)));
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace moeplug
