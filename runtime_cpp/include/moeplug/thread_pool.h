// A persistent worker pool: moeplug's CPU "execution streams". Kernels split their row ranges
// over it with parallel_for; the calling thread works too, so n threads = n-1 workers + caller.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moeplug {

// fn(lo, hi) processes the half-open range [lo, hi).
using RangeFn = std::function<void(int64_t, int64_t)>;

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Splits [begin, end) into chunks of at least `grain` items and runs fn on every chunk.
  // Blocks until all chunks finish; rethrows the first exception a chunk threw. A call made
  // from inside a chunk runs serially (no nested fan-out, no deadlock).
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn);

 private:
  void worker_loop();
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one parallel_for at a time (callers may come from several threads)
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int busy_workers_ = 0;

  // The job being run; written under mu_ before generation_ is bumped.
  const RangeFn* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1, num_chunks_ = 0;
  int64_t next_chunk_ = 0;  // guarded by mu_
  std::exception_ptr error_;
};

// Process-wide pool used by every kernel. Default size: std::thread::hardware_concurrency().
void set_num_threads(int n);
int get_num_threads();
void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn);

// libgomp's entry point for `#pragma omp parallel` (GNU OpenMP ABI): fn(data) on num_threads
// threads of the calling thread's team, the caller included.
using GompParallelFn = void (*)(void (*fn)(void*), void* data, unsigned num_threads,
                                unsigned flags);

// Run parallel_for's chunks on an OpenMP runtime's team instead of the pool (nullptr: back to
// the pool). The embedding process hands over the GOMP_parallel of the OpenMP runtime its
// other work uses (torch's GEMMs), so kernels that run between those ops get the same threads
// - idle or still spinning after the last op - rather than waking a second set that shares the
// cores with them. The core does not link an OpenMP runtime itself.
void use_openmp(GompParallelFn gomp_parallel);
// "openmp" or "pool": what parallel_for runs on.
const char* executor();

}  // namespace moeplug
