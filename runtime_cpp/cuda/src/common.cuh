// Shared by the .cu files: launch checks and fp32/bf16 element access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "moeplug/cuda/kernels.h"

namespace moeplug::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// After a <<<...>>> launch: a bad configuration surfaces here, naming the kernel.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

inline cudaStream_t as_stream(StreamHandle s) { return reinterpret_cast<cudaStream_t>(s); }

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);  // round to nearest even, like the CPU kernels
}

// V = elements per access: 16 bytes / sizeof(T) on the vector path, 1 on the scalar one.
template <class T, int V>
struct Vec {
  T v[V];
};

template <class T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  if constexpr (V * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    return *reinterpret_cast<const Vec<T, V>*>(&raw);
  } else {
    Vec<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) out.v[i] = p[i];
    return out;
  }
}

template <class T, int V>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& val) {
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&val);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = val.v[i];
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether rows of n elements of T at these pointers can move in 16-byte vectors: every row
// start 16-byte aligned.
template <class T>
bool vector_ok(int64_t n, const void* a, const void* b, const void* c = nullptr) {
  return (n * int64_t(sizeof(T))) % 16 == 0 && aligned16(a) && aligned16(b) &&
         (c == nullptr || aligned16(c));
}

// Calls fn(T{}) with T = float or __nv_bfloat16 per dtype (the element type of the rows).
template <class Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::kFloat32) {
    fn(float{});
  } else {
    fn(__nv_bfloat16{});
  }
}

constexpr int kThreads = 256;

inline unsigned grid_for(int64_t n, int64_t per_block = kThreads) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

}  // namespace moeplug::cuda
