// The stash's second tier on the CPU: a file-backed page store (no Python, no libtorch).
//
// Why a file: on a GPU the second tier is host memory, because host memory is what a GPU run
// has more of. On the CPU the first tier already *is* host memory, so copying activations to
// another host buffer would save nothing. The next tier down is the disk: a spilled run is
// written to an unlinked temporary file with pwrite, and read back with pread. The process's
// resident memory falls by the spilled bytes (the kernel's page cache holds them only until
// writeback, and it may evict them; reading them back drops them from the cache again with
// posix_fadvise, and freeing a run punches a hole so the file never grows past the high-water
// mark of what is spilled at once). A tmpfs directory would keep the bytes in RAM (as shared
// memory outside this process's RSS) and so saves nothing: pick a directory on a disk.
//
// Page bookkeeping is the PagePool's (contiguous runs, first fit, overflow counted, never
// silent); the file is sparse, so a large num_pages costs nothing until pages are written.
// Every method is thread-safe: a runtime stream's worker writes while the caller allocates.
#pragma once

#include <cstdint>
#include <string>

#include "moeplug/stash.h"

namespace moeplug {

struct SpillStats {
  PoolStats pages;             // pages_in_use, high_water, overflows, allocs
  int64_t bytes_written = 0;   // since construction
  int64_t bytes_read = 0;
};

class SpillTier {
 public:
  // Creates the (unlinked, so nothing is left behind) file in `directory`; throws
  // std::invalid_argument naming the directory when it cannot.
  SpillTier(const std::string& directory, int64_t page_bytes, int64_t num_pages);
  ~SpillTier();
  SpillTier(const SpillTier&) = delete;
  SpillTier& operator=(const SpillTier&) = delete;

  PageRun alloc(int64_t n_bytes);  // {-1, 0} and an overflow counted when no run fits
  // Returns the run's pages and punches them out of the file (its disk blocks and cache).
  void free(PageRun run);
  // Copies n_bytes from src into the run / from the run into dst. n_bytes must fit the run.
  void write(PageRun run, const void* src, int64_t n_bytes);
  void read(PageRun run, void* dst, int64_t n_bytes);
  SpillStats stats() const;
  // high_water <- pages_in_use: the next stats() reports the peak from now on (one per step).
  void reset_high_water() { pages_.reset_high_water(); }

  int64_t page_bytes() const { return pages_.page_bytes(); }
  int64_t num_pages() const { return pages_.num_pages(); }
  const std::string& directory() const { return directory_; }

 private:
  void check_run(PageRun run, int64_t n_bytes, const char* op) const;

  const std::string directory_;
  PagePool pages_;  // bookkeeping only (own_memory = false)
  int fd_ = -1;
  mutable std::mutex mu_;  // the byte counters (pread/pwrite themselves are thread-safe)
  int64_t bytes_written_ = 0;
  int64_t bytes_read_ = 0;
};

}  // namespace moeplug
