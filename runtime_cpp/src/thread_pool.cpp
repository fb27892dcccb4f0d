#include "moeplug/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>

namespace moeplug {

namespace {
thread_local bool t_inside_pool = false;  // true while this thread runs a chunk

// How parallel_for splits n items over `threads` threads, on the pool and on an OpenMP team
// alike: a few chunks per thread even out uneven chunk costs without much scheduling
// overhead, each at least `grain` items. count == 1: run serially.
struct Split {
  int64_t chunk, count;
};

Split split_range(int64_t n, int64_t grain, int threads) {
  const int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(grain, 1));
  const int64_t wanted = std::min<int64_t>(max_chunks, int64_t(threads) * 4);
  const int64_t chunk = (n + wanted - 1) / wanted;
  return {chunk, (n + chunk - 1) / chunk};
}
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads < 1) {
    throw std::invalid_argument("ThreadPool: num_threads must be >= 1, got " +
                                std::to_string(num_threads));
  }
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_chunks() {
  // Chunks are claimed under the lock: there are only a few per call (a handful per thread),
  // so contention is negligible next to the work in each chunk.
  t_inside_pool = true;
  for (;;) {
    int64_t c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_chunk_ >= num_chunks_) break;
      c = next_chunk_++;
    }
    const int64_t lo = begin_ + c * chunk_;
    const int64_t hi = std::min(end_, lo + chunk_);
    try {
      (*fn_)(lo, hi);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_chunk_ = num_chunks_;  // stop handing out work after a failure
    }
  }
  t_inside_pool = false;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++busy_workers_;
    }
    run_chunks();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_workers_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn) {
  if (end <= begin) return;
  const Split split = split_range(end - begin, grain, num_threads());
  if (split.count == 1 || workers_.empty() || t_inside_pool) {
    fn(begin, end);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    chunk_ = split.chunk;
    num_chunks_ = split.count;
    next_chunk_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  work_cv_.notify_all();
  run_chunks();
  std::exception_ptr error;
  {
    // Wait until every worker that woke for this generation has left run_chunks; a worker
    // that wakes late finds no chunks left and only bumps busy_workers_ briefly.
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return next_chunk_ >= num_chunks_ && busy_workers_ == 0; });
    fn_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

namespace {
std::mutex g_pool_mu;
std::shared_ptr<ThreadPool> g_pool;

// Callers hold a shared_ptr for the duration of a call, so set_num_threads never destroys a
// pool that another thread is still using.
std::shared_ptr<ThreadPool> global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) {
    g_pool = std::make_shared<ThreadPool>(std::max(1u, std::thread::hardware_concurrency()));
  }
  return g_pool;
}
}  // namespace

void set_num_threads(int n) {
  if (n < 1) {
    throw std::invalid_argument("set_num_threads: n must be >= 1, got " + std::to_string(n) +
                                "; pass e.g. torch.get_num_threads()");
  }
  std::shared_ptr<ThreadPool> old;
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    if (g_pool && g_pool->num_threads() == n) return;
    old = std::move(g_pool);
    g_pool = std::make_shared<ThreadPool>(n);
  }
  // `old` joins its workers here, once the last in-flight call using it has finished.
}

int get_num_threads() { return global_pool()->num_threads(); }

namespace {
std::atomic<GompParallelFn> g_gomp_parallel{nullptr};

// One parallel_for on an OpenMP team: every team thread claims chunks until none is left.
struct OmpJob {
  const RangeFn* fn;
  int64_t begin, end, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::exception_ptr error;
};

void run_omp_chunks(void* data) {
  auto* job = static_cast<OmpJob*>(data);
  const bool was_inside = t_inside_pool;
  t_inside_pool = true;  // a parallel_for inside a chunk runs serially, as on the pool
  for (;;) {
    const int64_t c = job->next.fetch_add(1);
    if (c >= job->num_chunks) break;
    const int64_t lo = job->begin + c * job->chunk;
    try {
      (*job->fn)(lo, std::min(job->end, lo + job->chunk));
    } catch (...) {  // nothing may leave an OpenMP region: kept for the caller
      std::lock_guard<std::mutex> lock(job->error_mu);
      if (!job->error) job->error = std::current_exception();
      job->next.store(job->num_chunks);
    }
  }
  t_inside_pool = was_inside;
}
}  // namespace

void use_openmp(GompParallelFn gomp_parallel) { g_gomp_parallel.store(gomp_parallel); }

const char* executor() { return g_gomp_parallel.load() ? "openmp" : "pool"; }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn) {
  const GompParallelFn gomp = g_gomp_parallel.load();
  if (!gomp) {
    global_pool()->parallel_for(begin, end, grain, fn);
    return;
  }
  if (end <= begin) return;
  const int threads = get_num_threads();
  const Split split = split_range(end - begin, grain, threads);
  if (split.count == 1 || threads == 1 || t_inside_pool) {
    fn(begin, end);
    return;
  }
  OmpJob job;
  job.fn = &fn;
  job.begin = begin;
  job.end = end;
  job.chunk = split.chunk;
  job.num_chunks = split.count;
  gomp(run_omp_chunks, &job, static_cast<unsigned>(threads), 0);
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace moeplug
