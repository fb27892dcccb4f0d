// moeplug._runtime_core: the thin Python layer over the C++ core. Kernels take raw pointers
// (tensor.data_ptr()), shapes and a dtype code (0 float32, 1 bfloat16) and run without the GIL.
#include "register.h"

PYBIND11_MODULE(_runtime_core, m) {
  m.doc() = "moeplug C++ runtime core: thread pool, streams/events, permute/unpermute, capacity dropping, "
          "fused SwiGLU, fused top-k routing, paged stash pool + layer registry, "
          "shared-memory heap, file-backed spill tier, fused AdamW + bf16 stochastic rounding";
  moeplug::py_bind::register_runtime(m);
  moeplug::py_bind::register_stream(m);  // before the kernels: they add Stream.enqueue_*
  moeplug::py_bind::register_permute(m);
  moeplug::py_bind::register_capacity(m);
  moeplug::py_bind::register_swiglu(m);
  moeplug::py_bind::register_route(m);
  moeplug::py_bind::register_stash(m);
  moeplug::py_bind::register_shm_heap(m);
  moeplug::py_bind::register_adamw(m);
  moeplug::py_bind::register_spill(m);  // after the stream: adds Stream.enqueue_spill_*
}
