// The fused AdamW step and bf16 stochastic rounding of moeplug/adamw.h on the GPU: one pass over
// the elements, each operand read once and written once. On an H200 torch's step of the same
// math (moeplug.training.optim._torch_update, ~15 elementwise passes) took 31 ms of a 89 ms
// training step of 1.35 B parameters (docs/GPU.md).
//
// Bitwise the CPU kernel's results: the same operations in the same order, each rounded as the
// CPU rounds it. The CPU file is compiled with -ffp-contract=off and fuses only where it calls
// std::fma; here every product and sum is an explicit round-to-nearest intrinsic (__fmul_rn,
// __fadd_rn, __fdiv_rn, __fsqrt_rn), which nvcc never contracts, and fmaf where the CPU fmas.
#include "common.cuh"

namespace moeplug::cuda {

namespace {

// P_: the weight updated (fp32, or bf16 rounded stochastically); G_: its grad's element type;
// M_: the moments'. bf16 is __nv_bfloat16, read and written (to nearest even, as torch's
// copy_) by common.cuh's load / store. kImage: p is the fp32 main copy of the bf16 parameter
// `image`, written as p rounded to nearest even.
template <class P_, class G_, class M_, bool kImage>
__global__ void adamw_kernel(P_* p, const G_* g, M_* m, M_* v, int64_t n, AdamWScalars s,
                             __nv_bfloat16* image) {
  constexpr bool kBf16Param = sizeof(P_) == 2;
  const bool small = fabsf(s.lerp_weight) < 0.5f;  // torch.lerp's two forms
  const float coeff = small ? s.lerp_weight : __fsub_rn(s.lerp_weight, 1.0f);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = load(g, i);
    float mi = load(m, i);
    mi = fmaf(coeff, __fsub_rn(gi, mi), small ? mi : gi);
    float vi = load(v, i);
    vi = fmaf(__fmul_rn(s.grad_sq_coef, gi), gi, __fmul_rn(vi, s.beta2));
    store(m, i, mi);
    store(v, i, vi);
    float pi = __fmul_rn(load(p, i), s.decay);
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bias2_sqrt), s.eps);
    pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.step_size, mi), denom));
    if constexpr (kBf16Param) {
      p[i] = __ushort_as_bfloat16(stochastic_round_one(pi, s.step));
    } else {
      p[i] = pi;
      if constexpr (kImage) store(image, i, pi);
    }
  }
}

__global__ void round_kernel(const float* src, int64_t n, uint32_t step, uint16_t* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = stochastic_round_one(src[i], step);
  }
}

// ---- Host launchers from here on; tests/simt_emu.h runs the kernels above on the CPU. ----
template <class P_, class G_, class M_, bool kImage = false>
void launch(void* p, const void* g, void* m, void* v, int64_t n, const AdamWScalars& s,
            StreamHandle stream, void* image = nullptr) {
  adamw_kernel<P_, G_, M_, kImage><<<grid_for(n), kThreads, 0, as_stream(stream)>>>(
      static_cast<P_*>(p), static_cast<const G_*>(g), static_cast<M_*>(m), static_cast<M_*>(v),
      n, s, static_cast<__nv_bfloat16*>(image));
  check_launch("cuda adamw_step");
}

void check_n(const char* op, int64_t n) {
  if (n < 0) throw std::invalid_argument(std::string(op) + ": n must be >= 0, got " +
                                         std::to_string(n));
}

}  // namespace

void adamw_step(void* param, const void* grad, DType param_dtype, void* exp_avg,
                void* exp_avg_sq, DType moment_dtype, int64_t n, const AdamWScalars& s,
                StreamHandle stream) {
  check_n("cuda adamw_step", n);
  if (n == 0) return;
  if (!param || !grad || !exp_avg || !exp_avg_sq)
    throw std::invalid_argument("cuda adamw_step: param, grad, exp_avg and exp_avg_sq must be set");
  const bool bp = param_dtype == DType::kBFloat16, bm = moment_dtype == DType::kBFloat16;
  if (bp && bm) {
    launch<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, n, s,
                                                        stream);
  } else if (bp) {
    launch<__nv_bfloat16, __nv_bfloat16, float>(param, grad, exp_avg, exp_avg_sq, n, s, stream);
  } else if (bm) {
    launch<float, float, __nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, n, s, stream);
  } else {
    launch<float, float, float>(param, grad, exp_avg, exp_avg_sq, n, s, stream);
  }
}

void adamw_step_main(float* main, const uint16_t* grad_bf16, uint16_t* param_bf16,
                     void* exp_avg, void* exp_avg_sq, DType moment_dtype, int64_t n,
                     const AdamWScalars& s, StreamHandle stream) {
  check_n("cuda adamw_step_main", n);
  if (n == 0) return;
  if (!main || !grad_bf16 || !param_bf16 || !exp_avg || !exp_avg_sq)
    throw std::invalid_argument(
        "cuda adamw_step_main: main, grad, param, exp_avg and exp_avg_sq must be set");
  if (moment_dtype == DType::kBFloat16) {
    launch<float, __nv_bfloat16, __nv_bfloat16, true>(main, grad_bf16, exp_avg, exp_avg_sq, n,
                                                      s, stream, param_bf16);
  } else {
    launch<float, __nv_bfloat16, float, true>(main, grad_bf16, exp_avg, exp_avg_sq, n, s, stream,
                                              param_bf16);
  }
}

void stochastic_round_bf16(const float* src, int64_t n, uint32_t step, uint16_t* dst_bf16,
                           StreamHandle stream) {
  check_n("cuda stochastic_round_bf16", n);
  if (n == 0) return;
  if (!src || !dst_bf16)
    throw std::invalid_argument("cuda stochastic_round_bf16: src and dst must be set");
  round_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(src, n, step, dst_bf16);
  check_launch("cuda stochastic_round_bf16");
}

}  // namespace moeplug::cuda
