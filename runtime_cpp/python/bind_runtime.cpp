#include <cstdint>
#include <string>
#include <thread>

#include "moeplug/host_memory.h"
#include "moeplug/thread_pool.h"
#include "register.h"

namespace py = pybind11;

namespace moeplug::py_bind {

namespace {

// Which clone the multiversioned kernels resolve to on this CPU (same test as the ifunc).
const char* simd_dispatch() {
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4 (AVX-512)";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3 (AVX2+FMA)";
  return "baseline";
#else
  return "portable (no multiversioning)";
#endif
}

py::dict build_info() {
  py::dict d;
  d["version"] = MOEPLUG_VERSION;
  d["cuda"] = false;
  d["compiler"] = MOEPLUG_COMPILER;
  d["flags"] = MOEPLUG_CXX_FLAGS;
  // The core links no OpenMP runtime; it may run on the embedding process's (use_openmp).
  d["openmp"] = std::string(executor()) == "openmp";
  d["threading"] = d["openmp"].cast<bool>() ? "the process's OpenMP team (GOMP_parallel)"
                                            : "moeplug::ThreadPool (std::thread)";
  d["num_threads"] = get_num_threads();
  d["hardware_concurrency"] = std::thread::hardware_concurrency();
  d["simd"] = simd_dispatch();
  return d;
}

}  // namespace

void register_runtime(py::module_& m) {
  m.attr("__version__") = MOEPLUG_VERSION;
  m.def("build_info", &build_info,
        "Dict describing this build: version, cuda, compiler, flags, threading, simd.");
  m.def("set_num_threads", &set_num_threads, py::arg("num_threads"),
        "Resize the worker pool (the calling thread counts as one).",
        py::call_guard<py::gil_scoped_release>());
  m.def("get_num_threads", &get_num_threads, "Current worker pool size.");
  m.def(
      "use_openmp",
      [](uintptr_t gomp_parallel) {
        use_openmp(reinterpret_cast<GompParallelFn>(gomp_parallel));
      },
      py::arg("gomp_parallel"),
      "Run the kernels' parallel loops on an OpenMP team: the address of the GOMP_parallel "
      "of the libgomp the process already uses (torch's); 0 returns to the runtime's pool.");
  m.def("executor", &executor, "What the kernels' parallel loops run on: 'openmp' or 'pool'.");
  m.def("retain_freed_memory", &retain_freed_memory,
        "Keep freed host memory in the process for reuse (glibc: no per-block mmap, trim above "
        "2 GiB). Process-wide; returns '' when applied, else why not.");
}

}  // namespace moeplug::py_bind
