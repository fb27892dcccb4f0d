#include "moeplug/swiglu.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_swiglu(py::module_& m) {
  def_kernel(
      m, "swiglu_forward",
      +[](uintptr_t h, uintptr_t probs, uintptr_t a, int64_t num_rows, int64_t ffn_hidden,
          int dtype) {
        swiglu_forward(ptr<const void>(h), ptr<const float>(probs), num_rows, ffn_hidden,
                       dtype_from_code(dtype, "swiglu_forward"), ptr<void>(a));
      },
      py::arg("h"), py::arg("probs"), py::arg("a"), py::arg("num_rows"), py::arg("ffn_hidden"),
      py::arg("dtype"),
      "a [S, F] = silu(h[:, :F]) * h[:, F:] * probs (probs = 0: no weighting).");
  def_kernel(
      m, "swiglu_backward",
      +[](uintptr_t grad_a, uintptr_t h, uintptr_t probs, uintptr_t grad_h, uintptr_t grad_probs,
          int64_t num_rows, int64_t ffn_hidden, int dtype) {
        swiglu_backward(ptr<const void>(grad_a), ptr<const void>(h), ptr<const float>(probs),
                        num_rows, ffn_hidden, dtype_from_code(dtype, "swiglu_backward"),
                        ptr<void>(grad_h), ptr<float>(grad_probs));
      },
      py::arg("grad_a"), py::arg("h"), py::arg("probs"), py::arg("grad_h"), py::arg("grad_probs"),
      py::arg("num_rows"), py::arg("ffn_hidden"), py::arg("dtype"),
            "Backward of swiglu_forward: grad_h [S, 2F] and (if grad_probs != 0) grad_probs [S].");
}

}  // namespace moeplug::py_bind
