// One register_<subsystem>(m) per binding file; bindings.cpp lists them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace moeplug::py_bind {

void register_runtime(pybind11::module_& m);
void register_permute(pybind11::module_& m);
void register_swiglu(pybind11::module_& m);

// Tensors cross the boundary as tensor.data_ptr() integers; 0 means "absent".
template <class T>
inline T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace moeplug::py_bind
