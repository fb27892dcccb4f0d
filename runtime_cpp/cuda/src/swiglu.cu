// Fused (weighted) SwiGLU forward and backward. One warp per row: its lanes stride over the
// row's F features in 16-byte vectors (8 bf16 or 4 fp32) where F and the pointers allow, and the
// backward's grad_probs sum is a warp reduction (no shared memory, no atomics). The first
// version (a thread per element in forward, a 256-thread block per row in backward, 2-byte bf16
// accesses) ran at about a third of the memory system's rate on an H200 (docs/GPU.md).
#include "common.cuh"

namespace moeplug::cuda {

namespace {

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

constexpr int kRowsPerBlock = kThreads / 32;

template <class T, int V>
__global__ void swiglu_forward_kernel(const T* h_S2F, const float* probs_S, int64_t S, int64_t F,
                                      T* a_SF) {
  const int lane = threadIdx.x % 32;
  const int64_t FV = F / V;
  for (int64_t s = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / 32; s < S;
       s += int64_t(gridDim.x) * kRowsPerBlock) {
    const float p = probs_S ? probs_S[s] : 1.0f;
    const T* g_row = h_S2F + s * 2 * F;
    for (int64_t j = lane; j < FV; j += 32) {
      const Vec<T, V> g = load_vec<T, V>(g_row + j * V), u = load_vec<T, V>(g_row + F + j * V);
      Vec<T, V> a;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float gi = load(g.v, i);
        store(a.v, i, gi * sigmoid(gi) * load(u.v, i) * p);
      }
      store_vec<T, V>(a_SF + s * F + j * V, a);
    }
  }
}

template <class T, int V>
__global__ void swiglu_backward_kernel(const T* grad_a_SF, const T* h_S2F, const float* probs_S,
                                       int64_t S, int64_t F, T* grad_h_S2F,
                                       float* grad_probs_S) {
  const int lane = threadIdx.x % 32;
  const int64_t FV = F / V;
  for (int64_t s = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / 32; s < S;
       s += int64_t(gridDim.x) * kRowsPerBlock) {
    const float p = probs_S ? probs_S[s] : 1.0f;
    const T* h_row = h_S2F + s * 2 * F;
    T* dh_row = grad_h_S2F + s * 2 * F;
    float dot = 0.0f;
    for (int64_t j = lane; j < FV; j += 32) {
      const Vec<T, V> ga = load_vec<T, V>(grad_a_SF + s * F + j * V);
      const Vec<T, V> g = load_vec<T, V>(h_row + j * V), u = load_vec<T, V>(h_row + F + j * V);
      Vec<T, V> dg, du;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float gai = load(ga.v, i), gi = load(g.v, i), ui = load(u.v, i);
        const float sg = sigmoid(gi), silu = gi * sg;
        const float dsilu = sg * (1.0f + gi * (1.0f - sg));
        store(dg.v, i, gai * p * ui * dsilu);
        store(du.v, i, gai * p * silu);
        dot += gai * silu * ui;
      }
      store_vec<T, V>(dh_row + j * V, dg);
      store_vec<T, V>(dh_row + F + j * V, du);
    }
    if (grad_probs_S == nullptr) continue;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) grad_probs_S[s] = dot;
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

// ---- Host launchers from here on; tests/simt_emu.h runs the kernels above on the CPU. ----
void swiglu_forward(const void* h_S2F, const float* probs_S, int64_t S, int64_t F, DType dtype,
                    void* a_SF, StreamHandle stream) {
  check_dims("cuda swiglu_forward", S, F);
  if (S == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    constexpr int kV = 16 / sizeof(E);
    const auto* h = static_cast<const E*>(h_S2F);
    auto* a = static_cast<E*>(a_SF);
    const unsigned grid = grid_for(S, kRowsPerBlock);
    if (vector_ok<E>(F, h_S2F, a_SF)) {
      swiglu_forward_kernel<E, kV><<<grid, kThreads, 0, as_stream(stream)>>>(h, probs_S, S, F, a);
    } else {
      swiglu_forward_kernel<E, 1><<<grid, kThreads, 0, as_stream(stream)>>>(h, probs_S, S, F, a);
    }
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
    constexpr int kV = 16 / sizeof(E);
    const auto* ga = static_cast<const E*>(grad_a_SF);
    const auto* h = static_cast<const E*>(h_S2F);
    auto* gh = static_cast<E*>(grad_h_S2F);
    const unsigned grid = grid_for(S, kRowsPerBlock);
    if (vector_ok<E>(F, grad_a_SF, h_S2F, grad_h_S2F)) {
      swiglu_backward_kernel<E, kV><<<grid, kThreads, 0, as_stream(stream)>>>(
          ga, h, probs_S, S, F, gh, grad_probs_S);
    } else {
      swiglu_backward_kernel<E, 1><<<grid, kThreads, 0, as_stream(stream)>>>(
          ga, h, probs_S, S, F, gh, grad_probs_S);
    }
  });
  check_launch("cuda swiglu_backward");
}

}  // namespace moeplug::cuda
