// Eight fp32 lanes as GCC/Clang vector types, with bf16 <-> fp32 loads and stores.
//
// For the loops GCC will not vectorise on its own: written with vector types, a loop is one
// ymm register per 8 lanes in the x86-64-v3 and x86-64-v4 clones and an xmm pair in the
// default one, so the same source serves every target_clones level (intrinsics would not
// compile in the default clone). Conversions match dtype.h's scalar bf16_to_f32 / f32_to_bf16
// bit for bit.
//
// Why eight lanes and not sixteen (a zmm in the v4 clone), each seen in a kernel here:
// - GCC 12 keeps a 64-byte vector variable in memory wherever the target has no 64-byte
//   registers (every clone but v4): a v16f accumulator cost a stack round trip per operation,
//   and bf16 unpermute read 0.36-0.47 of memcpy on an AVX2 host (until e8ec311);
// - it lowers a compare or ?: of 64-byte vectors lane by lane in scalar code there: the AVX2
//   clone of the SwiGLU forward ran 3.5x slower until it compared 8-lane halves (832c2ba);
// - joining two 8-lane halves back into 16 lanes went through the stack in the v4 clone (two
//   32-byte stores, then one 64-byte load, which the CPU cannot forward from them), and the
//   bf16 SwiGLU ran slower than the fp32 one on an AVX-512 host.
// AMD's Zen 4 runs a zmm operation as two ymm halves anyway.
#pragma once

#include <cstdint>
#include <cstring>

#include "moeplug/dtype.h"

// The helpers below are always_inline into the target_clones bodies, so no vector ever crosses
// a call boundary; GCC's note that passing one by value would change the ABI (in the default
// clone, which has no AVX) does not apply. It is given where the helpers are used too, so the
// pragma stays on for the including file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moeplug {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

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

// Each lane's bf16 bits (rounded to nearest even; NaNs stay quiet NaNs, as f32_to_bf16) in
// the low half of its 32-bit word.
MOEPLUG_INLINE v8u32 bf16_bits8(v8f v) {
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
  return (nan & mask) | (rounded & ~mask);
}

// Round to nearest even; NaNs stay quiet NaNs (as f32_to_bf16).
MOEPLUG_INLINE void store8(uint16_t* p, v8f v) {
  const v8u16 h = __builtin_convertvector(bf16_bits8(v), v8u16);
  std::memcpy(p, &h, sizeof h);
}

// Sixteen bf16 as two eight-lane vectors, of the even and of the odd elements. Each 32-bit
// word of the 32 bytes holds an (even, odd) pair, so the even element is the word shifted up
// and the odd one the word's high half: one load and two ops, where load8 widens eight
// elements across the register's halves (five ops in GCC 12's v4 clone). For elementwise
// loops: store16_pairs puts the pairs back.
MOEPLUG_INLINE void load16_pairs(const uint16_t* p, v8f& even, v8f& odd) {
  v8u32 w;
  std::memcpy(&w, p, sizeof w);
  const v8u32 e = w << 16, o = w & 0xFFFF0000u;
  std::memcpy(&even, &e, sizeof even);
  std::memcpy(&odd, &o, sizeof odd);
}

MOEPLUG_INLINE void store16_pairs(uint16_t* p, v8f even, v8f odd) {
  const v8u32 w = bf16_bits8(even) | (bf16_bits8(odd) << 16);
  std::memcpy(p, &w, sizeof w);
}

}  // namespace moeplug
