// How the process's host allocator treats large freed blocks.
#pragma once

#include <string>

namespace moeplug {

// Keep freed host memory in the process for the next allocation instead of handing it back to
// the kernel. glibc serves blocks over its mmap threshold (at most 32 MiB) with a fresh mmap
// and unmaps them on free, so every large activation, gradient and weight cast of every step
// lands on new pages: the kernel zero-fills each one on first touch (92 MiB: ~25 ms here, about
// a quarter of the GEMMs that write it). With mmap off and trimming above 2 GiB only, freed
// blocks go back to malloc's free lists and the next step reuses them as they are - what a
// caching allocator (torch's on CUDA, jemalloc/tcmalloc under torch's CPU launcher) does. The
// cost: glibc's heap cannot return holes and fragments (torch asks for aligned blocks, which a
// freed block of the same size cannot serve), so the footprint can settle well above the
// working set. Process-wide; returns "" when applied, else why not.
std::string retain_freed_memory();

}  // namespace moeplug
