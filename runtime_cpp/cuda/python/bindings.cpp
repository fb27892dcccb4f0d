// moeplug._runtime_cuda: CUDA kernels and runtime-owned CUDA streams/events. Like
// _runtime_core it does not link libtorch: device pointers (tensor.data_ptr()) and streams
// (torch.cuda.current_stream().cuda_stream, or a runtime Stream's .handle) cross as integers.
// Kernel launches are asynchronous on `stream`; they only release the GIL.
#include <map>
#include <mutex>
#include <string>

#include "../../python/register.h"  // ptr<T>
#include "moeplug/cuda/kernels.h"

namespace py = pybind11;
using std::uintptr_t;

namespace moeplug::cuda {
namespace {

std::shared_ptr<Stream> named_stream(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<Stream>> streams;
  if (name.empty()) throw std::invalid_argument("stream: name is empty; pass e.g. \"comm\"");
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = streams[name];
  if (!slot) slot = std::make_shared<Stream>();
  return slot;
}

void register_streams(py::module_& m) {
  py::class_<Event, std::shared_ptr<Event>>(m, "Event", "A runtime-owned cudaEvent_t.")
      .def(py::init<>())
      .def_property_readonly("handle", &Event::handle)
      .def("record", &Event::record, py::arg("stream"),
           "Record on a raw cudaStream_t (e.g. torch.cuda.current_stream().cuda_stream).")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Event::query);
  py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream", "A runtime-owned cudaStream_t.")
      .def_property_readonly("handle", &Stream::handle,
                             "The raw cudaStream_t: torch.cuda.ExternalStream(handle) runs on it.")
      .def("record", &Stream::record, "A new Event recorded on this stream.")
      .def("wait", &Stream::wait, py::arg("event"))
      .def("wait_stream", &Stream::wait_stream, py::arg("stream"),
           "Order this stream after the work queued so far on a raw cudaStream_t.")
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>());
  m.def("stream", &named_stream, py::arg("name"),
        "The process-wide runtime CUDA stream called `name` (same name -> same stream).");
}

void register_graphs(py::module_& m) {
  py::class_<Graph, std::shared_ptr<Graph>>(
      m, "Graph", "A runtime-owned CUDA graph: capture once on a stream, replay every step.")
      .def(py::init<>())
      .def("begin_capture", &Graph::begin_capture, py::arg("stream"),
           "Start recording the work queued on a raw cudaStream_t (not 0).")
      .def("end_capture", &Graph::end_capture, "Stop recording and instantiate the graph.")
      .def("replay", &Graph::replay, py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
           "Launch the recorded graph on a raw cudaStream_t (asynchronous).")
      .def("reset", &Graph::reset)
      .def_property_readonly("captured", &Graph::captured)
      .def_property_readonly("capturing", &Graph::capturing)
      .def_property_readonly("num_nodes", &Graph::num_nodes)
      .def_property_readonly("replays", &Graph::replays);
  py::class_<StaticBuffer, std::shared_ptr<StaticBuffer>>(
      m, "StaticBuffer", "Runtime-owned device memory at a fixed address (cudaMalloc once).")
      .def(py::init<std::size_t>(), py::arg("bytes"))
      .def_property_readonly("data", &StaticBuffer::data, "The device address (an integer).")
      .def_property_readonly("bytes", &StaticBuffer::bytes);
}

void register_kernels(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def(
      "permute",
      [](uintptr_t x, uintptr_t row_map, uintptr_t x_out, int64_t num_tokens, int64_t top_k,
         int64_t hidden, int dtype, uintptr_t stream) {
        permute(py_bind::ptr<const void>(x), py_bind::ptr<const int64_t>(row_map), num_tokens,
                top_k, hidden, dtype_from_code(dtype, "cuda permute"),
                py_bind::ptr<void>(x_out), stream);
      },
      py::arg("x"), py::arg("row_map"), py::arg("x_out"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("hidden"), py::arg("dtype"), py::arg("stream") = 0, nogil,
      "x_out[row_map[t, k]] = x[t].");
  m.def(
      "unpermute",
      [](uintptr_t y, uintptr_t row_map, uintptr_t probs, uintptr_t y_out, int64_t num_tokens,
         int64_t top_k, int64_t hidden, int dtype, uintptr_t stream) {
        unpermute(py_bind::ptr<const void>(y), py_bind::ptr<const int64_t>(row_map),
                  py_bind::ptr<const float>(probs), num_tokens, top_k, hidden,
                  dtype_from_code(dtype, "cuda unpermute"), py_bind::ptr<void>(y_out), stream);
      },
      py::arg("y"), py::arg("row_map"), py::arg("probs"), py::arg("y_out"), py::arg("num_tokens"),
      py::arg("top_k"), py::arg("hidden"), py::arg("dtype"), py::arg("stream") = 0, nogil,
      "y_out[t] = sum_k probs[t, k] * y[row_map[t, k]] (probs = 0: plain sum).");
  m.def(
      "swiglu_forward",
      [](uintptr_t h, uintptr_t probs, uintptr_t a, int64_t num_rows, int64_t ffn_hidden,
         int dtype, uintptr_t stream) {
        swiglu_forward(py_bind::ptr<const void>(h), py_bind::ptr<const float>(probs), num_rows,
                       ffn_hidden, dtype_from_code(dtype, "cuda swiglu_forward"),
                       py_bind::ptr<void>(a), stream);
      },
      py::arg("h"), py::arg("probs"), py::arg("a"), py::arg("num_rows"), py::arg("ffn_hidden"),
      py::arg("dtype"), py::arg("stream") = 0, nogil,
      "a [S, F] = silu(h[:, :F]) * h[:, F:] * probs (probs = 0: no weighting).");
  m.def(
      "swiglu_backward",
      [](uintptr_t grad_a, uintptr_t h, uintptr_t probs, uintptr_t grad_h, uintptr_t grad_probs,
         int64_t num_rows, int64_t ffn_hidden, int dtype, uintptr_t stream) {
        swiglu_backward(py_bind::ptr<const void>(grad_a), py_bind::ptr<const void>(h),
                        py_bind::ptr<const float>(probs), num_rows, ffn_hidden,
                        dtype_from_code(dtype, "cuda swiglu_backward"),
                        py_bind::ptr<void>(grad_h), py_bind::ptr<float>(grad_probs), stream);
      },
      py::arg("grad_a"), py::arg("h"), py::arg("probs"), py::arg("grad_h"), py::arg("grad_probs"),
      py::arg("num_rows"), py::arg("ffn_hidden"), py::arg("dtype"), py::arg("stream") = 0, nogil,
      "Backward of swiglu_forward: grad_h [S, 2F] and (if grad_probs != 0) grad_probs [S].");
  m.def(
      "topk_route",
      [](uintptr_t logits, uintptr_t bias, uintptr_t probs, uintptr_t ids, int64_t num_tokens,
         int64_t num_experts, int64_t top_k, int score, bool renormalize, float scaling_factor,
         int dtype, uintptr_t stream) {
        topk_route(py_bind::ptr<const void>(logits), py_bind::ptr<const float>(bias), num_tokens,
                   num_experts, top_k, static_cast<ScoreFunction>(score), renormalize,
                   scaling_factor, dtype_from_code(dtype, "cuda topk_route"),
                   py_bind::ptr<float>(probs), py_bind::ptr<int64_t>(ids), stream);
      },
      py::arg("logits"), py::arg("bias"), py::arg("probs"), py::arg("ids"), py::arg("num_tokens"),
      py::arg("num_experts"), py::arg("top_k"), py::arg("score"), py::arg("renormalize"),
      py::arg("scaling_factor"), py::arg("dtype"), py::arg("stream") = 0, nogil,
      "Fused top-k routing over E <= 256 (score 0 softmax, 1 sigmoid): probs [T, K] fp32, "
      "ids [T, K] int64.");
  m.def(
      "route_forward",
      [](uintptr_t logits, uintptr_t bias, uintptr_t probs, uintptr_t ids, uintptr_t aux_mean,
             uintptr_t counts, int64_t num_tokens, int64_t num_experts, int64_t top_k, int score,
             bool renormalize, int64_t num_groups, int64_t group_topk, int64_t group_members,
             float scaling, int aux_counts, int64_t num_sequences, uintptr_t stream) {
        route_forward(py_bind::ptr<const float>(logits), py_bind::ptr<const float>(bias),
                      py_bind::route_spec(num_tokens, num_experts, top_k, score, renormalize,
                                          num_groups, group_topk, group_members, scaling,
                                          aux_counts, num_sequences),
                      py_bind::ptr<float>(probs), py_bind::ptr<int64_t>(ids),
                      py_bind::ptr<float>(aux_mean), py_bind::ptr<int64_t>(counts), stream);
      },
      py::arg("logits"), py::arg("bias"), py::arg("probs"), py::arg("ids"), py::arg("aux_mean"),
      py::arg("counts"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("score"), py::arg("renormalize"), py::arg("num_groups"), py::arg("group_topk"),
      py::arg("group_members"), py::arg("scaling"), py::arg("aux_counts"),
      py::arg("num_sequences"), py::arg("stream") = 0, nogil,
      "The fused router (same arguments as _runtime_core.route_forward) on device pointers.");
  m.def(
      "route_backward",
      [](uintptr_t logits, uintptr_t ids, uintptr_t grad_probs, uintptr_t grad_aux_mean,
             uintptr_t grad_logits, int64_t num_tokens, int64_t num_experts, int64_t top_k,
             int score, bool renormalize, int64_t num_groups, int64_t group_topk,
             int64_t group_members, float scaling, int aux_counts, int64_t num_sequences,
             uintptr_t stream) {
        route_backward(py_bind::ptr<const float>(logits), py_bind::ptr<const int64_t>(ids),
                       py_bind::ptr<const float>(grad_probs),
                       py_bind::ptr<const float>(grad_aux_mean),
                       py_bind::route_spec(num_tokens, num_experts, top_k, score, renormalize,
                                           num_groups, group_topk, group_members, scaling,
                                           aux_counts, num_sequences),
                       py_bind::ptr<float>(grad_logits), stream);
      },
      py::arg("logits"), py::arg("ids"), py::arg("grad_probs"), py::arg("grad_aux_mean"),
      py::arg("grad_logits"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("score"), py::arg("renormalize"), py::arg("num_groups"), py::arg("group_topk"),
      py::arg("group_members"), py::arg("scaling"), py::arg("aux_counts"),
      py::arg("num_sequences"), py::arg("stream") = 0, nogil,
      "Backward of route_forward on device pointers.");
}

void register_optimizer(py::module_& m) {
  py_bind::bind_adamw_scalars(m, /*module_local=*/true);  // the core's, for CUDA pointers
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def(
      "adamw_step",
      [](uintptr_t param, uintptr_t grad, int param_dtype, uintptr_t exp_avg,
         uintptr_t exp_avg_sq, int moment_dtype, int64_t n, AdamWScalars s, uintptr_t stream) {
        adamw_step(py_bind::ptr<void>(param), py_bind::ptr<const void>(grad),
                   dtype_from_code(param_dtype, "cuda adamw_step param_dtype"),
                   py_bind::ptr<void>(exp_avg), py_bind::ptr<void>(exp_avg_sq),
                   dtype_from_code(moment_dtype, "cuda adamw_step moment_dtype"), n, s, stream);
      },
      py::arg("param"), py::arg("grad"), py::arg("param_dtype"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("moment_dtype"), py::arg("n"), py::arg("scalars"),
      py::arg("stream") = 0, nogil,
      "_runtime_core.adamw_step on device pointers, bitwise its results.");
  m.def(
      "adamw_step_main",
      [](uintptr_t main, uintptr_t grad, uintptr_t param, uintptr_t exp_avg,
         uintptr_t exp_avg_sq, int moment_dtype, int64_t n, AdamWScalars s, uintptr_t stream) {
        adamw_step_main(py_bind::ptr<float>(main), py_bind::ptr<const uint16_t>(grad),
                        py_bind::ptr<uint16_t>(param), py_bind::ptr<void>(exp_avg),
                        py_bind::ptr<void>(exp_avg_sq),
                        dtype_from_code(moment_dtype, "cuda adamw_step_main moment_dtype"), n, s,
                        stream);
      },
      py::arg("main"), py::arg("grad"), py::arg("param"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("moment_dtype"), py::arg("n"), py::arg("scalars"),
      py::arg("stream") = 0, nogil,
      "_runtime_core.adamw_step_main on device pointers, bitwise its results.");
  m.def(
      "stochastic_round_bf16",
      [](uintptr_t src, uintptr_t dst, int64_t n, uint32_t step, uintptr_t stream) {
        stochastic_round_bf16(py_bind::ptr<const float>(src), n, step,
                              py_bind::ptr<uint16_t>(dst), stream);
      },
      py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("step"), py::arg("stream") = 0,
      nogil, "_runtime_core.stochastic_round_bf16 on device pointers.");
}

}  // namespace
}  // namespace moeplug::cuda

PYBIND11_MODULE(_runtime_cuda, m) {
  m.doc() = "moeplug CUDA runtime: permute/unpermute, fused SwiGLU, top-k routing, streams, graphs";
  m.attr("__version__") = MOEPLUG_VERSION;
  m.def("build_info", [] {
    py::dict d;
    d["version"] = MOEPLUG_VERSION;
    d["cuda_runtime"] = moeplug::cuda::runtime_version();
    d["cuda_architectures"] = MOEPLUG_CUDA_ARCHITECTURES;
    return d;
  });
  m.def("device_count", &moeplug::cuda::device_count);
  moeplug::cuda::register_streams(m);
  moeplug::cuda::register_kernels(m);
  moeplug::cuda::register_optimizer(m);
  moeplug::cuda::register_graphs(m);
}
