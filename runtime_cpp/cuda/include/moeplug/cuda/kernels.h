// CUDA versions of the runtime kernels plus runtime-owned CUDA streams and events.
//
// Plain C++ declarations (no CUDA headers): device pointers and cudaStream_t/cudaEvent_t
// cross as integers, so the bindings and torch interop (torch.cuda.current_stream().cuda_stream)
// need neither nvcc nor libtorch. Every kernel runs asynchronously on `stream` (0: the legacy
// default stream) and throws std::runtime_error naming the kernel when the launch fails.
//
// Shape legend: T tokens, K top-k, D hidden, E experts, S routed rows, F expert FFN size.
// x/y/h/a/grad rows are fp32 or bf16 (DType); ids and row_map int64; probs fp32. Semantics are
// those of the CPU kernels (moeplug/permute.h, moeplug/swiglu.h) and of
// moeplug.routing.scores.topk_routing for topk_route.
#pragma once

#include <cstdint>
#include <memory>

#include "moeplug/adamw.h"
#include "moeplug/dtype.h"
#include "moeplug/route.h"

namespace moeplug::cuda {

using StreamHandle = std::uintptr_t;  // a cudaStream_t
using EventHandle = std::uintptr_t;   // a cudaEvent_t

// x_SD[row_map[t, k]] = x_TD[t]  (row_map as the CPU permute returns it; -1: no row, skipped).
void permute(const void* x_TD, const int64_t* row_map_TK, int64_t T, int64_t K, int64_t D,
             DType dtype, void* x_SD, StreamHandle stream);

// y_TD[t] = sum_k p[t, k] * y_SD[row_map[t, k]] (plain sum when probs_TK is null), fp32 sums;
// a row_map of -1 adds nothing.
void unpermute(const void* y_SD, const int64_t* row_map_TK, const float* probs_TK, int64_t T,
               int64_t K, int64_t D, DType dtype, void* y_TD, StreamHandle stream);

// a_SF = silu(h[:, :F]) * h[:, F:] * p  (p = 1 when probs_S is null).
void swiglu_forward(const void* h_S2F, const float* probs_S, int64_t S, int64_t F, DType dtype,
                    void* a_SF, StreamHandle stream);

// grad_h_S2F, and grad_probs_S[s] = sum_f grad_a * silu(g) * u when grad_probs_S is non-null.
void swiglu_backward(const void* grad_a_SF, const void* h_S2F, const float* probs_S, int64_t S,
                     int64_t F, DType dtype, void* grad_h_S2F, float* grad_probs_S,
                     StreamHandle stream);

enum class ScoreFunction : int { kSoftmax = 0, kSigmoid = 1 };
constexpr int64_t kMaxRouteExperts = 256;

// Top-k routing of logits_TE (E <= 256): ids_TK in descending selection score, probs_TK fp32.
// softmax + renormalize: softmax over the K chosen logits; softmax alone: chosen softmax(z);
// sigmoid: chosen sigmoid(z) (selected by sigmoid(z) + bias_E when bias_E is non-null),
// divided by (their sum + 1e-20) when renormalize and K > 1. Then probs *= scaling_factor.
void topk_route(const void* logits_TE, const float* bias_E, int64_t T, int64_t E, int64_t K,
                ScoreFunction score, bool renormalize, float scaling_factor, DType dtype,
                float* probs_TK, int64_t* ids_TK, StreamHandle stream);

// The fused router of moeplug/route.h (fp32 logits, E <= kMaxRouteExperts): groups, bias, aux
// statistics (aux_mean_BE, counts_BE: zeroed here, then accumulated) and the backward.
void route_forward(const float* logits_TE, const float* bias_E, const moeplug::RouteSpec& spec,
                   float* probs_TK, int64_t* ids_TK, float* aux_mean_BE, int64_t* counts_BE,
                   StreamHandle stream);
void route_backward(const float* logits_TE, const int64_t* ids_TK, const float* grad_probs_TK,
                    const float* grad_aux_mean_BE, const moeplug::RouteSpec& spec,
                    float* grad_logits_TE, StreamHandle stream);

// The fused AdamW step and bf16 stochastic rounding of moeplug/adamw.h on device pointers,
// bitwise the CPU kernels' results (same operations, same roundings, no contraction).
void adamw_step(void* param, const void* grad, DType param_dtype, void* exp_avg,
                void* exp_avg_sq, DType moment_dtype, int64_t n, const AdamWScalars& s,
                StreamHandle stream);
void adamw_step_main(float* main, const uint16_t* grad_bf16, uint16_t* param_bf16,
                     void* exp_avg, void* exp_avg_sq, DType moment_dtype, int64_t n,
                     const AdamWScalars& s, StreamHandle stream);
void stochastic_round_bf16(const float* src, int64_t n, uint32_t step, uint16_t* dst_bf16,
                           StreamHandle stream);

// A cudaEvent_t owned by the runtime (timing disabled: it only orders work).
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  EventHandle handle() const { return handle_; }
  void record(StreamHandle stream);  // any stream, e.g. torch's current one
  void synchronize();
  bool query();

 private:
  EventHandle handle_ = 0;
};

// A non-blocking cudaStream_t owned by the runtime; torch can run on it through
// torch.cuda.ExternalStream(stream.handle()).
class Stream {
 public:
  explicit Stream(int priority = 0);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  StreamHandle handle() const { return handle_; }
  std::shared_ptr<Event> record();
  void wait(const Event& event);
  // Orders this stream after everything queued so far on `other` (e.g. torch's current stream).
  void wait_stream(StreamHandle other);
  void synchronize();

 private:
  StreamHandle handle_ = 0;
};

// Capture once, replay every step: a CUDA graph owned by the runtime. Work queued on a stream
// between begin_capture and end_capture (torch ops on torch.cuda.ExternalStream(handle) too)
// is recorded, not run; replay launches the whole recording with one call. Capture mode is
// thread-local (cudaStreamCaptureModeThreadLocal): other threads' CUDA calls are not captured
// and not refused. Every address the recording touches must stay valid and fixed while the
// graph lives: that is what StaticBuffer (e.g. the stash pool's pages) is for.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void begin_capture(StreamHandle stream);
  void end_capture();  // instantiates the executable graph
  void replay(StreamHandle stream);
  void reset();  // drops the recording; begin_capture may start a new one
  bool captured() const { return exec_ != 0; }
  bool capturing() const { return capturing_ != 0; }
  std::int64_t num_nodes() const { return num_nodes_; }
  std::int64_t replays() const { return replays_; }

 private:
  std::uintptr_t graph_ = 0;      // cudaGraph_t
  std::uintptr_t exec_ = 0;       // cudaGraphExec_t
  StreamHandle capturing_ = 0;    // the stream being captured (0: none)
  std::int64_t num_nodes_ = 0;
  std::int64_t replays_ = 0;
};

// Device memory the runtime owns at a fixed address for the life of the object (cudaMalloc
// once): the static memory a captured graph reads and writes every replay.
class StaticBuffer {
 public:
  explicit StaticBuffer(std::size_t bytes);
  ~StaticBuffer();
  StaticBuffer(const StaticBuffer&) = delete;
  StaticBuffer& operator=(const StaticBuffer&) = delete;
  std::uintptr_t data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::uintptr_t data_ = 0;
  std::size_t bytes_ = 0;
};

// The CUDA runtime's version and the number of visible devices (0 when none or no driver).
int runtime_version();
int device_count();

}  // namespace moeplug::cuda
