#include "moeplug/route.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_route(py::module_& m) {
  def_kernel(
      m, "route_forward",
      +[](uintptr_t logits, uintptr_t bias, uintptr_t probs, uintptr_t ids, uintptr_t aux_mean,
          uintptr_t counts, int64_t num_tokens, int64_t num_experts, int64_t top_k, int score,
          bool renormalize, int64_t num_groups, int64_t group_topk, int64_t group_members,
          float scaling, int aux_counts, int64_t num_sequences) {
        route_forward(ptr<const float>(logits), ptr<const float>(bias),
                      route_spec(num_tokens, num_experts, top_k, score, renormalize,
                                 num_groups, group_topk, group_members, scaling, aux_counts,
                                 num_sequences),
                      ptr<float>(probs), ptr<int64_t>(ids), ptr<float>(aux_mean),
                      ptr<int64_t>(counts));
      },
      py::arg("logits"), py::arg("bias"), py::arg("probs"), py::arg("ids"), py::arg("aux_mean"),
      py::arg("counts"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("score"), py::arg("renormalize"), py::arg("num_groups"), py::arg("group_topk"),
      py::arg("group_members"), py::arg("scaling"), py::arg("aux_counts"),
      py::arg("num_sequences"),
      "Fused top-k routing of fp32 logits [T, E]: probs [T, K], ids [T, K] and (aux_counts "
      "!= 0) aux_mean [B, E], counts [B, E]. score: 0 softmax, 1 sigmoid, 2 sqrtsoftplus; "
      "aux_counts: 0 none, 1 plain top-k, 2 routed.");
  def_kernel(
      m, "route_backward",
      +[](uintptr_t logits, uintptr_t ids, uintptr_t grad_probs, uintptr_t grad_aux_mean,
          uintptr_t grad_logits, int64_t num_tokens, int64_t num_experts, int64_t top_k,
          int score, bool renormalize, int64_t num_groups, int64_t group_topk,
          int64_t group_members, float scaling, int aux_counts, int64_t num_sequences) {
        route_backward(ptr<const float>(logits), ptr<const int64_t>(ids),
                       ptr<const float>(grad_probs), ptr<const float>(grad_aux_mean),
                       route_spec(num_tokens, num_experts, top_k, score, renormalize,
                                  num_groups, group_topk, group_members, scaling, aux_counts,
                                  num_sequences),
                       ptr<float>(grad_logits));
      },
      py::arg("logits"), py::arg("ids"), py::arg("grad_probs"), py::arg("grad_aux_mean"),
      py::arg("grad_logits"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("score"), py::arg("renormalize"), py::arg("num_groups"), py::arg("group_topk"),
      py::arg("group_members"), py::arg("scaling"), py::arg("aux_counts"),
      py::arg("num_sequences"),
      "Backward of route_forward: grad_logits [T, E] from grad_probs [T, K] and grad_aux_mean "
      "[B, E] (either may be 0).");
}

}  // namespace moeplug::py_bind
