// One register_<subsystem>(m) per binding file; bindings.cpp lists them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "moeplug/adamw.h"
#include "moeplug/route.h"
#include "moeplug/stream.h"

namespace moeplug::py_bind {

void register_runtime(pybind11::module_& m);
void register_stream(pybind11::module_& m);
void register_permute(pybind11::module_& m);
void register_capacity(pybind11::module_& m);
void register_swiglu(pybind11::module_& m);
void register_route(pybind11::module_& m);
void register_stash(pybind11::module_& m);
void register_shm_heap(pybind11::module_& m);
void register_spill(pybind11::module_& m);
void register_adamw(pybind11::module_& m);

// A core call's std::invalid_argument reaches Python as ValueError with its message: pybind11's
// built-in translation, so bindings call the core directly, with no try/catch of their own.

// Tensors cross the boundary as tensor.data_ptr() integers; 0 means "absent".
template <class T>
inline T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// moeplug/adamw.h's AdamWScalars, built by keywords once per step (moeplug.ops.adamw._scalars)
// and passed to the AdamW kernels by value. The CUDA extension binds it too, module-local:
// two global registrations of one C++ type collide.
inline void bind_adamw_scalars(pybind11::module_& m, bool module_local) {
  namespace py = pybind11;
  py::class_<AdamWScalars>(m, "AdamWScalars", py::module_local(module_local))
      .def(py::init([](float lerp_weight, float beta2, float grad_sq_coef, float decay,
                       float bias2_sqrt, float eps, float step_size, uint32_t step) {
             return AdamWScalars{lerp_weight, beta2, grad_sq_coef, decay, bias2_sqrt, eps,
                                 step_size, step};
           }),
           py::kw_only(), py::arg("lerp_weight"), py::arg("beta2"), py::arg("grad_sq_coef"),
           py::arg("decay"), py::arg("bias2_sqrt"), py::arg("eps"), py::arg("step_size"),
           py::arg("step"));
}

// moeplug/route.h's RouteSpec from route_forward / route_backward's flat arguments (enums as
// ints: moeplug.routing.fused's codes), shared by the CPU and CUDA bindings.
inline RouteSpec route_spec(int64_t T, int64_t E, int64_t K, int score, bool renormalize,
                            int64_t G, int64_t group_topk, int64_t group_members, float scaling,
                            int aux_counts, int64_t B) {
  RouteSpec s;
  s.num_tokens = T;
  s.num_experts = E;
  s.top_k = K;
  s.score = static_cast<ScoreFunction>(score);
  s.renormalize = renormalize;
  s.num_groups = G;
  s.group_topk = group_topk;
  s.group_members = group_members;
  s.scaling = scaling;
  s.aux_counts = static_cast<AuxCounts>(aux_counts);
  s.num_sequences = B;
  return s;
}

// Keeps a Python object alive inside a C++ closure; the last owner (a stream's worker thread,
// once the kernel ran) takes the GIL to drop it. None holds nothing.
inline std::shared_ptr<void> hold(pybind11::object obj) {
  if (obj.is_none()) return nullptr;
  return std::shared_ptr<void>(new pybind11::object(std::move(obj)), [](void* p) {
    pybind11::gil_scoped_acquire gil;
    delete static_cast<pybind11::object*>(p);
  });
}

// Binds a kernel twice, from one definition: `name(...)` runs it now on the calling thread,
// and `Stream.enqueue_<name>(..., keep=None)` queues it on a runtime stream. Both run without
// the GIL. `keep` (e.g. the tensors whose pointers were passed) stays alive until it has run.
// `extra` is the py::arg list of `fn`'s parameters and the docstring.
template <class... A, class... Extra>
void def_kernel(pybind11::module_& m, const char* name, void (*fn)(A...),
                const Extra&... extra) {
  namespace py = pybind11;
  m.def(name, fn, extra..., py::call_guard<py::gil_scoped_release>());
  py::class_<Stream, std::shared_ptr<Stream>> stream_cls = m.attr("Stream");
  const std::string kernel = name;
  stream_cls.def(
      ("enqueue_" + kernel).c_str(),
      [fn, kernel](Stream& stream, A... args, py::object keep) {
        stream.enqueue(kernel, [fn, args..., held = hold(std::move(keep))] { fn(args...); });
      },
      extra..., py::arg("keep") = py::none());
}

}  // namespace moeplug::py_bind
