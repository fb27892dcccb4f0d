#include "moeplug/adamw.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_adamw(py::module_& m) {
  bind_adamw_scalars(m, /*module_local=*/false);
  def_kernel(
      m, "adamw_step",
      +[](uintptr_t param, uintptr_t grad, int param_dtype, uintptr_t exp_avg,
          uintptr_t exp_avg_sq, int moment_dtype, int64_t n, AdamWScalars s) {
        adamw_step(ptr<void>(param), ptr<const void>(grad),
                   dtype_from_code(param_dtype, "adamw_step param_dtype"), ptr<void>(exp_avg),
                   ptr<void>(exp_avg_sq), dtype_from_code(moment_dtype, "adamw_step moment_dtype"),
                   n, s);
      },
      py::arg("param"), py::arg("grad"), py::arg("param_dtype"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("moment_dtype"), py::arg("n"), py::arg("scalars"),
      "One fused AdamW step over n elements in place (torch's arithmetic, moeplug/adamw.h); a "
      "bf16 param rounds stochastically with seed `scalars.step`, bf16 moments to nearest even.");
  def_kernel(
      m, "adamw_step_main",
      +[](uintptr_t main, uintptr_t grad, uintptr_t param, uintptr_t exp_avg,
          uintptr_t exp_avg_sq, int moment_dtype, int64_t n, AdamWScalars s) {
        adamw_step_main(ptr<float>(main), ptr<const uint16_t>(grad), ptr<uint16_t>(param),
                        ptr<void>(exp_avg), ptr<void>(exp_avg_sq),
                        dtype_from_code(moment_dtype, "adamw_step_main moment_dtype"), n, s);
      },
      py::arg("main"), py::arg("grad"), py::arg("param"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("moment_dtype"), py::arg("n"), py::arg("scalars"),
      "One fused AdamW step of an fp32 main copy (n elements) from a bf16 grad, writing the bf16 "
      "param as the result rounded to nearest even, in one pass (moeplug/adamw.h).");
  def_kernel(
      m, "stochastic_round_bf16",
      +[](uintptr_t src, uintptr_t dst, int64_t n, uint32_t step) {
        stochastic_round_bf16(ptr<const float>(src), n, step, ptr<uint16_t>(dst));
      },
      py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("step"),
      "dst (bf16) [n] <- src (fp32) [n] rounded stochastically (hash of the value and step).");
}

}  // namespace moeplug::py_bind
