#include "moeplug/capacity.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_capacity(py::module_& m) {
  def_kernel(
      m, "drop_over_capacity",
      +[](uintptr_t probs, uintptr_t ids, int64_t num_tokens, int64_t top_k, int64_t num_experts,
          int64_t capacity, bool by_probs, uintptr_t scratch, uintptr_t dropped) {
        drop_over_capacity(ptr<const float>(probs), ptr<const int64_t>(ids), num_tokens, top_k,
                           num_experts, capacity, by_probs, ptr<int64_t>(scratch),
                           ptr<uint8_t>(dropped));
      },
      py::arg("probs"), py::arg("ids"), py::arg("num_tokens"), py::arg("top_k"),
      py::arg("num_experts"), py::arg("capacity"), py::arg("by_probs"), py::arg("scratch"),
      py::arg("dropped"),
      "dropped [T, K] (bool) = 1 for the choices over each expert's capacity; scratch holds "
      "T*K + E + 1 int64.");
}

}  // namespace moeplug::py_bind
