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

MOEPLUG_INLINE v16f splat16(float v) { return v16f{} + v; }

// Compares go through two 32-byte halves. GCC 12 lowers a compare (or a ?: select) of 64-byte
// vectors lane by lane, in scalar code, wherever the target has no 64-byte registers: every
// clone but x86-64-v4. The SwiGLU forward ran ~20x slower on an AVX2 host that way (1.0 ms for
// 1024 x 256 lanes, where torch's silu * up took 0.57). 32-byte compares are vcmpps/vblendvps on
// ymm in the v3 clone and xmm pairs in the default one; the v4 clone runs two ymm compares.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

template <class V8, class V16, class Fn>
MOEPLUG_INLINE V16 by_halves(V16 v, Fn fn) {
  static_assert(sizeof(V16) == 2 * sizeof(V8), "two halves");
  V8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  lo = fn(lo);
  hi = fn(hi);
  V16 out;
  std::memcpy(&out, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof lo, &hi, sizeof hi);
  return out;
}

// min(max(x, lo), hi) lane by lane, as the scalar `x < lo ? lo : x` then `x > hi ? hi : x`
// (NaN passes through both).
MOEPLUG_INLINE v16f clamp16(v16f x, float lo, float hi) {
  return by_halves<v8f>(x, [lo, hi](v8f h) {
    h = h < lo ? v8f{} + lo : h;
    return h > hi ? v8f{} + hi : h;
  });
}

MOEPLUG_INLINE v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

MOEPLUG_INLINE void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

// Eight lanes: for loops that carry vectors from one iteration to the next (accumulators).
// GCC 12 keeps a 64-byte vector variable in memory wherever the target has no 64-byte
// registers, so a v16f accumulator cost a stack round trip (through general registers) per
// operation in the x86-64-v3 and default clones: bf16 unpermute ran at 0.47 of memcpy on an
// AVX2 host. A v8f is one ymm register in the v3 and v4 clones.
MOEPLUG_INLINE v8f splat8(float v) { return v8f{} + v; }

MOEPLUG_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

MOEPLUG_INLINE v8f load8(const uint16_t* p) {
  v8u16 h;
  std::memcpy(&h, p, sizeof h);
  const v8u32 u = __builtin_convertvector(h, v8u32) << 16;
  v8f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

MOEPLUG_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// Round to nearest even; NaNs stay quiet NaNs (as f32_to_bf16).
MOEPLUG_INLINE void store8(uint16_t* p, v8f v) {
  v8u32 u;
  std::memcpy(&u, &v, sizeof u);
  const v8u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const v8u32 nan = (u >> 16) | 0x40u;
  // NaN lanes (|u| above +inf's bits) take `nan`, compared as signed ints (|u| < 2^31, so
  // signed and unsigned agree; AVX2 has no unsigned compare).
  v8i32 abs_bits;
  std::memcpy(&abs_bits, &u, sizeof abs_bits);
  abs_bits &= 0x7FFFFFFF;
  const v8i32 is_nan = abs_bits > 0x7F800000;  // -1 where NaN, else 0
  v8u32 mask;
  std::memcpy(&mask, &is_nan, sizeof mask);
  const v8u32 out = (nan & mask) | (rounded & ~mask);
  const v8u16 h = __builtin_convertvector(out, v8u16);
  std::memcpy(p, &h, sizeof h);
}

// The bf16 load and store of sixteen lanes: load8 / store8 on each half (store8's compare on
// 32 bytes: see by_halves).
MOEPLUG_INLINE v16f load16(const uint16_t* p) {
  const v8f lo = load8(p), hi = load8(p + 8);
  v16f v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}

MOEPLUG_INLINE void store16(uint16_t* p, v16f v) {
  v8f lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  store8(p, lo);
  store8(p + 8, hi);
}

}  // namespace moeplug
