// Fused SwiGLU forward/backward over eight-lane vectors (exp is the polynomial of
// fastmath.h, not libm's scalar expf).
//
// Shape legend: S rows, F expert FFN hidden size.
#include "moeplug/swiglu.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "moeplug/fastmath.h"
#include "moeplug/thread_pool.h"
#include "moeplug/vec8.h"

namespace moeplug {

namespace {

constexpr int64_t kRowGrain = 16;

// Written with vec8.h's vector types, eight columns at a time, and the scalar loop for the
// tail. Left to GCC, the bf16 loops did not vectorise: a one-expert slice (1024 x 1408)
// took 0.48 ms forward and 0.99 ms backward in bf16 against 0.30 / 0.39 in fp32, with half
// the bytes (compute-bound, ~5 cycles an element). Sixteen columns at a time (a zmm in the
// AVX-512 clone) built each 16-lane vector from two converted bf16 halves through the stack,
// and the bf16 kernels ran slower than the fp32 ones on an AVX-512 host (vec8.h).
// bf16 rows go sixteen at a time as two eight-lane vectors of the even and the odd elements
// (vec8.h's load16_pairs / store16_pairs: no lane shuffles), which took the bf16 kernels from
// 17.5-19.3 / 26.3-28.3 ms to 11.0-13.7 / 18.9-21.7 ms forward / backward a layer on an
// AVX-512 host (benchmarks/test_bench_kernels.py -k swiglu, old and new builds alternating).
// Each element's math is unchanged; grad_probs sums the even and odd lanes apart, then adds.
template <class T_>
MOEPLUG_INLINE void fwd_rows(const T_* h, const float* probs, int64_t s0, int64_t s1, int64_t F,
                             T_* a) {
  for (int64_t s = s0; s < s1; ++s) {
    const T_* g_F = h + s * 2 * F;
    const T_* u_F = g_F + F;
    T_* a_F = a + s * F;
    const float p = probs ? probs[s] : 1.0f;
    int64_t f = 0;
    if constexpr (std::is_same_v<T_, uint16_t>) {  // sixteen at a time, as even/odd lanes
      for (; f + 16 <= F; f += 16) {
        v8f g0, g1, u0, u1;
        load16_pairs(g_F + f, g0, g1);
        load16_pairs(u_F + f, u0, u1);
        const v8f silu0 = g0 / (1.0f + exp_approx8(-g0));
        const v8f silu1 = g1 / (1.0f + exp_approx8(-g1));
        store16_pairs(a_F + f, silu0 * u0 * p, silu1 * u1 * p);
      }
    }
    for (; f + 8 <= F; f += 8) {
      const v8f g = load8(g_F + f);
      const v8f silu = g / (1.0f + exp_approx8(-g));
      store8(a_F + f, silu * load8(u_F + f) * p);
    }
    for (; f < F; ++f) {
      const float g = load_f32(g_F, f);
      const float silu = g / (1.0f + exp_approx(-g));
      store_f32(a_F, f, silu * load_f32(u_F, f) * p);
    }
  }
}

MOEPLUG_INLINE float sum8(v8f v) {
  float lanes[8];
  std::memcpy(lanes, &v, sizeof lanes);
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s;
}

template <class T_>
MOEPLUG_INLINE void bwd_rows(const T_* da, const T_* h, const float* probs, int64_t s0,
                             int64_t s1, int64_t F, T_* dh, float* dprobs) {
  for (int64_t s = s0; s < s1; ++s) {
    const T_* g_F = h + s * 2 * F;
    const T_* u_F = g_F + F;
    const T_* da_F = da + s * F;
    T_* dg_F = dh + s * 2 * F;
    T_* du_F = dg_F + F;
    const float p = probs ? probs[s] : 1.0f;
    v8f dp8{};
    int64_t f = 0;
    if constexpr (std::is_same_v<T_, uint16_t>) {  // sixteen at a time, as even/odd lanes
      v8f dp_odd{};
      for (; f + 16 <= F; f += 16) {
        v8f g0, g1, u0, u1, d0, d1;
        load16_pairs(g_F + f, g0, g1);
        load16_pairs(u_F + f, u0, u1);
        load16_pairs(da_F + f, d0, d1);
        const v8f sig0 = 1.0f / (1.0f + exp_approx8(-g0));
        const v8f sig1 = 1.0f / (1.0f + exp_approx8(-g1));
        const v8f silu0 = g0 * sig0, silu1 = g1 * sig1;
        const v8f dsilu0 = sig0 * (1.0f + g0 * (1.0f - sig0));
        const v8f dsilu1 = sig1 * (1.0f + g1 * (1.0f - sig1));
        store16_pairs(dg_F + f, d0 * p * u0 * dsilu0, d1 * p * u1 * dsilu1);
        store16_pairs(du_F + f, d0 * p * silu0, d1 * p * silu1);
        dp8 += d0 * silu0 * u0;
        dp_odd += d1 * silu1 * u1;
      }
      dp8 += dp_odd;
    }
    for (; f + 8 <= F; f += 8) {
      const v8f g = load8(g_F + f);
      const v8f u = load8(u_F + f);
      const v8f d = load8(da_F + f);
      const v8f sig = 1.0f / (1.0f + exp_approx8(-g));
      const v8f silu = g * sig;
      const v8f dsilu = sig * (1.0f + g * (1.0f - sig));
      store8(dg_F + f, d * p * u * dsilu);
      store8(du_F + f, d * p * silu);
      dp8 += d * silu * u;
    }
    float dp = sum8(dp8);
    for (; f < F; ++f) {
      const float g = load_f32(g_F, f);
      const float u = load_f32(u_F, f);
      const float d = load_f32(da_F, f);
      const float sig = 1.0f / (1.0f + exp_approx(-g));
      const float silu = g * sig;
      const float dsilu = sig * (1.0f + g * (1.0f - sig));
      store_f32(dg_F, f, d * p * u * dsilu);
      store_f32(du_F, f, d * p * silu);
      dp += d * silu * u;
    }
    if (dprobs) dprobs[s] = dp;
  }
}

MOEPLUG_MULTIVERSION void fwd_f32(const float* h, const float* p, int64_t s0, int64_t s1,
                                  int64_t F, float* a) {
  fwd_rows(h, p, s0, s1, F, a);
}
MOEPLUG_MULTIVERSION void fwd_bf16(const uint16_t* h, const float* p, int64_t s0, int64_t s1,
                                   int64_t F, uint16_t* a) {
  fwd_rows(h, p, s0, s1, F, a);
}
MOEPLUG_MULTIVERSION void bwd_f32(const float* da, const float* h, const float* p, int64_t s0,
                                  int64_t s1, int64_t F, float* dh, float* dp) {
  bwd_rows(da, h, p, s0, s1, F, dh, dp);
}
MOEPLUG_MULTIVERSION void bwd_bf16(const uint16_t* da, const uint16_t* h, const float* p,
                                   int64_t s0, int64_t s1, int64_t F, uint16_t* dh, float* dp) {
  bwd_rows(da, h, p, s0, s1, F, dh, dp);
}

void check_dims(const char* op, int64_t S, int64_t F) {
  if (S < 0 || F < 1) {
    throw std::invalid_argument(std::string(op) + ": expected rows >= 0 and ffn_hidden >= 1; got "
                                "rows=" + std::to_string(S) + ", ffn_hidden=" + std::to_string(F));
  }
}

}  // namespace

void swiglu_forward(const void* h_S2F, const float* probs_S, int64_t S, int64_t F, DType dtype,
                    void* a_SF) {
  check_dims("swiglu_forward", S, F);
  parallel_for(0, S, kRowGrain, [&](int64_t s0, int64_t s1) {
    if (dtype == DType::kFloat32) {
      fwd_f32(static_cast<const float*>(h_S2F), probs_S, s0, s1, F, static_cast<float*>(a_SF));
    } else {
      fwd_bf16(static_cast<const uint16_t*>(h_S2F), probs_S, s0, s1, F,
               static_cast<uint16_t*>(a_SF));
    }
  });
}

void swiglu_backward(const void* grad_a_SF, const void* h_S2F, const float* probs_S, int64_t S,
                     int64_t F, DType dtype, void* grad_h_S2F, float* grad_probs_S) {
  check_dims("swiglu_backward", S, F);
  if (grad_probs_S && !probs_S) {
    throw std::invalid_argument("swiglu_backward: grad_probs requested but probs is null; "
                                "pass the forward's probs or do not ask for their gradient");
  }
  parallel_for(0, S, kRowGrain, [&](int64_t s0, int64_t s1) {
    if (dtype == DType::kFloat32) {
      bwd_f32(static_cast<const float*>(grad_a_SF), static_cast<const float*>(h_S2F), probs_S, s0,
              s1, F, static_cast<float*>(grad_h_S2F), grad_probs_S);
    } else {
      bwd_bf16(static_cast<const uint16_t*>(grad_a_SF), static_cast<const uint16_t*>(h_S2F),
               probs_S, s0, s1, F, static_cast<uint16_t*>(grad_h_S2F), grad_probs_S);
    }
  });
}

}  // namespace moeplug
