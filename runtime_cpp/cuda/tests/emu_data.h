// Data helpers of the emulated CUDA kernel tests: bf16 bits, tolerant compares, random rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "moeplug/dtype.h"
#include "moeplug/route.h"

namespace emu_data {

// Elements of type T (float or __nv_bfloat16) as fp32, and back (rounded to nearest even).
inline float as_f32(float v) { return v; }
inline float as_f32(__nv_bfloat16 v) { return moeplug::bf16_to_f32(__bfloat16_as_ushort(v)); }
template <class T>
T from_f32(float v) {
  if constexpr (sizeof(T) == 2) {
    return __ushort_as_bfloat16(moeplug::f32_to_bf16(v));
  } else {
    return v;
  }
}

// n values of N(0, 1) in T (bf16: rounded, so every value is exact in T).
template <class T>
std::vector<T> normal(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> nd;
  std::vector<T> v(n);
  for (auto& x : v) x = from_f32<T>(nd(rng));
  return v;
}

// |got - want| within atol + rtol |want|, rtol one rounding of T (2^-8 bf16, 1e-5 fp32 here).
template <class T>
bool near(T got, double want, double atol = 1e-6) {
  const double rtol = sizeof(T) == 2 ? 1.0 / 128 : 1e-5;
  return std::fabs(double(as_f32(got)) - want) <= atol + rtol * std::fabs(want);
}

// A route spec without groups or aux statistics (set those fields after), scaled by 2.5.
inline moeplug::RouteSpec route_spec(int64_t T, int64_t E, int64_t K, int score,
                                     bool renormalize) {
  moeplug::RouteSpec sp;
  sp.num_tokens = T;
  sp.num_experts = E;
  sp.top_k = K;
  sp.score = moeplug::ScoreFunction(score);
  sp.renormalize = renormalize;
  sp.scaling = 2.5f;
  return sp;
}

}  // namespace emu_data
