// Fused top-k routing: score function, top-k and normalisation in one pass, one thread per token.
// E <= 256 scores fit a thread's local array; K passes of an argmax pick the experts (ties go
// to the lower expert id). Simple rather than fast: a correct baseline for warp-level versions.
#include "common.cuh"

namespace moeplug::cuda {

namespace {

constexpr float kNormEps = 1e-20f;  // moeplug.routing.scores.NORM_EPS

template <class T>
__global__ void topk_route_kernel(const T* logits_TE, const float* bias_E, int64_t T_, int E,
                                  int K, ScoreFunction score, bool renormalize, float scaling,
                                  float* probs_TK, int64_t* ids_TK) {
  float s[kMaxRouteExperts];    // the scores that become probs
  float sel[kMaxRouteExperts];  // the scores that choose (s + bias), -inf once chosen
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < T_;
       t += int64_t(gridDim.x) * blockDim.x) {
    float zmax = -INFINITY;
    for (int e = 0; e < E; ++e) {
      s[e] = load(logits_TE, t * E + e);
      zmax = fmaxf(zmax, s[e]);
    }
    const bool softmax_all = score == ScoreFunction::kSoftmax && !renormalize;
    if (softmax_all) {
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) sum += (s[e] = expf(s[e] - zmax));
      for (int e = 0; e < E; ++e) s[e] /= sum;
    } else if (score == ScoreFunction::kSigmoid) {
      for (int e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + expf(-s[e]));
    }
    for (int e = 0; e < E; ++e) sel[e] = s[e] + (bias_E ? bias_E[e] : 0.0f);
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {
      int best = 0;
      for (int e = 1; e < E; ++e) best = sel[e] > sel[best] ? e : best;
      sel[best] = -INFINITY;
      ids_TK[t * K + k] = best;
      probs_TK[t * K + k] = s[best];
      sum += s[best];
    }
    float* p = probs_TK + t * K;
    if (score == ScoreFunction::kSoftmax && renormalize) {
      // softmax over the K chosen logits; p[0] is their max (chosen in descending order). Read
      // it once: the loop overwrites p[0] first (reading p[0] inside it was a bug, seen on an
      // H200 as every renormalised prob wrong while the ids were right).
      const float zk = p[0];
      float denom = 0.0f;
      for (int k = 0; k < K; ++k) denom += (p[k] = expf(p[k] - zk));
      for (int k = 0; k < K; ++k) p[k] /= denom;
    } else if (score == ScoreFunction::kSigmoid && renormalize && K > 1) {
      for (int k = 0; k < K; ++k) p[k] /= sum + kNormEps;
    }
    for (int k = 0; k < K; ++k) p[k] *= scaling;
  }
}

}  // namespace

// ---- Host launchers from here on; tests/simt_emu.h runs the kernels above on the CPU. ----
void topk_route(const void* logits_TE, const float* bias_E, int64_t T, int64_t E, int64_t K,
                ScoreFunction score, bool renormalize, float scaling_factor, DType dtype,
                float* probs_TK, int64_t* ids_TK, StreamHandle stream) {
  if (T < 0 || E < 1 || E > kMaxRouteExperts || K < 1 || K > E) {
    throw std::invalid_argument(
        "cuda topk_route: expected num_tokens >= 0, 1 <= num_experts <= " +
        std::to_string(kMaxRouteExperts) + ", 1 <= top_k <= num_experts; got num_tokens=" +
        std::to_string(T) + ", num_experts=" + std::to_string(E) + ", top_k=" + std::to_string(K));
  }
  if (score != ScoreFunction::kSoftmax && score != ScoreFunction::kSigmoid) {
    throw std::invalid_argument("cuda topk_route: score code " + std::to_string(int(score)) +
                                " is unknown; expected 0 (softmax) or 1 (sigmoid)");
  }
  if (bias_E && score == ScoreFunction::kSoftmax) {
    throw std::invalid_argument("cuda topk_route: an expert bias needs score=sigmoid");
  }
  if (T == 0) return;
  constexpr int kRouteThreads = 128;  // fewer threads per block: each holds 2 KiB of scores
  dispatch_dtype(dtype, [&](auto tag) {
    using El = decltype(tag);
    topk_route_kernel<El><<<grid_for(T, kRouteThreads), kRouteThreads, 0, as_stream(stream)>>>(
        static_cast<const El*>(logits_TE), bias_E, T, int(E), int(K), score, renormalize,
        scaling_factor, probs_TK, ids_TK);
  });
  check_launch("cuda topk_route");
}

}  // namespace moeplug::cuda
