// The symmetric shared-memory heap (see shm_heap.h for the lifetime and layout) and the row
// copies that run over it.
#include "moeplug/shm_heap.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "moeplug/permute.h"
#include "moeplug/thread_pool.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace moeplug {

namespace {

constexpr uint64_t kMagic = 0x6d6f65706c756731ull;  // "moeplug1"
constexpr int64_t kLine = 64;                       // one flag per cache line: no false sharing

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory flags need lock-free (address-free) 64-bit atomics");

int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

std::string errno_text(int err) { return std::string(std::strerror(err)); }

}  // namespace

struct ShmHeap::Header {
  uint64_t magic;
  int64_t data_bytes;
  int64_t num_slots;
  int64_t rank;
  int64_t world;
  int64_t pid;  // the owner: a wait checks it is still alive
};

ShmHeap::ShmHeap(std::string name, int64_t data_bytes, int64_t num_slots, int rank, int world)
    : name_(std::move(name)), rank_(rank), world_(world), data_bytes_(data_bytes),
      num_slots_(num_slots) {
  if (name_.size() < 2 || name_[0] != '/' || name_.find('/', 1) != std::string::npos ||
      name_.size() > 250) {
    throw std::invalid_argument("ShmHeap: segment name '" + name_ + "' must be '/' followed by "
                                "1-249 characters without '/', e.g. '/moeplug-1234-0'");
  }
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("ShmHeap: rank " + std::to_string(rank) + " of world " +
                                std::to_string(world) + ": expected 0 <= rank < world");
  }
  if (data_bytes < 0 || num_slots < 0) {
    throw std::invalid_argument("ShmHeap: data_bytes (" + std::to_string(data_bytes) +
                                ") and num_slots (" + std::to_string(num_slots) +
                                ") must be >= 0");
  }
  const int64_t control = kLine + kNumFlags * kLine + num_slots * int64_t(sizeof(int64_t));
  data_offset_ = round_up(control, kAlign);
  segment_bytes_ = data_offset_ + round_up(std::max<int64_t>(data_bytes, 1), kAlign);
  bases_.assign(world, nullptr);
  names_.assign(world, std::string());
  names_[rank] = name_;

  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int err = errno;
    throw std::runtime_error("ShmHeap: rank " + std::to_string(rank) + " cannot create shared "
                             "memory segment " + name_ + ": " + errno_text(err) +
                             ". Fix: check that /dev/shm is mounted and writable");
  }
  // Reserve the pages now (posix_fallocate, not only ftruncate): tmpfs allocates sparse pages
  // on first write, and a write that finds /dev/shm full is a SIGBUS mid-dispatch instead of
  // this error (containers often mount a 64 MiB /dev/shm).
  int rc = posix_fallocate(fd, 0, segment_bytes_);
  if (rc == EINVAL || rc == EOPNOTSUPP) rc = ftruncate(fd, segment_bytes_) == 0 ? 0 : errno;
  if (rc != 0) {
    close(fd);
    shm_unlink(name_.c_str());
    throw std::runtime_error("ShmHeap: rank " + std::to_string(rank) + " cannot reserve " +
                             std::to_string(segment_bytes_) + " bytes for segment " + name_ +
                             " in /dev/shm: " + errno_text(rc) +
                             ". Fix: free space in /dev/shm, enlarge it (e.g. docker run "
                             "--shm-size), or lower the heap size");
  }
  void* p = mmap(nullptr, static_cast<size_t>(segment_bytes_), PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the segment alive
  if (p == MAP_FAILED) {
    shm_unlink(name_.c_str());
    throw std::runtime_error("ShmHeap: cannot map segment " + name_ + ": " + errno_text(err));
  }
  bases_[rank] = static_cast<uint8_t*>(p);
  auto* h = header(rank);
  h->data_bytes = data_bytes;
  h->num_slots = num_slots;
  h->rank = rank;
  h->world = world;
  h->pid = static_cast<int64_t>(getpid());
  for (int f = 0; f < kNumFlags; ++f) {
    new (bases_[rank] + kLine + f * kLine) std::atomic<uint64_t>(0);
  }
  // The magic last, with release: a peer that sees it also sees the fields above.
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic, std::memory_order_release);
}

ShmHeap::~ShmHeap() {
  if (!unlinked_) shm_unlink(name_.c_str());  // attach never completed: ours is still named
  for (uint8_t* b : bases_) {
    if (b) munmap(b, static_cast<size_t>(segment_bytes_));
  }
}

ShmHeap::Header* ShmHeap::header(int rank) const {
  return reinterpret_cast<Header*>(bases_[rank]);
}

void ShmHeap::check_rank(int rank, const char* op) const {
  if (rank < 0 || rank >= world_) {
    throw std::invalid_argument(std::string("ShmHeap.") + op + ": rank " + std::to_string(rank) +
                                " is outside [0, " + std::to_string(world_) + ")");
  }
  if (!bases_[rank]) {
    throw std::runtime_error(std::string("ShmHeap.") + op + ": rank " + std::to_string(rank) +
                             "'s segment is not mapped. Fix: call attach(names) first");
  }
}

void ShmHeap::attach(const std::vector<std::string>& names) {
  if (static_cast<int>(names.size()) != world_ || names[rank_] != name_) {
    throw std::invalid_argument("ShmHeap.attach: expected " + std::to_string(world_) +
                                " names with this rank's (" + name_ + ") at index " +
                                std::to_string(rank_));
  }
  for (int r = 0; r < world_; ++r) {
    if (r == rank_ || bases_[r]) continue;
    names_[r] = names[r];
    const int fd = shm_open(names[r].c_str(), O_RDWR, 0600);
    if (fd < 0) {
      const int err = errno;
      throw std::runtime_error("ShmHeap.attach: rank " + std::to_string(rank_) +
                               " cannot open rank " + std::to_string(r) + "'s segment " +
                               names[r] + ": " + errno_text(err) +
                               ". Every rank of the group must run on this machine");
    }
    struct stat st;
    const bool sized = fstat(fd, &st) == 0 && st.st_size == segment_bytes_;
    void* p = sized ? mmap(nullptr, static_cast<size_t>(segment_bytes_), PROT_READ | PROT_WRITE,
                           MAP_SHARED, fd, 0)
                    : MAP_FAILED;
    const int err = errno;
    close(fd);
    if (!sized) {
      throw std::runtime_error("ShmHeap.attach: rank " + std::to_string(r) + "'s segment " +
                               names[r] + " is not " + std::to_string(segment_bytes_) +
                               " bytes: every rank must create the heap with the same sizes");
    }
    if (p == MAP_FAILED) {
      throw std::runtime_error("ShmHeap.attach: cannot map rank " + std::to_string(r) +
                               "'s segment " + names[r] + ": " + errno_text(err));
    }
    bases_[r] = static_cast<uint8_t*>(p);
    const Header* h = header(r);
    const uint64_t magic =
        reinterpret_cast<const std::atomic<uint64_t>*>(&h->magic)->load(std::memory_order_acquire);
    if (magic != kMagic || h->rank != r || h->world != world_ || h->data_bytes != data_bytes_ ||
        h->num_slots != num_slots_) {
      throw std::runtime_error("ShmHeap.attach: segment " + names[r] + " is not rank " +
                               std::to_string(r) + "'s heap of this group (header mismatch)");
    }
  }
  attached_ = true;
}

void ShmHeap::unlink_all() {
  for (const std::string& n : names_) {
    if (!n.empty()) shm_unlink(n.c_str());  // ENOENT: another rank unlinked it already
  }
  unlinked_ = true;
}

uint8_t* ShmHeap::data(int rank) const {
  check_rank(rank, "data");
  return bases_[rank] + data_offset_;
}

int64_t* ShmHeap::slots(int rank) const {
  check_rank(rank, "slots");
  return reinterpret_cast<int64_t*>(bases_[rank] + kLine + kNumFlags * kLine);
}

namespace {
std::atomic<uint64_t>* flag_ptr(uint8_t* base, int flag) {
  return reinterpret_cast<std::atomic<uint64_t>*>(base + kLine + flag * kLine);
}
}  // namespace

void ShmHeap::publish(int flag, uint64_t value) {
  if (flag < 0 || flag >= kNumFlags) {
    throw std::invalid_argument("ShmHeap.publish: flag " + std::to_string(flag) +
                                " is outside [0, " + std::to_string(kNumFlags) + ")");
  }
  flag_ptr(bases_[rank_], flag)->store(value, std::memory_order_release);
}

uint64_t ShmHeap::flag(int rank, int flag) const {
  check_rank(rank, "flag");
  if (flag < 0 || flag >= kNumFlags) {
    throw std::invalid_argument("ShmHeap.flag: flag " + std::to_string(flag) +
                                " is outside [0, " + std::to_string(kNumFlags) + ")");
  }
  return flag_ptr(bases_[rank], flag)->load(std::memory_order_acquire);
}

void ShmHeap::wait_all(int flag, uint64_t value, double timeout_s, const std::string& what) const {
  if (flag < 0 || flag >= kNumFlags) {
    throw std::invalid_argument("ShmHeap.wait_all: flag " + std::to_string(flag) +
                                " is outside [0, " + std::to_string(kNumFlags) + ")");
  }
  for (int r = 0; r < world_; ++r) check_rank(r, "wait_all");
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start + std::chrono::milliseconds(50);
  int64_t spins = 0;
  for (int r = 0; r < world_; ++r) {
    const auto* f = flag_ptr(bases_[r], flag);
    while (f->load(std::memory_order_acquire) < value) {
      // Spin first (a peer on another core is usually microseconds away), then yield, then
      // sleep with a doubling pause up to 200 us: ranks often outnumber free cores, and a
      // waiter that spins or only yields keeps stealing the time slices of the peer it waits on.
      ++spins;
      if (spins < 2000) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      if (spins < 2200) {
        sched_yield();
      } else {
        const int64_t doublings = std::min<int64_t>(8, (spins - 2200) / 8);
        const int64_t us = std::min<int64_t>(200, int64_t(1) << doublings);
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      }
      const auto now = clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::milliseconds(50);
      const int64_t pid = header(r)->pid;
      const bool gone = kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
      const double waited = std::chrono::duration<double>(now - start).count();
      if (gone || waited > timeout_s) {
        const uint64_t at = f->load(std::memory_order_acquire);
        throw PeerError(
            "shared-memory heap: rank " + std::to_string(rank_) + " waited " +
            std::to_string(waited).substr(0, 6) + " s for rank " + std::to_string(r) +
            " (pid " + std::to_string(pid) + ") at step '" + what + "' #" +
            std::to_string(value) + " (rank " + std::to_string(r) + " is at #" +
            std::to_string(at) + "): " +
            (gone ? "its process has exited" : "timed out after " +
                                                   std::to_string(timeout_s).substr(0, 6) +
                                                   " s; it is stuck or no longer taking part") +
            ". Fix: look at rank " + std::to_string(r) + "'s own error");
      }
    }
  }
}

// ---- copies -----------------------------------------------------------------------------------

namespace {
constexpr int64_t kTokenGrain = 32;
constexpr int64_t kRunRows = 64;  // copy_chunks splits runs into pieces of this many rows

// Rows into a peer's heap: non-temporal stores where the row allows (SSE2, the x86_64 baseline).
// The destination is far larger than the caches and read by another process later, so a plain
// store would first read every destination line (read-for-ownership) and then evict it unused:
// streaming halves the memory traffic of the write, as glibc's memcpy does for large copies.
MOEPLUG_INLINE void put_rows(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__x86_64__)
  if (n >= 256 && (n & 15) == 0 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    for (int64_t i = 0; i < n; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

// Streamed stores are weakly ordered: fence them before this thread's part counts as done (the
// pool's hand-back and then DONE's store-release publish them to the peers).
MOEPLUG_INLINE void fence_rows() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}
}  // namespace

void scatter_rows(const void* src, int64_t T, int64_t K, int64_t row_bytes, bool per_choice,
                  const int64_t* dest_rank_TK, const int64_t* dest_row_TK,
                  const int64_t* dest_base_W, int64_t W) {
  if (T < 0 || K < 1 || row_bytes < 1 || W < 1) {
    throw std::invalid_argument("scatter_rows: expected num_tokens >= 0, top_k >= 1, "
                                "row_bytes >= 1, world >= 1; got " + std::to_string(T) + ", " +
                                std::to_string(K) + ", " + std::to_string(row_bytes) + ", " +
                                std::to_string(W));
  }
  for (int64_t i = 0; i < T * K; ++i) {
    if (dest_rank_TK[i] >= W) {
      throw std::invalid_argument("scatter_rows: dest_rank[" + std::to_string(i) + "] = " +
                                  std::to_string(dest_rank_TK[i]) + " is not a rank of the " +
                                  std::to_string(W) + "-rank heap");
    }
  }
  const auto* s = static_cast<const uint8_t*>(src);
  parallel_for(0, T, kTokenGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = t * K + k;
        const int64_t r = dest_rank_TK[i];
        if (r < 0) continue;
        auto* dst = reinterpret_cast<uint8_t*>(dest_base_W[r]) + dest_row_TK[i] * row_bytes;
        put_rows(dst, s + (per_choice ? i : t) * row_bytes, row_bytes);
      }
    }
    fence_rows();
  });
}

void copy_chunks(const void* src, int64_t row_bytes, const int64_t* chunks_C4, int64_t C,
                 const int64_t* dest_base_W, int64_t W) {
  // Pieces of at most kRunRows rows, so one big run (all rows to one rank) still spreads over
  // the pool's threads.
  std::vector<int64_t> piece_chunk, piece_row;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t* ch = chunks_C4 + c * 4;
    if (ch[1] < 0 || ch[1] >= W || ch[3] < 0) {
      throw std::invalid_argument("copy_chunks: chunk " + std::to_string(c) + " has dest_rank " +
                                  std::to_string(ch[1]) + " and rows " + std::to_string(ch[3]) +
                                  "; expected 0 <= dest_rank < " + std::to_string(W) +
                                  " and rows >= 0");
    }
    for (int64_t r = 0; r < ch[3]; r += kRunRows) {
      piece_chunk.push_back(c);
      piece_row.push_back(r);
    }
  }
  const auto* s = static_cast<const uint8_t*>(src);
  parallel_for(0, static_cast<int64_t>(piece_chunk.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t* ch = chunks_C4 + piece_chunk[p] * 4;
      const int64_t r0 = piece_row[p];
      const int64_t n = std::min(kRunRows, ch[3] - r0);
      auto* dst = reinterpret_cast<uint8_t*>(dest_base_W[ch[1]]) + (ch[2] + r0) * row_bytes;
      put_rows(dst, s + (ch[0] + r0) * row_bytes, n * row_bytes);
    }
    fence_rows();
  });
}

void sum_received_rows(const void* rows, int64_t num_rows, const int64_t* row_map_TK,
                       const float* weights_TK, int64_t T, int64_t K, int64_t D, DType dtype,
                       void* y_TD) {
  if (T < 0 || K < 1 || D < 1) {
    throw std::invalid_argument("sum_received_rows: expected num_tokens >= 0, top_k >= 1, "
                                "hidden >= 1");
  }
  for (int64_t i = 0; i < T * K; ++i) {
    if (row_map_TK[i] >= num_rows) {
      throw std::invalid_argument("sum_received_rows: row_map[" + std::to_string(i / K) + ", " +
                                  std::to_string(i % K) + "] = " + std::to_string(row_map_TK[i]) +
                                  " is past the " + std::to_string(num_rows) + " received rows");
    }
  }
  parallel_for(0, T, kTokenGrain, [&](int64_t t0, int64_t t1) {
    if (dtype == DType::kFloat32) {
      weighted_row_sums(static_cast<const float*>(rows), row_map_TK, weights_TK, t0, t1, K, D,
                        static_cast<float*>(y_TD));
    } else {
      weighted_row_sums(static_cast<const uint16_t*>(rows), row_map_TK, weights_TK, t0, t1, K,
                        D, static_cast<uint16_t*>(y_TD));
    }
  });
}

// ---- single-copy combine (Linux cross-memory attach) ------------------------------------------

namespace {
constexpr int64_t kPullTokens = 16;  // tokens per staged block: 16 * K rows stay in L2

std::string read_error(int err, int64_t rank, int64_t pid) {
  return "pull_sum_rows: process_vm_readv from rank " + std::to_string(rank) + " (pid " +
         std::to_string(pid) + ") failed: " + errno_text(err) +
         ". Fix: allow cross-memory attach between the ranks (same user; ptrace not denied by "
         "Yama/seccomp) or set plugins.dispatcher_options.single_copy=false";
}
}  // namespace

bool can_read_process(int64_t pid, const void* remote, int64_t nbytes, void* local) {
  iovec l{local, static_cast<size_t>(nbytes)};
  iovec r{const_cast<void*>(remote), static_cast<size_t>(nbytes)};
  return process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0) == nbytes;
}

void pull_sum_rows(const int64_t* pid_W, const int64_t* base_W, int64_t self, int64_t W,
                   const int64_t* rank_TK, const int64_t* row_TK, int64_t T, int64_t K,
                   int64_t D, DType dtype, void* y_TD) {
  if (T < 0 || K < 1 || D < 1 || self < 0 || self >= W) {
    throw std::invalid_argument("pull_sum_rows: expected num_tokens >= 0, top_k >= 1, "
                                "hidden >= 1, 0 <= rank < world");
  }
  for (int64_t i = 0; i < T * K; ++i) {
    if (rank_TK[i] >= W) {
      throw std::invalid_argument("pull_sum_rows: rank[" + std::to_string(i) + "] = " +
                                  std::to_string(rank_TK[i]) + " is not a rank of the " +
                                  std::to_string(W) + "-rank heap");
    }
  }
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = D * elem;
  parallel_for(0, T, kPullTokens, [&](int64_t lo, int64_t hi) {
    std::vector<uint8_t> stage(static_cast<size_t>(kPullTokens * K * row_bytes));
    std::vector<int64_t> map(static_cast<size_t>(kPullTokens * K));
    std::vector<std::vector<iovec>> local(W), remote(W);
    for (int64_t t0 = lo; t0 < hi; t0 += kPullTokens) {
      const int64_t t1 = std::min(hi, t0 + kPullTokens);
      for (auto& v : local) v.clear();
      for (auto& v : remote) v.clear();
      // Stage the block's rows in (t, k) order: own rows by memcpy, peers' by one
      // process_vm_readv per peer (the kernel copies straight out of the peer's y_SD).
      for (int64_t i = 0; i < (t1 - t0) * K; ++i) {
        const int64_t g = t0 * K + i;
        const int64_t r = rank_TK[g];
        map[i] = r < 0 ? -1 : i;
        if (r < 0) continue;
        uint8_t* dst = stage.data() + i * row_bytes;
        auto* src = reinterpret_cast<uint8_t*>(base_W[r]) + row_TK[g] * row_bytes;
        if (r == self) {
          std::memcpy(dst, src, static_cast<size_t>(row_bytes));
        } else {
          local[r].push_back({dst, static_cast<size_t>(row_bytes)});
          remote[r].push_back({src, static_cast<size_t>(row_bytes)});
        }
      }
      for (int64_t r = 0; r < W; ++r) {
        const size_t n = local[r].size();
        for (size_t at = 0; at < n; at += IOV_MAX) {
          const size_t cnt = std::min<size_t>(IOV_MAX, n - at);
          const ssize_t want = static_cast<ssize_t>(cnt) * row_bytes;
          const ssize_t got = process_vm_readv(static_cast<pid_t>(pid_W[r]), &local[r][at], cnt,
                                               &remote[r][at], cnt, 0);
          if (got != want) throw std::runtime_error(read_error(got < 0 ? errno : EFAULT, r,
                                                               pid_W[r]));
        }
      }
      // The same fp32, k-ordered sum as sum_received_rows (bitwise the same result).
      if (dtype == DType::kFloat32) {
        weighted_row_sums(reinterpret_cast<const float*>(stage.data()), map.data(), nullptr, 0,
                          t1 - t0, K, D, static_cast<float*>(y_TD) + t0 * D);
      } else {
        weighted_row_sums(reinterpret_cast<const uint16_t*>(stage.data()), map.data(), nullptr,
                          0, t1 - t0, K, D, static_cast<uint16_t*>(y_TD) + t0 * D);
      }
    }
  });
}

}  // namespace moeplug
