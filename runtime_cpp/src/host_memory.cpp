#include "moeplug/host_memory.h"

#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace moeplug {

std::string retain_freed_memory() {
#if defined(__GLIBC__)
  // M_MMAP_MAX 0: no block gets its own mapping (a failed heap extension still falls back to
  // mmap inside glibc); M_TRIM_THRESHOLD: the heap's free top is returned only above 2 GiB.
  if (mallopt(M_MMAP_MAX, 0) != 1) return "glibc refused mallopt(M_MMAP_MAX, 0)";
  if (mallopt(M_TRIM_THRESHOLD, INT_MAX) != 1) return "glibc refused mallopt(M_TRIM_THRESHOLD)";
  return "";
#else
  return "the C library is not glibc (its allocator's policy is left as it is)";
#endif
}

}  // namespace moeplug
