// Fused AdamW + bf16 stochastic rounding (the formulas and why they are torch's: adamw.h).
// One pass over the elements: each is read once (param, grad, both moments) and written once,
// where the torch reference makes ~15 passes and materialises fp32 copies of everything.
#include "moeplug/adamw.h"

#include <cmath>
#include <stdexcept>

#include "moeplug/thread_pool.h"

namespace moeplug {

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per chunk: ~1/4 MiB of fp32 per operand

// P_: the weight updated (fp32, or bf16 rounded stochastically); G_: its grad's type (the
// weight's, or bf16 for an fp32 main copy); `image` (only with kImage): the bf16 parameter
// whose fp32 main copy p is, written p rounded to nearest even (torch's copy_).
template <class P_, class G_, class M_, bool kImage = false>
MOEPLUG_INLINE void step_range(P_* p, const G_* g, M_* m, M_* v, int64_t lo, int64_t hi,
                               const AdamWScalars s, uint16_t* image = nullptr) {
  constexpr bool kBf16Param = sizeof(P_) == 2;
  static_assert(!(kImage && kBf16Param), "a bf16 image is of an fp32 main copy");
  // torch.lerp's two forms: from the start for a small weight, from the end otherwise.
  const bool small = std::fabs(s.lerp_weight) < 0.5f;
  const float coeff = small ? s.lerp_weight : s.lerp_weight - 1.0f;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = load_f32(g, i);
    float mi = load_f32(m, i);
    mi = std::fma(coeff, gi - mi, small ? mi : gi);
    float vi = load_f32(v, i);
    vi = std::fma(s.grad_sq_coef * gi, gi, vi * s.beta2);
    store_f32(m, i, mi);
    store_f32(v, i, vi);
    float pi = load_f32(p, i) * s.decay;
    const float denom = std::sqrt(vi) / s.bias2_sqrt + s.eps;
    pi = pi + s.step_size * mi / denom;
    if constexpr (kBf16Param) {
      p[i] = stochastic_round_one(pi, s.step);
    } else {
      p[i] = pi;
      if constexpr (kImage) store_f32(image, i, pi);
    }
  }
}

MOEPLUG_MULTIVERSION void step_bf16_f32(uint16_t* p, const uint16_t* g, float* m, float* v,
                                        int64_t lo, int64_t hi, const AdamWScalars s) {
  step_range(p, g, m, v, lo, hi, s);
}
MOEPLUG_MULTIVERSION void step_bf16_bf16(uint16_t* p, const uint16_t* g, uint16_t* m,
                                         uint16_t* v, int64_t lo, int64_t hi,
                                         const AdamWScalars s) {
  step_range(p, g, m, v, lo, hi, s);
}
MOEPLUG_MULTIVERSION void step_f32_bf16(float* p, const float* g, uint16_t* m, uint16_t* v,
                                        int64_t lo, int64_t hi, const AdamWScalars s) {
  step_range(p, g, m, v, lo, hi, s);
}
MOEPLUG_MULTIVERSION void step_f32_f32(float* p, const float* g, float* m, float* v, int64_t lo,
                                       int64_t hi, const AdamWScalars s) {
  step_range(p, g, m, v, lo, hi, s);
}

MOEPLUG_MULTIVERSION void step_main_f32(float* p, const uint16_t* g, float* m, float* v,
                                        int64_t lo, int64_t hi, const AdamWScalars s,
                                        uint16_t* image) {
  step_range<float, uint16_t, float, true>(p, g, m, v, lo, hi, s, image);
}
MOEPLUG_MULTIVERSION void step_main_bf16(float* p, const uint16_t* g, uint16_t* m, uint16_t* v,
                                         int64_t lo, int64_t hi, const AdamWScalars s,
                                         uint16_t* image) {
  step_range<float, uint16_t, uint16_t, true>(p, g, m, v, lo, hi, s, image);
}

MOEPLUG_MULTIVERSION void round_range(const float* src, int64_t lo, int64_t hi, uint32_t step,
                                      uint16_t* dst) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) dst[i] = stochastic_round_one(src[i], step);
}

}  // namespace

void adamw_step(void* param, const void* grad, DType param_dtype, void* exp_avg,
                void* exp_avg_sq, DType moment_dtype, int64_t n, const AdamWScalars& s) {
  if (n < 0) throw std::invalid_argument("adamw_step: n must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  if (!param || !grad || !exp_avg || !exp_avg_sq)
    throw std::invalid_argument("adamw_step: param, grad, exp_avg and exp_avg_sq must be set");
  const bool bp = param_dtype == DType::kBFloat16, bm = moment_dtype == DType::kBFloat16;
  const AdamWScalars sc = s;
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    if (bp && bm) {
      step_bf16_bf16(static_cast<uint16_t*>(param), static_cast<const uint16_t*>(grad),
                     static_cast<uint16_t*>(exp_avg), static_cast<uint16_t*>(exp_avg_sq), lo, hi,
                     sc);
    } else if (bp) {
      step_bf16_f32(static_cast<uint16_t*>(param), static_cast<const uint16_t*>(grad),
                    static_cast<float*>(exp_avg), static_cast<float*>(exp_avg_sq), lo, hi, sc);
    } else if (bm) {
      step_f32_bf16(static_cast<float*>(param), static_cast<const float*>(grad),
                    static_cast<uint16_t*>(exp_avg), static_cast<uint16_t*>(exp_avg_sq), lo, hi,
                    sc);
    } else {
      step_f32_f32(static_cast<float*>(param), static_cast<const float*>(grad),
                   static_cast<float*>(exp_avg), static_cast<float*>(exp_avg_sq), lo, hi, sc);
    }
  });
}

void adamw_step_main(float* main, const uint16_t* grad_bf16, uint16_t* param_bf16,
                     void* exp_avg, void* exp_avg_sq, DType moment_dtype, int64_t n,
                     const AdamWScalars& s) {
  if (n < 0)
    throw std::invalid_argument("adamw_step_main: n must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  if (!main || !grad_bf16 || !param_bf16 || !exp_avg || !exp_avg_sq)
    throw std::invalid_argument(
        "adamw_step_main: main, grad, param, exp_avg and exp_avg_sq must be set");
  const bool bm = moment_dtype == DType::kBFloat16;
  const AdamWScalars sc = s;
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    if (bm) {
      step_main_bf16(main, grad_bf16, static_cast<uint16_t*>(exp_avg),
                     static_cast<uint16_t*>(exp_avg_sq), lo, hi, sc, param_bf16);
    } else {
      step_main_f32(main, grad_bf16, static_cast<float*>(exp_avg),
                    static_cast<float*>(exp_avg_sq), lo, hi, sc, param_bf16);
    }
  });
}

void stochastic_round_bf16(const float* src, int64_t n, uint32_t step, uint16_t* dst_bf16) {
  if (n < 0)
    throw std::invalid_argument("stochastic_round_bf16: n must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  if (!src || !dst_bf16)
    throw std::invalid_argument("stochastic_round_bf16: src and dst must be set");
  parallel_for(0, n, kGrain,
               [&](int64_t lo, int64_t hi) { round_range(src, lo, hi, step, dst_bf16); });
}

}  // namespace moeplug
