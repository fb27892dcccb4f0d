// permute / unpermute on the GPU: one block per routed row (permute) or token (unpermute),
// threads stride over the hidden dimension so the row copies are coalesced.
#include "common.cuh"

namespace moeplug::cuda {

namespace {

template <class T>
__global__ void permute_kernel(const T* x_TD, const int64_t* row_map_TK, int64_t TK, int64_t K,
                               int64_t D, T* x_SD) {
  for (int64_t i = blockIdx.x; i < TK; i += gridDim.x) {
    const T* src = x_TD + (i / K) * D;
    T* dst = x_SD + row_map_TK[i] * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dst[d] = src[d];
  }
}

template <class T>
__global__ void unpermute_kernel(const T* y_SD, const int64_t* row_map_TK, const float* probs_TK,
                                 int64_t T_, int64_t K, int64_t D, T* y_TD) {
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float p = probs_TK ? probs_TK[t * K + k] : 1.0f;
        acc += p * load(y_SD, row_map_TK[t * K + k] * D + d);
      }
      store(y_TD, t * D + d, acc);
    }
  }
}

void check_dims(const char* op, int64_t T, int64_t K, int64_t D) {
  if (T < 0 || K < 1 || D < 1) {
    throw std::invalid_argument(std::string(op) + ": expected num_tokens >= 0, top_k >= 1, " +
                                "hidden >= 1; got num_tokens=" + std::to_string(T) +
                                ", top_k=" + std::to_string(K) + ", hidden=" + std::to_string(D));
  }
}

}  // namespace

void permute(const void* x_TD, const int64_t* row_map_TK, int64_t T, int64_t K, int64_t D,
             DType dtype, void* x_SD, StreamHandle stream) {
  check_dims("cuda permute", T, K, D);
  if (T == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    permute_kernel<E><<<grid_for(T * K, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const E*>(x_TD), row_map_TK, T * K, K, D, static_cast<E*>(x_SD));
  });
  check_launch("cuda permute");
}

void unpermute(const void* y_SD, const int64_t* row_map_TK, const float* probs_TK, int64_t T,
               int64_t K, int64_t D, DType dtype, void* y_TD, StreamHandle stream) {
  check_dims("cuda unpermute", T, K, D);
  if (T == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    unpermute_kernel<E><<<grid_for(T, 1), kThreads, 0, as_stream(stream)>>>(
        static_cast<const E*>(y_SD), row_map_TK, probs_TK, T, K, D, static_cast<E*>(y_TD));
  });
  check_launch("cuda unpermute");
}

}  // namespace moeplug::cuda
