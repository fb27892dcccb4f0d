// Fused (weighted) SwiGLU forward and backward. Forward: one thread per output element.
// Backward: one block per row, so the row's grad_probs sum is a block reduction (no atomics).
#include "common.cuh"

namespace moeplug::cuda {

namespace {

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <class T>
__global__ void swiglu_forward_kernel(const T* h_S2F, const float* probs_S, int64_t S, int64_t F,
                                      T* a_SF) {
  const int64_t n = S * F;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = i / F, f = i % F;
    const float g = load(h_S2F, s * 2 * F + f), u = load(h_S2F, s * 2 * F + F + f);
    const float p = probs_S ? probs_S[s] : 1.0f;
    store(a_SF, i, g * sigmoid(g) * u * p);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* grad_a_SF, const T* h_S2F, const float* probs_S,
                                       int64_t S, int64_t F, T* grad_h_S2F,
                                       float* grad_probs_S) {
  __shared__ float partial[kThreads];
  for (int64_t s = blockIdx.x; s < S; s += gridDim.x) {
    const float p = probs_S ? probs_S[s] : 1.0f;
    float dot = 0.0f;
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
      const float ga = load(grad_a_SF, s * F + f);
      const float g = load(h_S2F, s * 2 * F + f), u = load(h_S2F, s * 2 * F + F + f);
      const float sg = sigmoid(g), silu = g * sg;
      const float dsilu = sg * (1.0f + g * (1.0f - sg));
      store(grad_h_S2F, s * 2 * F + f, ga * p * u * dsilu);
      store(grad_h_S2F, s * 2 * F + F + f, ga * p * silu);
      dot += ga * silu * u;
    }
    if (grad_probs_S == nullptr) continue;
    partial[threadIdx.x] = dot;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
      __syncthreads();
    }
    if (threadIdx.x == 0) grad_probs_S[s] = partial[0];
    __syncthreads();  // partial[] is reused by the next row
  }
}

void check_dims(const char* op, int64_t S, int64_t F) {
  if (S < 0 || F < 1) {
    throw std::invalid_argument(std::string(op) + ": expected num_rows >= 0 and ffn_hidden >= 1;"
                                " got num_rows=" + std::to_string(S) +
                                ", ffn_hidden=" + std::to_string(F));
  }
}

}  // namespace

void swiglu_forward(const void* h_S2F, const float* probs_S, int64_t S, int64_t F, DType dtype,
                    void* a_SF, StreamHandle stream) {
  check_dims("cuda swiglu_forward", S, F);
  if (S == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    swiglu_forward_kernel<E><<<grid_for(S * F), kThreads, 0, as_stream(stream)>>>(
        static_cast<const E*>(h_S2F), probs_S, S, F, static_cast<E*>(a_SF));
  });
  check_launch("cuda swiglu_forward");
}

void swiglu_backward(const void* grad_a_SF, const void* h_S2F, const float* probs_S, int64_t S,
                     int64_t F, DType dtype, void* grad_h_S2F, float* grad_probs_S,
                     StreamHandle stream) {
  check_dims("cuda swiglu_backward", S, F);
  if (grad_probs_S && !probs_S) {
    throw std::invalid_argument("cuda swiglu_backward: grad_probs without probs; pass the "
                                "probs the forward used, or no grad_probs");
  }
  if (S == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    swiglu_backward_kernel<E><<<grid_for(S, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const E*>(grad_a_SF), static_cast<const E*>(h_S2F), probs_S, S, F,
        static_cast<E*>(grad_h_S2F), grad_probs_S);
  });
  check_launch("cuda swiglu_backward");
}

}  // namespace moeplug::cuda
