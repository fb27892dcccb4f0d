// A symmetric shared-memory heap across the ranks of one machine (the CPU counterpart of the
// NVSHMEM symmetric heap DeepEP uses): every rank owns one POSIX shm segment of the same size and
// maps every peer's, so a rank can write rows straight into a peer's memory.
//
// Lifetime (the caller, moeplug/parallel/shm_heap.py, does the name exchange over its
// torch.distributed group; this class never talks to other processes):
//   1. ShmHeap(name, ...)  creates this rank's segment (O_EXCL: names are unique), reserves its
//                          pages (a full /dev/shm fails here, not as a SIGBUS later), maps it;
//   2. attach(names)       maps every rank's segment, checking each one's header;
//   3. (caller: a barrier over the group, so every rank has mapped every segment)
//   4. unlink_all()        shm_unlink of every name: /dev/shm is empty again while the mappings
//                          live on, so a rank killed with SIGKILL afterwards leaves nothing.
//   ~ShmHeap               munmap; unlinks its own name if step 4 never ran.
//
// Segment layout: a header (magic, sizes, the owner's pid), kNumFlags flags of one cache line
// each, num_slots int64 payload slots (e.g. per-expert row counts), then the data region at a
// 4096-byte offset. Flags are std::atomic<uint64_t> (lock-free, so address-free across
// processes): a writer fills its slots / a peer's data, then store-releases a flag; a reader
// acquire-loads the flag and then reads. Waits spin, then yield, and give up after a timeout
// or as soon as the peer's process is gone, naming the rank.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "moeplug/dtype.h"

namespace moeplug {

// A wait on a peer's flag that ran out of time, or whose peer process has exited.
class PeerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ShmHeap {
 public:
  static constexpr int kNumFlags = 4;
  static constexpr int64_t kAlign = 4096;

  // Creates and maps segment `name` ("/moeplug-..."): data_bytes of data, num_slots int64 slots.
  // Throws std::invalid_argument for bad sizes/names, std::runtime_error (with errno text and
  // the fix) when the segment cannot be created.
  ShmHeap(std::string name, int64_t data_bytes, int64_t num_slots, int rank, int world);
  ~ShmHeap();
  ShmHeap(const ShmHeap&) = delete;
  ShmHeap& operator=(const ShmHeap&) = delete;

  // Maps names[r] for every r != rank (names[rank] must be this rank's). Each segment's header
  // must match this one's sizes and name its rank r. Throws std::runtime_error naming the rank.
  void attach(const std::vector<std::string>& names);
  // shm_unlink every known name (ENOENT is fine: a peer got there first). Idempotent.
  void unlink_all();

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t data_bytes() const { return data_bytes_; }
  int64_t num_slots() const { return num_slots_; }
  bool attached() const { return attached_; }
  bool unlinked() const { return unlinked_; }

  uint8_t* data(int rank) const;   // rank's data region (data_bytes)
  int64_t* slots(int rank) const;  // rank's payload slots (num_slots)

  // Store-release this rank's flag `flag`.
  void publish(int flag, uint64_t value);
  // Acquire-load rank `rank`'s flag.
  uint64_t flag(int rank, int flag) const;
  // Until every rank's flag `flag` is >= value. Spins, then yields; throws PeerError naming the
  // first rank that has not arrived when timeout_s passes or its process is gone. `what` names
  // the step for the message ("dispatch rows written").
  void wait_all(int flag, uint64_t value, double timeout_s, const std::string& what) const;

 private:
  struct Header;
  Header* header(int rank) const;
  void check_rank(int rank, const char* op) const;

  std::string name_;
  std::vector<std::string> names_;
  int rank_, world_;
  int64_t data_bytes_, num_slots_, segment_bytes_, data_offset_;
  std::vector<uint8_t*> bases_;  // bases_[r]: rank r's segment in this process
  bool attached_ = false;
  bool unlinked_ = false;
};

// ---- copies between heaps (parallel over the runtime's thread pool; call without the GIL) ----

// Token rows to their experts' ranks. For token t and choice k with dest_rank[t*K+k] >= 0:
// copy source row (t, or t*K+k when per_choice) of row_bytes bytes to
// dest_base[dest_rank] + dest_row[t*K+k] * row_bytes. Rows of dest_rank < 0 (dropped) are skipped.
void scatter_rows(const void* src, int64_t T, int64_t K, int64_t row_bytes, bool per_choice,
                  const int64_t* dest_rank_TK, const int64_t* dest_row_TK,
                  const int64_t* dest_base_W, int64_t W);

// Contiguous row runs: chunk c copies rows [src_row, src_row + rows) of src to
// dest_base[dest_rank] + dest_row * row_bytes. chunks_C4 is [C, 4] = (src_row, dest_rank,
// dest_row, rows). Big runs are split so every thread gets a share.
void copy_chunks(const void* src, int64_t row_bytes, const int64_t* chunks_C4, int64_t C,
                 const int64_t* dest_base_W, int64_t W);

// The weighted sum on receipt: y_TD[t] = sum_k w[t, k] * rows[row_map[t, k]] (w null: plain
// sum), accumulated in fp32 in k order (as unpermute); choices with row_map < 0 (dropped)
// add nothing, and a token with no row gets zeros. rows has num_rows rows of D elements.
void sum_received_rows(const void* rows, int64_t num_rows, const int64_t* row_map_TK,
                       const float* weights_TK, int64_t T, int64_t K, int64_t D, DType dtype,
                       void* y_TD);

// The single-copy combine (Linux cross-memory attach, as MPI's CMA transports): y_TD[t] = sum_k
// of row row_TK[t, k] of rank rank_TK[t, k]'s rows at base_W[r] in process pid_W[r] (skipped when
// rank < 0), read with process_vm_readv straight out of that process's memory into a small
// staging block and summed there in fp32, k order (bitwise sum_received_rows). base_W[self] is
// read directly. One pass over the rows instead of a copy into the heap and a sum out of it.
// Throws std::runtime_error naming the rank and errno when a read is refused.
void pull_sum_rows(const int64_t* pid_W, const int64_t* base_W, int64_t self, int64_t W,
                   const int64_t* rank_TK, const int64_t* row_TK, int64_t T, int64_t K,
                   int64_t D, DType dtype, void* y_TD);

// Whether process `pid` lets this one read `nbytes` at `remote` (into `local`): the probe at heap
// set-up that decides, on every rank alike, whether pull_sum_rows can run.
bool can_read_process(int64_t pid, const void* remote, int64_t nbytes, void* local);

}  // namespace moeplug
