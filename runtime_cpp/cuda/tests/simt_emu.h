// A CPU stand-in for the few CUDA device features a warp-level kernel uses, so the kernel's
// logic (lane layout, shuffles, warp-uniform loops, shared scratch, atomics) runs and is tested
// on a machine without a GPU. A test harness, not a simulator of timing or of memory ordering:
// - the 32 lanes of a warp are coroutines (ucontext) on one OS thread; each runs until it
//   reaches a shuffle or __syncwarp, then the next lane runs, so every lane meets every other at
//   each of them: a shuffle reads what its source lane passed in the same call, as on a GPU;
// - blocks, and the warps of a block, run one after another: enough for kernels whose warps
//   share nothing but atomics and their own slice of __shared__ memory (`static` here);
// - every lane must reach every shuffle (full-mask, warp-uniform control flow, as mask
//   0xffffffff requires on a GPU too): a warp whose lanes part ways there fails the launch.
// CMake builds a kernel file against this header by copying its text up to its launchers
// (CMakeLists.txt, moeplug_kernel_emulation); its common.cuh comes with the CUDA toolkit's
// headers, which a host compiler reads for __nv_bfloat16 and its conversions (included here
// first, so their qualifier macros give way to these).
#pragma once

#include <cuda_bf16.h>  // first: they define the qualifiers redefined below
#include <cuda_runtime.h>
#include <ucontext.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

// The CUDA headers, compiled by a host compiler, define these for host code; a kernel here is
// host code whose __shared__ memory is one per launch (blocks run one after another).
#undef __device__
#undef __global__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

namespace simt {

struct Dim3 {
  unsigned x = 0;
};

constexpr int kWarpSize = 32;
constexpr size_t kLaneStack = 256 * 1024;

struct Warp {
  ucontext_t scheduler;
  ucontext_t lane[kWarpSize];
  bool done[kWarpSize] = {};
  uint64_t slot[kWarpSize] = {};
  int current = 0;
  std::vector<char> stacks = std::vector<char>(kLaneStack * kWarpSize);
  std::function<void()> body;
};

inline Dim3 thread_idx, block_idx, grid_dim, block_dim;
inline Warp* warp = nullptr;

// Back to the scheduler until every lane has got here.
inline void meet() { swapcontext(&warp->lane[warp->current], &warp->scheduler); }

inline void lane_entry() {
  warp->body();
  warp->done[warp->current] = true;  // uc_link returns to the scheduler
}

// Runs kernel(args...) over grid x block threads (block a multiple of 32), as <<<grid, block>>>.
template <class Kernel, class... Args>
void launch(unsigned grid, unsigned block, Kernel kernel, Args... args) {
  Warp w;
  warp = &w;
  w.body = [&] { kernel(args...); };
  for (unsigned b = 0; b < grid; ++b) {
    for (unsigned w0 = 0; w0 < block; w0 += kWarpSize) {
      for (int l = 0; l < kWarpSize; ++l) {
        w.done[l] = false;
        getcontext(&w.lane[l]);
        w.lane[l].uc_stack.ss_sp = w.stacks.data() + size_t(l) * kLaneStack;
        w.lane[l].uc_stack.ss_size = kLaneStack;
        w.lane[l].uc_link = &w.scheduler;
        makecontext(&w.lane[l], lane_entry, 0);
      }
      for (;;) {  // one round: every lane runs to its next meeting point or to its end
        int finished = 0, waiting = 0;
        for (int l = 0; l < kWarpSize; ++l) {
          if (w.done[l]) continue;
          thread_idx.x = w0 + unsigned(l);
          block_idx.x = b;
          grid_dim.x = grid;
          block_dim.x = block;
          w.current = l;
          swapcontext(&w.scheduler, &w.lane[l]);
          ++(w.done[l] ? finished : waiting);
        }
        if (waiting == 0) break;
        if (finished) {
          throw std::logic_error("simt: lanes of one warp part ways at a shuffle or __syncwarp");
        }
      }
    }
  }
  warp = nullptr;
}

template <class T>
T exchange(T v, int src) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  const int lane = int(thread_idx.x % kWarpSize);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  warp->slot[lane] = bits;
  meet();
  T out;
  const uint64_t got = warp->slot[src % kWarpSize];
  std::memcpy(&out, &got, sizeof(T));
  meet();  // nobody overwrites a slot before every lane has read
  return out;
}

}  // namespace simt

#define threadIdx (::simt::thread_idx)
#define blockIdx (::simt::block_idx)
#define gridDim (::simt::grid_dim)
#define blockDim (::simt::block_dim)

template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return simt::exchange(v, int(threadIdx.x % simt::kWarpSize) ^ mask);
}
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return simt::exchange(v, src);
}
inline void __syncwarp() { simt::meet(); }

// One OS thread runs every lane, so a plain read-modify-write is atomic here.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}

using std::isnan;

// The round-to-nearest intrinsics: IEEE operations, as a host compiler without contraction
// (-ffp-contract=off) does them; fmaf is <cmath>'s.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
