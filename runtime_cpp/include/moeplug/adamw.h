// Fused AdamW step for the precision-aware optimizer (bf16 moments and/or bf16 master weights)
// and the stochastic rounding of fp32 values to bf16 it ends with.
//
// The arithmetic is torch's, operation for operation (moeplug.training.optim._torch_update):
//   m  = fma(1 - beta1, g - m, m)            torch.lerp_ (its vector kernel fuses; for
//                                            beta1 <= .5: fma(-beta1, g - m, g))
//   v  = fma((1 - beta2) * g, g, v * beta2)  mul_, addcmul_ (its vector kernel fuses too)
//   p  = p * (1 - lr * wd)                   mul_ (decoupled decay)
//   p += (step_size * m) / (sqrt(v) / bias2_sqrt + eps)   addcdiv_
// then bf16 moments round to nearest even (tensor.copy_) and a bf16 parameter rounds
// stochastically with the hash of stochastic_round_bf16 (bitwise torch's version of it).
// One exception: sqrt here is IEEE (correctly rounded), while torch's CPU sqrt on MKL builds
// is MKL's vector sqrt, sometimes 1 ulp low; so a step equals _torch_update(ieee_sqrt=True)
// bitwise and the plain torch step up to that last bit of some denominators. fp32 math
// throughout; the file is compiled with -ffp-contract=off so the compiler fuses nothing torch
// does not (NaN payloads may differ: torch's own scalar and vector casts disagree on them).
#pragma once

#include <cstdint>

#include "moeplug/dtype.h"

namespace moeplug {

// The scalars of one step, each already rounded to fp32 as torch rounds a Python float
// scalar for a float32 tensor op.
struct AdamWScalars {
  float lerp_weight;   // 1 - beta1
  float beta2;         // beta2
  float grad_sq_coef;  // 1 - beta2
  float decay;         // 1 - lr * weight_decay
  float bias2_sqrt;    // sqrt(1 - beta2^t)
  float eps;
  float step_size;     // -lr / (1 - beta1^t)
  uint32_t step;       // t, the stochastic rounding's seed
};

// One AdamW step over n elements. param and grad share `param_dtype`; exp_avg and exp_avg_sq
// share `moment_dtype`. All are updated in place. Threads: the runtime pool.
void adamw_step(void* param, const void* grad, DType param_dtype, void* exp_avg,
                void* exp_avg_sq, DType moment_dtype, int64_t n, const AdamWScalars& s);

// One AdamW step of the fp32 main copy `main` of a bf16 parameter (train.param_dtype: bf16),
// from the parameter's bf16 grad, in the same pass writing the parameter: the updated main copy
// rounded to nearest even. Bitwise adamw_step on (main, grad as fp32) followed by torch's
// param.copy_(main), without the fp32 grad copy and the second pass.
void adamw_step_main(float* main, const uint16_t* grad_bf16, uint16_t* param_bf16,
                     void* exp_avg, void* exp_avg_sq, DType moment_dtype, int64_t n,
                     const AdamWScalars& s);

// dst_bf16[i] <- src[i] rounded up or down to a neighbouring bf16, with probability
// proportional to the distance; the random bits are a murmur3-finalised hash of the value's
// own bits and `step` (moeplug.training.optim.stochastic_round_ documents why).
void stochastic_round_bf16(const float* src, int64_t n, uint32_t step, uint16_t* dst_bf16);

// The rounding of one value (the loops inline it; tests call it). Also compiled for the GPU
// (runtime_cpp/cuda/src/adamw.cu), so both devices round with this one definition.
#if defined(__CUDACC__)
#define MOEPLUG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOEPLUG_HOST_DEVICE MOEPLUG_INLINE
#endif
MOEPLUG_HOST_DEVICE uint16_t stochastic_round_one(float x, uint32_t step) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
#endif
  uint32_t h = bits ^ (step * 0x9E3779B9u);
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  // Adding 16 random low bits then truncating rounds the magnitude up with probability
  // (low bits / 2^16): the bf16 is the fp32's top half, sign-magnitude, so both signs alike.
  return uint16_t((bits + (h & 0xFFFFu)) >> 16);
}

}  // namespace moeplug
