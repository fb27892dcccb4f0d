#include "moeplug/spill.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace moeplug {

namespace {

std::string errno_text() { return std::strerror(errno); }

// An unlinked temporary file in `directory`: O_TMPFILE where the file system has it, else
// mkstemp + unlink. Either way the bytes vanish with the descriptor, even after a crash.
int open_unlinked(const std::string& directory) {
#ifdef O_TMPFILE
  int fd = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
#endif
  std::string templ = directory + "/moeplug-spill-XXXXXX";
  std::vector<char> name(templ.begin(), templ.end());
  name.push_back('\0');
  int fd2 = ::mkstemp(name.data());
  if (fd2 < 0) {
    throw std::invalid_argument("SpillTier: cannot create a file in '" + directory +
                                "': " + errno_text() + ". Fix: set runtime.offload_dir to a "
                                "writable directory on a disk");
  }
  ::unlink(name.data());
  return fd2;
}

}  // namespace

SpillTier::SpillTier(const std::string& directory, int64_t page_bytes, int64_t num_pages)
    : directory_(directory), pages_(page_bytes, num_pages, /*own_memory=*/false) {
  fd_ = open_unlinked(directory);
  // Sparse: the size is only an address range; no block is used until written.
  if (::ftruncate(fd_, static_cast<off_t>(page_bytes * num_pages)) != 0) {
    const std::string err = errno_text();
    ::close(fd_);
    throw std::invalid_argument("SpillTier: cannot size the file in '" + directory + "' to " +
                                std::to_string(page_bytes * num_pages) + " bytes: " + err);
  }
}

SpillTier::~SpillTier() {
  if (fd_ >= 0) ::close(fd_);
}

PageRun SpillTier::alloc(int64_t n_bytes) { return pages_.alloc(n_bytes); }

void SpillTier::free(PageRun run) {
  pages_.free(run);  // validates the run first
#if defined(FALLOC_FL_PUNCH_HOLE) && defined(FALLOC_FL_KEEP_SIZE)
  // Best effort: a file system without hole punching keeps the blocks for the next run.
  (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                    static_cast<off_t>(run.first * page_bytes()),
                    static_cast<off_t>(run.count * page_bytes()));
#endif
}

void SpillTier::check_run(PageRun run, int64_t n_bytes, const char* op) const {
  if (run.first < 0 || run.count <= 0 || run.first + run.count > num_pages() || n_bytes < 0 ||
      n_bytes > run.count * page_bytes()) {
    throw std::invalid_argument(std::string("SpillTier.") + op + ": run {" +
                                std::to_string(run.first) + ", " + std::to_string(run.count) +
                                "} of " + std::to_string(page_bytes()) + "-byte pages cannot " +
                                "hold " + std::to_string(n_bytes) + " bytes (tier has " +
                                std::to_string(num_pages()) + " pages)");
  }
}

void SpillTier::write(PageRun run, const void* src, int64_t n_bytes) {
  check_run(run, n_bytes, "write");
  const char* p = static_cast<const char*>(src);
  off_t off = static_cast<off_t>(run.first * page_bytes());
  for (int64_t left = n_bytes; left > 0;) {
    const ssize_t n = ::pwrite(fd_, p, static_cast<size_t>(left), off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw std::runtime_error("SpillTier.write: pwrite to the file in '" + directory_ +
                               "' failed: " + errno_text() + " (disk full?)");
    }
    p += n, off += n, left -= n;
  }
  std::lock_guard<std::mutex> lock(mu_);
  bytes_written_ += n_bytes;
}

void SpillTier::read(PageRun run, void* dst, int64_t n_bytes) {
  check_run(run, n_bytes, "read");
  char* p = static_cast<char*>(dst);
  const off_t start = static_cast<off_t>(run.first * page_bytes());
  off_t off = start;
  for (int64_t left = n_bytes; left > 0;) {
    const ssize_t n = ::pread(fd_, p, static_cast<size_t>(left), off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw std::runtime_error("SpillTier.read: pread from the file in '" + directory_ +
                               "' failed: " + (n == 0 ? std::string("end of file") : errno_text()));
    }
    p += n, off += n, left -= n;
  }
  // The bytes now live in dst: the cached copy of them is dead weight.
  (void)::posix_fadvise(fd_, start, static_cast<off_t>(n_bytes), POSIX_FADV_DONTNEED);
  std::lock_guard<std::mutex> lock(mu_);
  bytes_read_ += n_bytes;
}

SpillStats SpillTier::stats() const {
  SpillStats s;
  s.pages = pages_.stats();
  std::lock_guard<std::mutex> lock(mu_);
  s.bytes_written = bytes_written_;
  s.bytes_read = bytes_read_;
  return s;
}

}  // namespace moeplug
