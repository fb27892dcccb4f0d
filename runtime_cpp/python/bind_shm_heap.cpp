#include <pybind11/stl.h>

#include "moeplug/shm_heap.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_shm_heap(py::module_& m) {
  py::register_exception<PeerError>(m, "PeerError", PyExc_RuntimeError);
  py::class_<ShmHeap, std::shared_ptr<ShmHeap>>(
      m, "ShmHeap",
      "One rank's view of a symmetric shared-memory heap (create, attach(names), unlink_all()); "
      "moeplug.parallel.shm_heap sets it up over a torch.distributed group.")
      .def(py::init([](std::string name, int64_t data_bytes, int64_t num_slots, int rank,
                       int world) {
             return std::make_shared<ShmHeap>(std::move(name), data_bytes, num_slots, rank,
                                              world);
           }),
           py::arg("name"), py::arg("data_bytes"), py::arg("num_slots"), py::arg("rank"),
           py::arg("world"))
      .def("attach", &ShmHeap::attach, py::arg("names"),
           py::call_guard<py::gil_scoped_release>())
      .def("unlink_all", &ShmHeap::unlink_all)
      .def_property_readonly("name", &ShmHeap::name)
      .def_property_readonly("rank", &ShmHeap::rank)
      .def_property_readonly("world", &ShmHeap::world)
      .def_property_readonly("data_bytes", &ShmHeap::data_bytes)
      .def_property_readonly("num_slots", &ShmHeap::num_slots)
      .def_property_readonly("attached", &ShmHeap::attached)
      .def_property_readonly("unlinked", &ShmHeap::unlinked)
      .def("data_ptr", [](const ShmHeap& h, int r) { return uintptr_t(h.data(r)); },
           py::arg("rank"), "Address of rank's data region in this process.")
      .def("slots_ptr", [](const ShmHeap& h, int r) { return uintptr_t(h.slots(r)); },
           py::arg("rank"), "Address of rank's int64 payload slots in this process.")
      .def("publish", &ShmHeap::publish, py::arg("flag"), py::arg("value"),
           "Store-release this rank's flag.")
      .def("flag", &ShmHeap::flag, py::arg("rank"), py::arg("flag"), "Acquire-load a flag.")
      .def("wait_all", &ShmHeap::wait_all, py::arg("flag"), py::arg("value"),
           py::arg("timeout_s"), py::arg("what"), py::call_guard<py::gil_scoped_release>(),
           "Until every rank's flag >= value; PeerError names the rank that did not arrive.");

  def_kernel(
      m, "scatter_rows",
      +[](uintptr_t src, int64_t num_tokens, int64_t top_k, int64_t row_bytes, bool per_choice,
          uintptr_t dest_rank, uintptr_t dest_row, uintptr_t dest_base, int64_t world) {
        scatter_rows(ptr<const void>(src), num_tokens, top_k, row_bytes, per_choice,
                     ptr<const int64_t>(dest_rank), ptr<const int64_t>(dest_row),
                     ptr<const int64_t>(dest_base), world);
      },
      py::arg("src"), py::arg("num_tokens"), py::arg("top_k"), py::arg("row_bytes"),
      py::arg("per_choice"), py::arg("dest_rank"), py::arg("dest_row"), py::arg("dest_base"),
      py::arg("world"),
      "Copy token rows (or per-choice rows) to dest_base[dest_rank] + dest_row * row_bytes.");
  def_kernel(
      m, "copy_chunks",
      +[](uintptr_t src, int64_t row_bytes, uintptr_t chunks, int64_t num_chunks,
          uintptr_t dest_base, int64_t world) {
        copy_chunks(ptr<const void>(src), row_bytes, ptr<const int64_t>(chunks), num_chunks,
                    ptr<const int64_t>(dest_base), world);
      },
      py::arg("src"), py::arg("row_bytes"), py::arg("chunks"), py::arg("num_chunks"),
      py::arg("dest_base"), py::arg("world"),
      "Copy row runs (src_row, dest_rank, dest_row, rows) to dest_base[dest_rank].");
  def_kernel(
      m, "sum_received_rows",
      +[](uintptr_t rows, int64_t num_rows, uintptr_t row_map, uintptr_t weights, uintptr_t y,
          int64_t num_tokens, int64_t top_k, int64_t hidden, int dtype) {
        sum_received_rows(ptr<const void>(rows), num_rows, ptr<const int64_t>(row_map),
                          ptr<const float>(weights), num_tokens, top_k, hidden,
                          dtype_from_code(dtype, "sum_received_rows"), ptr<void>(y));
      },
      py::arg("rows"), py::arg("num_rows"), py::arg("row_map"), py::arg("weights"), py::arg("y"),
      py::arg("num_tokens"), py::arg("top_k"), py::arg("hidden"), py::arg("dtype"),
      "y[t] = sum_k w[t, k] * rows[row_map[t, k]], skipping row_map < 0 (w = 0: plain sum).");
  def_kernel(
      m, "pull_sum_rows",
      +[](uintptr_t pids, uintptr_t bases, int64_t rank, int64_t world, uintptr_t src_rank,
          uintptr_t src_row, uintptr_t y, int64_t num_tokens, int64_t top_k, int64_t hidden,
          int dtype) {
        pull_sum_rows(ptr<const int64_t>(pids), ptr<const int64_t>(bases), rank, world,
                      ptr<const int64_t>(src_rank), ptr<const int64_t>(src_row), num_tokens,
                      top_k, hidden, dtype_from_code(dtype, "pull_sum_rows"), ptr<void>(y));
      },
      py::arg("pids"), py::arg("bases"), py::arg("rank"), py::arg("world"), py::arg("src_rank"),
      py::arg("src_row"), py::arg("y"), py::arg("num_tokens"), py::arg("top_k"),
      py::arg("hidden"), py::arg("dtype"),
      "y[t] = sum_k row src_row[t, k] of process pids[src_rank[t, k]]'s rows at "
      "bases[src_rank[t, k]] (process_vm_readv; src_rank < 0: skipped), fp32 in k order.");
  m.def(
      "can_read_process",
      [](int64_t pid, uintptr_t remote, int64_t nbytes, uintptr_t local) {
        return can_read_process(pid, ptr<const void>(remote), nbytes, ptr<void>(local));
      },
      py::arg("pid"), py::arg("remote"), py::arg("nbytes"), py::arg("local"),
      "Whether process_vm_readv may read nbytes at remote in process pid (the set-up probe).");
}

}  // namespace moeplug::py_bind
