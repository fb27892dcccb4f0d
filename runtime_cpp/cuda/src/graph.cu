// Runtime-owned CUDA graph capture/replay and the fixed-address device memory it replays over.
#include "common.cuh"

namespace moeplug::cuda {

namespace {
cudaGraph_t as_graph(std::uintptr_t g) { return reinterpret_cast<cudaGraph_t>(g); }
cudaGraphExec_t as_exec(std::uintptr_t e) { return reinterpret_cast<cudaGraphExec_t>(e); }
}  // namespace

Graph::~Graph() {
  if (capturing_ != 0) {  // abandon a capture left open (an exception inside it)
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(as_stream(capturing_), &g);
    if (g != nullptr) cudaGraphDestroy(g);
  }
  reset();
}

void Graph::begin_capture(StreamHandle stream) {
  if (capturing_ != 0) throw std::logic_error("Graph.begin_capture: a capture is already open");
  if (exec_ != 0) {
    throw std::logic_error("Graph.begin_capture: already captured; call reset() first to "
                           "record a new graph");
  }
  if (stream == 0) {
    // The legacy default stream cannot be captured: say so instead of cudaErrorStreamCapture*.
    throw std::invalid_argument("Graph.begin_capture: stream is 0 (the legacy default stream "
                                "cannot be captured); pass a runtime Stream's handle");
  }
  check(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture");
  capturing_ = stream;
}

void Graph::end_capture() {
  if (capturing_ == 0) throw std::logic_error("Graph.end_capture: no capture is open");
  cudaGraph_t g = nullptr;
  const cudaError_t err = cudaStreamEndCapture(as_stream(capturing_), &g);
  capturing_ = 0;
  check(err, "cudaStreamEndCapture");
  graph_ = reinterpret_cast<std::uintptr_t>(g);
  std::size_t n = 0;
  check(cudaGraphGetNodes(g, nullptr, &n), "cudaGraphGetNodes");
  num_nodes_ = static_cast<std::int64_t>(n);
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
  exec_ = reinterpret_cast<std::uintptr_t>(exec);
}

void Graph::replay(StreamHandle stream) {
  if (exec_ == 0) throw std::logic_error("Graph.replay: nothing captured yet");
  check(cudaGraphLaunch(as_exec(exec_), as_stream(stream)), "cudaGraphLaunch");
  ++replays_;
}

void Graph::reset() {
  if (exec_ != 0) cudaGraphExecDestroy(as_exec(exec_));
  if (graph_ != 0) cudaGraphDestroy(as_graph(graph_));
  exec_ = graph_ = 0;
  num_nodes_ = replays_ = 0;
}

StaticBuffer::StaticBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) throw std::invalid_argument("StaticBuffer: bytes is 0");
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc (StaticBuffer)");
  data_ = reinterpret_cast<std::uintptr_t>(p);
}

StaticBuffer::~StaticBuffer() { cudaFree(reinterpret_cast<void*>(data_)); }

}  // namespace moeplug::cuda
