#include <pybind11/stl.h>

#include "moeplug/stash.h"
#include "register.h"

namespace py = pybind11;

namespace moeplug::py_bind {

namespace {

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["page_bytes"] = s.page_bytes;
  d["num_pages"] = s.num_pages;
  d["pages_in_use"] = s.pages_in_use;
  d["high_water"] = s.high_water;
  d["overflows"] = s.overflows;
  d["allocs"] = s.allocs;
  return d;
}

}  // namespace

void register_stash(py::module_& m) {
  py::class_<PagePool, std::shared_ptr<PagePool>>(
      m, "PagePool", py::buffer_protocol(),
      "Fixed-size pages in one aligned allocation; alloc() gives a contiguous run of pages. "
      "Supports the buffer protocol (the whole pool as bytes): torch.frombuffer views it.")
      .def(py::init([](int64_t page_bytes, int64_t num_pages, bool own_memory) {
             return std::make_shared<PagePool>(page_bytes, num_pages, own_memory);
           }),
           py::arg("page_bytes"), py::arg("num_pages"), py::arg("own_memory") = true)
      .def_buffer([](PagePool& pool) -> py::buffer_info {
        if (pool.data() == nullptr) {
          throw py::value_error("PagePool: built with own_memory=False, it has no host bytes");
        }
        return py::buffer_info(pool.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {pool.size_bytes()}, {int64_t{1}}, /*readonly=*/false);
      })
      .def(
          "alloc",
          [](PagePool& pool, int64_t n_bytes) {
            PageRun r = pool.alloc(n_bytes);
            return py::make_tuple(r.first, r.count);
          },
          py::arg("n_bytes"),
          "(first_page, num_pages) of a contiguous run holding n_bytes; (-1, 0) on overflow.")
      .def(
          "free",
          [](PagePool& pool, int64_t first, int64_t count) {
            pool.free({first, count});
          },
          py::arg("first"), py::arg("count"), "Return a run from alloc() to the pool.")
      .def("stats", [](const PagePool& pool) { return stats_dict(pool.stats()); },
           "pages_in_use, high_water, overflows, allocs, page_bytes, num_pages.")
      .def("reset_high_water", &PagePool::reset_high_water)
      .def_property_readonly("page_bytes", &PagePool::page_bytes)
      .def_property_readonly("num_pages", &PagePool::num_pages)
      .def_property_readonly("size_bytes", &PagePool::size_bytes);

  py::class_<Registry, std::shared_ptr<Registry>>(
      m, "Registry", "The model's MoE layers, registered once at build; handles are ints.")
      .def(py::init([](int64_t page_bytes) {
             return std::make_shared<Registry>(page_bytes);
           }),
           py::arg("page_bytes"))
      .def(
          "register_layer",
          [](Registry& reg, int64_t index, int64_t num_experts, int64_t top_k, int64_t hidden,
             int64_t ffn_hidden, int64_t num_local_experts, std::string dtype,
             std::string activation, int64_t stash_bytes, std::vector<std::string> streams) {
            LayerSpec s{index,  num_experts,         top_k,
                        hidden, ffn_hidden,          num_local_experts,
                        dtype,  activation,          stash_bytes,
                        std::move(streams)};
            LayerGrant g = reg.register_layer(s);
            return py::make_tuple(g.handle, g.stash_pages);
          },
          py::arg("index"), py::arg("num_experts"), py::arg("top_k"), py::arg("hidden"),
          py::arg("ffn_hidden"), py::arg("num_local_experts"), py::arg("dtype"),
          py::arg("activation"), py::arg("stash_bytes"), py::arg("streams"),
          "Register one MoE layer; returns (handle, stash_pages).")
      .def_property_readonly("num_layers", &Registry::num_layers)
      .def_property_readonly("reserved_pages", &Registry::reserved_pages);
}

}  // namespace moeplug::py_bind
