#include <pybind11/stl.h>

#include "moeplug/spill.h"
#include "register.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::py_bind {

void register_spill(py::module_& m) {
  py::class_<SpillTier, std::shared_ptr<SpillTier>>(
      m, "SpillTier",
      "The stash's second tier on the CPU: pages of an unlinked, sparse file in `directory`. "
      "write()/read() copy bytes between a pointer and a run; free() punches the run out.")
      .def(py::init([](const std::string& directory, int64_t page_bytes, int64_t num_pages) {
             return std::make_shared<SpillTier>(directory, page_bytes, num_pages);
           }),
           py::arg("directory"), py::arg("page_bytes"), py::arg("num_pages"))
      .def(
          "alloc",
          [](SpillTier& t, int64_t n_bytes) {
            PageRun r = t.alloc(n_bytes);
            return py::make_tuple(r.first, r.count);
          },
          py::arg("n_bytes"), "(first_page, num_pages) for n_bytes; (-1, 0) on overflow.")
      .def(
          "free",
          [](SpillTier& t, int64_t first, int64_t count) {
            t.free({first, count});
          },
          py::arg("first"), py::arg("count"))
      .def(
          "write",
          [](SpillTier& t, int64_t first, int64_t count, uintptr_t src, int64_t n_bytes) {
            py::gil_scoped_release nogil;
            t.write({first, count}, ptr<const void>(src), n_bytes);
          },
          py::arg("first"), py::arg("count"), py::arg("src"), py::arg("n_bytes"),
          "Copy n_bytes at address src into the run (now, on this thread, without the GIL).")
      .def(
          "read",
          [](SpillTier& t, int64_t first, int64_t count, uintptr_t dst, int64_t n_bytes) {
            py::gil_scoped_release nogil;
            t.read({first, count}, ptr<void>(dst), n_bytes);
          },
          py::arg("first"), py::arg("count"), py::arg("dst"), py::arg("n_bytes"),
          "Copy n_bytes of the run to address dst (now, on this thread, without the GIL).")
      .def(
          "stats",
          [](const SpillTier& t) {
            SpillStats s = t.stats();
            py::dict d;
            d["page_bytes"] = s.pages.page_bytes;
            d["num_pages"] = s.pages.num_pages;
            d["pages_in_use"] = s.pages.pages_in_use;
            d["high_water"] = s.pages.high_water;
            d["overflows"] = s.pages.overflows;
            d["allocs"] = s.pages.allocs;
            d["bytes_written"] = s.bytes_written;
            d["bytes_read"] = s.bytes_read;
            return d;
          },
          "pages_in_use, high_water, overflows, allocs, bytes_written, bytes_read, ...")
      .def("reset_high_water", &SpillTier::reset_high_water,
           "high_water <- pages_in_use (the trainer reports each step's peak).")
      .def_property_readonly("page_bytes", &SpillTier::page_bytes)
      .def_property_readonly("num_pages", &SpillTier::num_pages)
      .def_property_readonly("directory", &SpillTier::directory);

  // Moves between the tiers as stream work: queued behind whatever the stream already holds,
  // ordered against other streams with record()/wait(). `keep` (the tensor behind the pointer)
  // lives until the copy ran, so the caller may drop its reference right after queuing.
  py::class_<Stream, std::shared_ptr<Stream>> stream_cls = m.attr("Stream");
  stream_cls
      .def(
          "enqueue_spill_write",
          [](Stream& s, std::shared_ptr<SpillTier> tier, int64_t first, int64_t count,
             uintptr_t src, int64_t n_bytes, py::object keep) {
            s.enqueue("spill_write", [tier, first, count, src, n_bytes,
                                      held = hold(std::move(keep))] {
              tier->write({first, count}, ptr<const void>(src), n_bytes);
            });
          },
          py::arg("tier"), py::arg("first"), py::arg("count"), py::arg("src"),
          py::arg("n_bytes"), py::arg("keep") = py::none())
      .def(
          "enqueue_spill_read",
          [](Stream& s, std::shared_ptr<SpillTier> tier, int64_t first, int64_t count,
             uintptr_t dst, int64_t n_bytes, py::object keep) {
            s.enqueue("spill_read", [tier, first, count, dst, n_bytes,
                                     held = hold(std::move(keep))] {
              tier->read({first, count}, ptr<void>(dst), n_bytes);
            });
          },
          py::arg("tier"), py::arg("first"), py::arg("count"), py::arg("dst"),
          py::arg("n_bytes"), py::arg("keep") = py::none())
      .def(
          "enqueue_spill_free",
          [](Stream& s, std::shared_ptr<SpillTier> tier, int64_t first, int64_t count) {
            s.enqueue("spill_free", [tier, first, count] { tier->free({first, count}); });
          },
          py::arg("tier"), py::arg("first"), py::arg("count"),
          "Return the run after the stream's earlier copies of it ran.");
}

}  // namespace moeplug::py_bind
