// permute / unpermute on the GPU. One block per token: permute reads the token's row once and
// writes it to its K routed rows; unpermute reads the K routed rows and writes the token once,
// so each kernel moves the fewest bytes (T + T*K rows). Rows move in 16-byte vectors when the
// row length and the three pointers allow it (8 bf16 or 4 fp32 per access): with 2- or 4-byte
// accesses the kernels reached 0.28 / 0.38 of a device-to-device copy's bandwidth on an H200
// (docs/GPU.md), far from the memory system's limit. A row number of -1 means "no row": permute
// skips that choice and unpermute adds nothing for it (the sync-free layer's choices over its
// token budget, whose rows are the budget's fixed slots rather than T*K packed ones).
#include "common.cuh"

namespace moeplug::cuda {

namespace {

template <class T, int V>
__global__ void permute_kernel(const T* x_TD, const int64_t* row_map_TK, int64_t T_, int64_t K,
                               int64_t D, T* x_SD) {
  const int64_t DV = D / V;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const T* src = x_TD + t * D;
    for (int64_t d = threadIdx.x; d < DV; d += blockDim.x) {
      const Vec<T, V> val = load_vec<T, V>(src + d * V);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = row_map_TK[t * K + k];
        if (row >= 0) store_vec<T, V>(x_SD + row * D + d * V, val);  // -1: this choice has no row
      }
    }
  }
}

template <class T, int V>
__global__ void unpermute_kernel(const T* y_SD, const int64_t* row_map_TK, const float* probs_TK,
                                 int64_t T_, int64_t K, int64_t D, T* y_TD) {
  const int64_t DV = D / V;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    for (int64_t d = threadIdx.x; d < DV; d += blockDim.x) {
      float acc[V];
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {  // k in order: the same sum as the CPU kernel
        const int64_t r = row_map_TK[t * K + k];
        if (r < 0) continue;  // a choice with no row (sync-free over budget) adds nothing
        const float p = probs_TK ? probs_TK[t * K + k] : 1.0f;
        const Vec<T, V> row = load_vec<T, V>(y_SD + r * D + d * V);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += p * load(row.v, i);
      }
      Vec<T, V> out;
#pragma unroll
      for (int i = 0; i < V; ++i) store(out.v, i, acc[i]);
      store_vec<T, V>(y_TD + t * D + d * V, out);
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

// Threads per block: one per vector of the row, at most kThreads (they stride beyond that).
unsigned threads_for(int64_t vectors) {
  const int64_t warps = (vectors + 31) / 32;
  return static_cast<unsigned>(warps * 32 < kThreads ? (warps > 0 ? warps * 32 : 32) : kThreads);
}

}  // namespace

// ---- Host launchers from here on; tests/simt_emu.h runs the kernels above on the CPU. ----
void permute(const void* x_TD, const int64_t* row_map_TK, int64_t T, int64_t K, int64_t D,
             DType dtype, void* x_SD, StreamHandle stream) {
  check_dims("cuda permute", T, K, D);
  if (T == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    constexpr int kV = 16 / sizeof(E);
    const auto* x = static_cast<const E*>(x_TD);
    auto* out = static_cast<E*>(x_SD);
    if (vector_ok<E>(D, x_TD, x_SD)) {
      permute_kernel<E, kV><<<grid_for(T, 1), threads_for(D / kV), 0, as_stream(stream)>>>(
          x, row_map_TK, T, K, D, out);
    } else {
      permute_kernel<E, 1><<<grid_for(T, 1), threads_for(D), 0, as_stream(stream)>>>(
          x, row_map_TK, T, K, D, out);
    }
  });
  check_launch("cuda permute");
}

void unpermute(const void* y_SD, const int64_t* row_map_TK, const float* probs_TK, int64_t T,
               int64_t K, int64_t D, DType dtype, void* y_TD, StreamHandle stream) {
  check_dims("cuda unpermute", T, K, D);
  if (T == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    constexpr int kV = 16 / sizeof(E);
    const auto* y = static_cast<const E*>(y_SD);
    auto* out = static_cast<E*>(y_TD);
    if (vector_ok<E>(D, y_SD, y_TD)) {
      unpermute_kernel<E, kV><<<grid_for(T, 1), threads_for(D / kV), 0, as_stream(stream)>>>(
          y, row_map_TK, probs_TK, T, K, D, out);
    } else {
      unpermute_kernel<E, 1><<<grid_for(T, 1), threads_for(D), 0, as_stream(stream)>>>(
          y, row_map_TK, probs_TK, T, K, D, out);
    }
  });
  check_launch("cuda unpermute");
}

}  // namespace moeplug::cuda
