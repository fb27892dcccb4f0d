// Element types the kernels accept, and bf16 <-> fp32 conversion (bf16 math runs in fp32).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

// Hot loops are compiled once per ISA and picked at load time (GCC/Clang ifunc), so one
// x86_64 wheel runs everywhere and still uses AVX-512/AVX2 where the CPU has them. The clones
// are x86-64 ISA levels, not CPU models: "arch=skylake-avx512" dispatches on the CPU *model*,
// so AMD Zen 4 (which has AVX-512) silently got the SSE2 fallback.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define MOEPLUG_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MOEPLUG_MULTIVERSION
#endif
#define MOEPLUG_INLINE inline __attribute__((always_inline))
// Helpers called from multiversioned loops must be always_inline: GCC will not inline a
// default-target function into a target_clones body, and a call per element kills vectorisation.

namespace moeplug {

// Codes shared with Python (moeplug/runtime.py maps torch dtypes to them).
enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

inline int64_t dtype_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

// Throws std::invalid_argument naming `what` when `code` is not a known DType.
DType dtype_from_code(int code, const char* what);

MOEPLUG_INLINE float bf16_to_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; NaNs stay (quiet) NaNs instead of rounding into infinity.
MOEPLUG_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// Load/store an element of storage type T as fp32: T = float or uint16_t (bf16 bits).
MOEPLUG_INLINE float load_f32(const float* p, int64_t i) { return p[i]; }
MOEPLUG_INLINE float load_f32(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
MOEPLUG_INLINE void store_f32(float* p, int64_t i, float v) { p[i] = v; }
MOEPLUG_INLINE void store_f32(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

}  // namespace moeplug

