#include "moeplug/stream.h"

#include "register.h"

namespace py = pybind11;

namespace moeplug::py_bind {

void register_stream(py::module_& m) {
  py::register_exception<KernelError>(m, "KernelError", PyExc_RuntimeError);

  py::class_<Event, std::shared_ptr<Event>>(m, "Event",
                                            "Completes when the work recorded before it has run.")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block until complete; raise KernelError naming the kernel that failed before it.")
      .def("query", &Event::query, "True once complete (never blocks, never raises).");

  py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream",
                                              "A runtime-owned FIFO work queue + its own thread.")
      .def_property_readonly("name", &Stream::name)
      .def("record", &Stream::record, "An Event that completes once everything queued so far ran.")
      .def("wait", &Stream::wait, py::arg("event"),
           "Work queued after this starts only once `event` (from any stream) has completed.")
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block until the queue is empty; raise (and clear) the stream's KernelError.")
      .def(
          "call",
          [](Stream& stream, py::function fn, std::string name) {
            if (name.empty()) name = py::str(fn.attr("__qualname__"));
            stream.enqueue(name, [held = hold(fn)] {
              py::gil_scoped_acquire gil;
              try {
                static_cast<py::object*>(held.get())->operator()();
              } catch (py::error_already_set& e) {
                throw std::runtime_error(e.what());  // "ValueError: ..." keeps the type's name
              }
            });
          },
          py::arg("fn"), py::arg("name") = "",
          "Queue a Python callable fn() (run with the GIL); `name` defaults to its __qualname__.");

  m.def("stream", &get_stream, py::arg("name"),
        "The process-wide runtime stream called `name` (same name -> same stream).");
  m.def("stream_names", &stream_names, "Names of the streams created so far.");
  def_kernel(m, "sleep", +[](int64_t microseconds) { sleep_kernel(microseconds); },
             py::arg("microseconds"), "A kernel that only sleeps: measures and tests overlap.");
}

}  // namespace moeplug::py_bind
