// Sixteen fp32 lanes as a GCC/Clang vector type, with bf16 <-> fp32 loads and stores.
//
// For the loops GCC will not vectorise on its own: written with vector types, a loop is one
// zmm register per 16 lanes in the x86-64-v4 clone and is lowered to ymm/xmm pairs in the
// others, so the same source serves every target_clones level (intrinsics would not compile in
// the default clone). Conversions match dtype.h's scalar bf16_to_f32 / f32_to_bf16 bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "moeplug/dtype.h"

// The helpers below are always_inline into the target_clones bodies, so no v16f ever crosses a
// call boundary; GCC's note that passing one by value would change the ABI does not apply. It
// is given where the helpers are used too, so the pragma stays on for the including file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moeplug {

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

MOEPLUG_INLINE v16f splat16(float v) { return v16f{} + v; }

MOEPLUG_INLINE v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

MOEPLUG_INLINE v16f load16(const uint16_t* p) {
  v16u16 h;
  std::memcpy(&h, p, sizeof h);
  const v16u32 u = __builtin_convertvector(h, v16u32) << 16;
  v16f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

MOEPLUG_INLINE void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// Round to nearest even; NaNs stay quiet NaNs (as f32_to_bf16).
MOEPLUG_INLINE void store16(uint16_t* p, v16f v) {
  v16u32 u;
  std::memcpy(&u, &v, sizeof u);
  const v16u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const v16u32 nan = (u >> 16) | 0x40u;
  const v16u32 out = (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
  const v16u16 h = __builtin_convertvector(out, v16u16);
  std::memcpy(p, &h, sizeof h);
}

}  // namespace moeplug
