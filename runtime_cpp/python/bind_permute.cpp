#include "moeplug/permute.h"
#include "moeplug/row_plan.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_permute(py::module_& m) {
  def_kernel(
      m, "place_rows",
      +[](uintptr_t ids, int64_t num_choices, int64_t num_experts, int64_t local_experts,
          uintptr_t base, uintptr_t scratch, uintptr_t row_map, uintptr_t dest_rank,
          uintptr_t dest_row) {
        place_rows(ptr<const int64_t>(ids), num_choices, num_experts, local_experts,
                   ptr<const int64_t>(base), ptr<int64_t>(scratch), ptr<int64_t>(row_map),
                   ptr<int64_t>(dest_rank), ptr<int64_t>(dest_row));
      },
      py::arg("ids"), py::arg("num_choices"), py::arg("num_experts"), py::arg("local_experts"),
      py::arg("base"), py::arg("scratch"), py::arg("row_map"), py::arg("dest_rank"),
      py::arg("dest_row"),
      "Direct-write plan of N choices (id E: dropped): row_map (expert-major row here), "
      "dest_rank (id / local_experts), dest_row (base[id] + index among this rank's choices of "
      "that expert); -1 for dropped. scratch holds 2*E + 1 int64.");
  def_kernel(
      m, "budget_slots",
      +[](uintptr_t key, int64_t num_choices, int64_t num_experts, int64_t budget,
          int64_t chunks, bool packed, uintptr_t scratch, uintptr_t slot, uintptr_t counts,
          uintptr_t overflow) {
        budget_slots(ptr<const int64_t>(key), num_choices, num_experts, budget, chunks, packed,
                     ptr<int64_t>(scratch), ptr<int64_t>(slot), ptr<int64_t>(counts),
                     ptr<uint8_t>(overflow));
      },
      py::arg("key"), py::arg("num_choices"), py::arg("num_experts"), py::arg("budget"),
      py::arg("chunks"), py::arg("packed"), py::arg("scratch"), py::arg("slot"),
      py::arg("counts"), py::arg("overflow"),
      "The sync-free layer's slots of N choices (key E: dropped): slot (the dump slot E * C "
      "for dropped and over-budget choices), counts [E] (kept per expert), overflow (one byte: "
      "1 when a routed choice went over the budget). scratch holds 2*E + 1 int64.");
  def_kernel(
      m, "move_row_chunks",
      +[](uintptr_t src, uintptr_t dst, int64_t row_bytes, uintptr_t counts, int64_t num_ranks,
          int64_t local_experts, bool to_expert_major) {
        move_row_chunks(ptr<const void>(src), ptr<void>(dst), row_bytes,
                        ptr<const int64_t>(counts), num_ranks, local_experts, to_expert_major);
      },
      py::arg("src"), py::arg("dst"), py::arg("row_bytes"), py::arg("counts"),
      py::arg("num_ranks"), py::arg("local_experts"), py::arg("to_expert_major"),
      "Rows arrived (rank, local expert)-major in chunks of counts [W, L] rows: into dst "
      "(local expert, rank)-major (to_expert_major), or back.");
  def_kernel(
      m, "permute",
      +[](uintptr_t x, uintptr_t ids, uintptr_t x_out, uintptr_t row_map, uintptr_t counts,
          int64_t num_tokens, int64_t top_k, int64_t hidden, int64_t num_experts, int dtype) {
        permute(ptr<const void>(x), ptr<const int64_t>(ids), num_tokens, top_k, hidden,
                num_experts, dtype_from_code(dtype, "permute"), ptr<void>(x_out),
                ptr<int64_t>(row_map), ptr<int64_t>(counts));
      },
      py::arg("x"), py::arg("ids"), py::arg("x_out"), py::arg("row_map"), py::arg("counts"),
      py::arg("num_tokens"), py::arg("top_k"), py::arg("hidden"), py::arg("num_experts"),
      py::arg("dtype"),
      "Group x [T, D] rows by expert into x_out [T*K, D]; fill row_map [T, K] and counts [E].");
  def_kernel(
      m, "unpermute",
      +[](uintptr_t y, uintptr_t row_map, uintptr_t probs, uintptr_t y_out, int64_t num_tokens,
          int64_t top_k, int64_t hidden, int64_t num_rows, int dtype) {
        unpermute(ptr<const void>(y), ptr<const int64_t>(row_map), ptr<const float>(probs),
                  num_tokens, top_k, hidden, num_rows, dtype_from_code(dtype, "unpermute"),
                  ptr<void>(y_out));
      },
      py::arg("y"), py::arg("row_map"), py::arg("probs"), py::arg("y_out"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("hidden"), py::arg("num_rows"), py::arg("dtype"),
      "y_out[t] = sum_k probs[t, k] * y[row_map[t, k]] (probs = 0: plain sum).");
  def_kernel(
      m, "unpermute_backward",
      +[](uintptr_t grad, uintptr_t y, uintptr_t row_map, uintptr_t probs, uintptr_t grad_y,
          uintptr_t grad_probs, int64_t num_tokens, int64_t top_k, int64_t hidden,
          int64_t num_rows, int dtype) {
        unpermute_backward(ptr<const void>(grad), ptr<const void>(y), ptr<const int64_t>(row_map),
                           ptr<const float>(probs), num_tokens, top_k, hidden, num_rows,
                           dtype_from_code(dtype, "unpermute_backward"), ptr<void>(grad_y),
                           ptr<float>(grad_probs));
      },
      py::arg("grad"), py::arg("y"), py::arg("row_map"), py::arg("probs"), py::arg("grad_y"),
      py::arg("grad_probs"), py::arg("num_tokens"), py::arg("top_k"), py::arg("hidden"),
      py::arg("num_rows"), py::arg("dtype"),
      "grad_y[row_map[t, k]] = probs[t, k] * grad[t]; grad_probs[t, k] = <grad[t], y[row]>.");
  def_kernel(
      m, "to_slots",
      +[](uintptr_t x, uintptr_t slots, uintptr_t probs, uintptr_t x_out, int64_t num_tokens,
          int64_t top_k, int64_t hidden, int64_t num_slots, int dtype) {
        to_slots(ptr<const void>(x), ptr<const int64_t>(slots), ptr<const float>(probs),
                 num_tokens, top_k, hidden, num_slots, dtype_from_code(dtype, "to_slots"),
                 ptr<void>(x_out));
      },
      py::arg("x"), py::arg("slots"), py::arg("probs"), py::arg("x_out"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("hidden"), py::arg("num_slots"), py::arg("dtype"),
      "x_out[slots[t, k]] = probs[t, k] * x[t] for every slot >= 0 (-1: no row; probs = 0: a "
      "copy); other rows untouched.");
  def_kernel(
      m, "from_slots",
      +[](uintptr_t y, uintptr_t slots, uintptr_t probs, uintptr_t y_out, int64_t num_tokens,
          int64_t top_k, int64_t hidden, int64_t num_slots, int dtype) {
        from_slots(ptr<const void>(y), ptr<const int64_t>(slots), ptr<const float>(probs),
                   num_tokens, top_k, hidden, num_slots, dtype_from_code(dtype, "from_slots"),
                   ptr<void>(y_out));
      },
      py::arg("y"), py::arg("slots"), py::arg("probs"), py::arg("y_out"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("hidden"), py::arg("num_slots"), py::arg("dtype"),
      "y_out[t] = sum_k probs[t, k] * y[slots[t, k]] over slots >= 0 (probs = 0: plain sum).");
  def_kernel(
      m, "from_slots_backward",
      +[](uintptr_t grad, uintptr_t y, uintptr_t slots, uintptr_t probs, uintptr_t grad_y,
          uintptr_t grad_probs, int64_t num_tokens, int64_t top_k, int64_t hidden,
          int64_t num_slots, int dtype) {
        from_slots_backward(ptr<const void>(grad), ptr<const void>(y),
                            ptr<const int64_t>(slots), ptr<const float>(probs), num_tokens,
                            top_k, hidden, num_slots,
                            dtype_from_code(dtype, "from_slots_backward"), ptr<void>(grad_y),
                            ptr<float>(grad_probs));
      },
      py::arg("grad"), py::arg("y"), py::arg("slots"), py::arg("probs"), py::arg("grad_y"),
      py::arg("grad_probs"), py::arg("num_tokens"), py::arg("top_k"), py::arg("hidden"),
      py::arg("num_slots"), py::arg("dtype"),
      "grad_y[slots[t, k]] = probs[t, k] * grad[t]; grad_probs[t, k] = <grad[t], y[slot]>, "
      "0 without a slot.");
}

}  // namespace moeplug::py_bind
