// Runtime-owned CUDA streams and events (thin RAII over the CUDA runtime API).
#include "common.cuh"

namespace moeplug::cuda {

namespace {
cudaEvent_t as_event(EventHandle e) { return reinterpret_cast<cudaEvent_t>(e); }
}  // namespace

Event::Event() {
  cudaEvent_t e;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  handle_ = reinterpret_cast<EventHandle>(e);
}

Event::~Event() { cudaEventDestroy(as_event(handle_)); }

void Event::record(StreamHandle stream) {
  check(cudaEventRecord(as_event(handle_), as_stream(stream)), "cudaEventRecord");
}

void Event::synchronize() {
  check(cudaEventSynchronize(as_event(handle_)), "cudaEventSynchronize");
}

bool Event::query() {
  const cudaError_t err = cudaEventQuery(as_event(handle_));
  if (err == cudaErrorNotReady) return false;
  check(err, "cudaEventQuery");
  return true;
}

Stream::Stream(int priority) {
  cudaStream_t s;
  check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority), "cudaStreamCreate");
  handle_ = reinterpret_cast<StreamHandle>(s);
}

Stream::~Stream() { cudaStreamDestroy(as_stream(handle_)); }

std::shared_ptr<Event> Stream::record() {
  auto event = std::make_shared<Event>();
  event->record(handle_);
  return event;
}

void Stream::wait(const Event& event) {
  check(cudaStreamWaitEvent(as_stream(handle_), as_event(event.handle()), 0),
        "cudaStreamWaitEvent");
}

void Stream::wait_stream(StreamHandle other) {
  Event marker;  // destroying a recorded event is fine: the wait already captured it
  marker.record(other);
  wait(marker);
}

void Stream::synchronize() {
  check(cudaStreamSynchronize(as_stream(handle_)), "cudaStreamSynchronize");
}

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error: no driver / no device is an answer, not a failure
    return 0;
  }
  return n;
}

}  // namespace moeplug::cuda
