// The fused router on CUDA: moeplug/route.h's math (scores, expert bias, group-limited top-k,
// weights, aux statistics) and its backward, one warp per token. Lane l holds experts l, l+32,
// ... (E <= kMaxRouteExperts = 32 * kPerLane) in registers, so a token's logits are read and
// its logit grads written in coalesced 128-byte rows, and every reduction over the experts
// (softmax max and sum, the top-k argmax) is a warp shuffle. The first version gave each token
// a thread with [E]-float arrays in local memory and read logits E floats apart: correct, but
// 1.43 ms a call at 16384 x 128 on an H200, slower than torch's topk path (docs/GPU.md).
//
// Ties go to the lower expert id, as on the CPU; a NaN score ranks as -inf (never above a
// number), so the ids stay valid. Sums over the experts are warp trees, so probs and grads
// differ from the CPU kernel's in the last bits (the tests hold both to the torch math). The
// aux statistics are summed per warp over its run of tokens, then added to the [B, E] totals
// with one atomicAdd per (run, sequence, expert): their float sums are not bitwise
// reproducible run to run (counts are exact).
#include <climits>
#include <cmath>

#include "common.cuh"
#include "moeplug/route.h"

namespace moeplug::cuda {

namespace {

constexpr float kNormEps = 1e-20f;
constexpr float kSoftplusLimit = 20.0f;
constexpr int kLanes = 32;
constexpr int kPerLane = int(kMaxRouteExperts) / kLanes;
static_assert(kMaxRouteExperts % kLanes == 0 && kPerLane <= 32,
              "a lane's experts are one 32-bit mask of chosen ones");
constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 8;           // warps per block
constexpr int kTokensPerWarp = 4;  // a run of tokens per warp: fewer aux atomics
// 3 blocks (24 warps) per SM: <= 85 registers a thread, which both kernels fit without spills
// (-Xptxas -v, sm_90: 80 and 64; with the block size alone ptxas spilled 24 and 8 bytes).
constexpr int kMinBlocks = 3;

struct Spec {
  int E, K, score, G, group_topk, members, aux;
  bool renormalize;
  float scaling;
  int64_t T, S;
};

// What one warp's lanes share while they route a token (K, G <= E <= kMaxRouteExperts).
struct WarpScratch {
  float probs[kMaxRouteExperts];  // the chosen experts' weights before normalisation
  int ids[kMaxRouteExperts];      // and their ids, in choice order
  float sel[kMaxRouteExperts];    // selection scores, for the group sums
  float group[kMaxRouteExperts];  // group scores
  unsigned char kept[kMaxRouteExperts];  // group chosen
};

__device__ __forceinline__ int expert(int lane, int j) { return lane + kLanes * j; }

// Larger first, ties to the lower id; NaN is passed in as -inf (rank()).
__device__ __forceinline__ bool before(float v, int id, float w, int jd) {
  return v > w || (v == w && id < jd);
}
__device__ __forceinline__ float rank(float v) { return isnan(v) ? -INFINITY : v; }

struct Pick {
  float v;
  int id;
};
__device__ __forceinline__ Pick none() { return {-INFINITY, INT_MAX}; }

// The best pick over the warp; every lane gets the same (before() is a total order).
__device__ __forceinline__ Pick warp_best(Pick p) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) {
    const float v = __shfl_xor_sync(kFull, p.v, off);
    const int id = __shfl_xor_sync(kFull, p.id, off);
    if (before(v, id, p.v, p.id)) p = {v, id};
  }
  return p;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

// a[j] for a warp-uniform j, without indexing the register array dynamically.
__device__ __forceinline__ float pick(const float (&a)[kPerLane], int j) {
  float v = a[0];
#pragma unroll
  for (int i = 1; i < kPerLane; ++i) v = i == j ? a[i] : v;
  return v;
}

// The value expert e's lane holds in a (e warp-uniform).
__device__ __forceinline__ float of_expert(const float (&a)[kPerLane], int e) {
  return __shfl_sync(kFull, pick(a, e / kLanes), e % kLanes);
}

// a[e] += v on expert e's lane.
// (A select per element: a branch around `a[j] += v` kept the arrays in local memory.)
template <class T>
__device__ __forceinline__ void add_at(T (&a)[kPerLane], int lane, int e, T v) {
  const bool mine = lane == e % kLanes;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) a[j] = mine && j == e / kLanes ? a[j] + v : a[j];
}

// s = score(z) over the lane's experts (z = -inf where e >= E).
__device__ __forceinline__ void scores(const float (&z)[kPerLane], const Spec& p, int lane,
                                       float (&s)[kPerLane]) {
  if (p.score == 1) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) s[j] = 1.0f / (1.0f + expf(-z[j]));
  } else if (p.score == 2) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      s[j] = sqrtf(z[j] > kSoftplusLimit ? z[j] : log1pf(expf(z[j])));
    }
  } else {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) m = fmaxf(m, z[j]);
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      s[j] = expert(lane, j) < p.E ? expf(z[j] - m) : 0.0f;
      sum += s[j];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) s[j] /= sum;
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (expert(lane, j) >= p.E) s[j] = 0.0f;  // padding lanes add nothing to sums
  }
}

// The sum of the best `members` of n values (descending, as the CPU sums them), by one lane.
__device__ float top_sum(const float* v, int n, int members) {
  float score = 0.0f;
  Pick prev = {INFINITY, -1};  // ranks before everything
  for (int m = 0; m < members; ++m) {
    Pick best = none();
    for (int j = 0; j < n; ++j) {
      const float x = rank(v[j]);
      if (before(prev.v, prev.id, x, j) && before(x, j, best.v, best.id)) best = {x, j};
    }
    score += best.v;
    prev = best;
  }
  return score;
}

// Marks the group_topk best groups in w.kept (the whole warp; G groups of E / G experts).
__device__ void choose_groups(const float (&sel)[kPerLane], const Spec& p, int lane,
                              WarpScratch& w) {
  const int N = p.E / p.G;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (expert(lane, j) < p.E) w.sel[expert(lane, j)] = sel[j];
  }
  for (int g = lane; g < p.G; g += kLanes) w.kept[g] = 0;
  __syncwarp();
  for (int g = lane; g < p.G; g += kLanes) w.group[g] = top_sum(w.sel + g * N, N, p.members);
  __syncwarp();
  for (int r = 0; r < p.group_topk; ++r) {
    Pick best = none();
    for (int g = lane; g < p.G; g += kLanes) {
      const float x = rank(w.group[g]);
      if (!w.kept[g] && before(x, g, best.v, best.id)) best = {x, g};
    }
    best = warp_best(best);
    if (lane == 0) w.kept[best.id] = 1;
    __syncwarp();
  }
}

// The K best (v, id) of the lane's experts, in order, into w.ids and w.probs (lane 0 writes
// them; read after the closing __syncwarp); only experts whose group is kept when `kept` is set
// (groups of N). Returns the first one's value.
__device__ float warp_topk(const float (&v)[kPerLane], const Spec& p, int lane,
                           const unsigned char* kept, int N, WarpScratch& w) {
  unsigned taken = 0;
  float first = 0.0f;
  for (int k = 0; k < p.K; ++k) {
    Pick best = none();
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = expert(lane, j);
      const bool ok = e < p.E && !(taken >> j & 1u) && (!kept || kept[e / N]);
      if (ok && before(rank(v[j]), e, best.v, best.id)) best = {rank(v[j]), e};
    }
    best = warp_best(best);
    if (lane == best.id % kLanes) taken |= 1u << (best.id / kLanes);
    if (lane == 0) {
      w.ids[k] = best.id;
      w.probs[k] = best.v;
    }
    if (k == 0) first = best.v;
  }
  __syncwarp();
  return first;
}

// Adds a run's aux sums and counts for sequence b to the totals, and zeroes them.
__device__ __forceinline__ void flush(float (&acc)[kPerLane], unsigned (&cnt)[kPerLane],
                                      const Spec& p, int lane, int64_t b, float* aux_mean_BE,
                                      unsigned long long* counts_BE) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = expert(lane, j);
    if (e < p.E) {
      if (acc[j] != 0.0f) atomicAdd(aux_mean_BE + b * p.E + e, acc[j]);
      if (cnt[j]) atomicAdd(counts_BE + b * p.E + e, (unsigned long long)cnt[j]);
    }
    acc[j] = 0.0f;
    cnt[j] = 0;
  }
}

__global__ void __launch_bounds__(kWarps * kLanes, kMinBlocks)
    route_forward_kernel(const float* logits_TE, const float* bias_E, Spec p, float* probs_TK,
                         int64_t* ids_TK, float* aux_mean_BE, unsigned long long* counts_BE) {
  __shared__ WarpScratch scratch[kWarps];
  const int lane = threadIdx.x % kLanes;
  WarpScratch& w = scratch[threadIdx.x / kLanes];
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const int64_t run = (p.T + warps - 1) / warps;
  const int64_t t0 = (int64_t(blockIdx.x) * kWarps + threadIdx.x / kLanes) * run;
  const int64_t t1 = t0 + run < p.T ? t0 + run : p.T;
  const bool post = p.score == 0 && p.renormalize;
  const bool grouped = p.G > 1;
  float acc[kPerLane] = {};         // this run's sum of a / S for the current sequence
  unsigned cnt[kPerLane] = {};
  int64_t b_run = t0 < t1 ? t0 / p.S : 0;
  for (int64_t t = t0; t < t1; ++t) {
    float z[kPerLane], s[kPerLane], sel[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = expert(lane, j);
      z[j] = e < p.E ? logits_TE[t * p.E + e] : -INFINITY;
    }
    scores(z, p, lane, s);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = expert(lane, j);
      sel[j] = post ? z[j] : s[j] + (bias_E && e < p.E ? bias_E[e] : 0.0f);
    }
    if (grouped) choose_groups(sel, p, lane, w);
    const float first = grouped ? warp_topk(sel, p, lane, w.kept, p.E / p.G, w)
                                : warp_topk(sel, p, lane, nullptr, 1, w);
    if (!post) {  // the weight is the chosen expert's score, not its selection score
      for (int k = 0; k < p.K; ++k) {
        const float sk = of_expert(s, w.ids[k]);
        if (lane == 0) w.probs[k] = sk;
      }
    } else if (lane == 0) {
      for (int k = 0; k < p.K; ++k) w.probs[k] = expf(w.probs[k] - first);
    }
    __syncwarp();
    float sum = 0.0f;  // in choice order, as the CPU sums them
    for (int k = 0; k < p.K; ++k) sum += w.probs[k];
    const bool divide = post || (p.score != 0 && p.renormalize && p.K > 1);
    const float denom = sum + (post ? 0.0f : kNormEps);
    for (int k = lane; k < p.K; k += kLanes) {
      ids_TK[t * p.K + k] = w.ids[k];
      probs_TK[t * p.K + k] = (divide ? w.probs[k] / denom : w.probs[k]) * p.scaling;
    }
    if (p.aux) {
      const int64_t b = t / p.S;
      if (b != b_run) {
        flush(acc, cnt, p, lane, b_run, aux_mean_BE, counts_BE);
        b_run = b;
      }
      float ssum = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) ssum += s[j];
      const float zs = p.score == 0 ? 1.0f : warp_sum(ssum) + kNormEps;
      float a[kPerLane];
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        a[j] = s[j] / zs;
        acc[j] += a[j] / float(p.S);
      }
      if (p.aux == 1) {  // count the plain top-k of a instead of the routed ids
        __syncwarp();    // every lane has stored this token's ids from w.ids
        warp_topk(a, p, lane, nullptr, 1, w);
      }
      for (int k = 0; k < p.K; ++k) add_at(cnt, lane, w.ids[k], 1u);
    }
    __syncwarp();  // the next token rewrites w
  }
  if (p.aux && t0 < t1) flush(acc, cnt, p, lane, b_run, aux_mean_BE, counts_BE);
}

__global__ void __launch_bounds__(kWarps * kLanes, kMinBlocks)
    route_backward_kernel(const float* logits_TE, const int64_t* ids_TK, const float* gp_TK,
                          const float* gaux_BE, Spec p, float* dz_TE) {
  const int lane = threadIdx.x % kLanes;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + threadIdx.x / kLanes;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const bool post = p.score == 0 && p.renormalize;
  for (int64_t t = warp; t < p.T; t += warps) {
    float z[kPerLane], s[kPerLane], ds[kPerLane] = {}, dz[kPerLane] = {};
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = expert(lane, j);
      z[j] = e < p.E ? logits_TE[t * p.E + e] : -INFINITY;
    }
    scores(z, p, lane, s);
    const int64_t* ids = ids_TK + t * p.K;
    if (gp_TK) {
      const float* gp = gp_TK + t * p.K;
      if (post) {
        const float z0 = of_expert(z, int(ids[0]));
        float sum = 0.0f, dot = 0.0f;
        for (int k = 0; k < p.K; ++k) sum += expf(of_expert(z, int(ids[k])) - z0);
        for (int k = 0; k < p.K; ++k) {
          dot += gp[k] * p.scaling * expf(of_expert(z, int(ids[k])) - z0) / sum;
        }
        for (int k = 0; k < p.K; ++k) {
          const float pk = expf(of_expert(z, int(ids[k])) - z0) / sum;
          add_at(dz, lane, int(ids[k]), pk * (gp[k] * p.scaling - dot));
        }
      } else if (p.score != 0 && p.renormalize && p.K > 1) {
        float sum = 0.0f, dot = 0.0f;
        for (int k = 0; k < p.K; ++k) sum += of_expert(s, int(ids[k]));
        const float Z = sum + kNormEps;
        for (int k = 0; k < p.K; ++k) dot += gp[k] * (of_expert(s, int(ids[k])) / Z);
        for (int k = 0; k < p.K; ++k) {
          add_at(ds, lane, int(ids[k]), p.scaling * (gp[k] - dot) / Z);
        }
      } else {
        for (int k = 0; k < p.K; ++k) add_at(ds, lane, int(ids[k]), p.scaling * gp[k]);
      }
    }
    if (gaux_BE) {
      const float* ga = gaux_BE + (t / p.S) * p.E;
      float g[kPerLane];
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        g[j] = expert(lane, j) < p.E ? ga[expert(lane, j)] / float(p.S) : 0.0f;
      }
      if (p.score == 0) {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) ds[j] += g[j];
      } else {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) sum += s[j];
        const float Zs = warp_sum(sum) + kNormEps;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) dot += g[j] * (s[j] / Zs);
        dot = warp_sum(dot);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) ds[j] += (g[j] - dot) / Zs;
      }
    }
    if (p.score == 0) {
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dot += ds[j] * s[j];
      dot = warp_sum(dot);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dz[j] += s[j] * (ds[j] - dot);
    } else if (p.score == 1) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dz[j] += ds[j] * s[j] * (1.0f - s[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const float sig = z[j] > kSoftplusLimit ? 1.0f : 1.0f / (1.0f + expf(-z[j]));
        if (ds[j] != 0.0f) dz[j] += ds[j] * sig / (2.0f * s[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = expert(lane, j);
      if (e < p.E) dz_TE[t * p.E + e] = dz[j];
    }
  }
}

Spec device_spec(const RouteSpec& r, const char* op) {
  check_route_spec(r, op);
  if (r.num_experts > kMaxRouteExperts) {
    throw std::invalid_argument(std::string(op) + ": num_experts <= " +
                                std::to_string(kMaxRouteExperts) + " on CUDA; got num_experts=" +
                                std::to_string(r.num_experts));
  }
  Spec p;
  p.E = int(r.num_experts);
  p.K = int(r.top_k);
  p.score = int(r.score);
  p.G = int(r.num_groups);
  p.group_topk = int(r.group_topk);
  p.members = int(r.group_members);
  p.aux = int(r.aux_counts);
  p.renormalize = r.renormalize;
  p.scaling = r.scaling;
  p.T = r.num_tokens;
  p.S = r.num_tokens / r.num_sequences;
  return p;
}

}  // namespace

// ---- Host launchers from here on; tests/simt_emu.h runs the kernels above on the CPU. ----
void route_forward(const float* logits_TE, const float* bias_E, const RouteSpec& spec,
                   float* probs_TK, int64_t* ids_TK, float* aux_mean_BE, int64_t* counts_BE,
                   StreamHandle stream) {
  const Spec p = device_spec(spec, "cuda route_forward");
  if (spec.aux_counts != AuxCounts::kNone) {  // the kernel accumulates into them
    const size_t n = size_t(spec.num_sequences * spec.num_experts);
    check(cudaMemsetAsync(aux_mean_BE, 0, n * sizeof(float), as_stream(stream)), "memset aux");
    check(cudaMemsetAsync(counts_BE, 0, n * sizeof(int64_t), as_stream(stream)), "memset counts");
  }
  if (p.T == 0) return;
  route_forward_kernel<<<grid_for(p.T, kWarps * kTokensPerWarp), kWarps * kLanes, 0,
                         as_stream(stream)>>>(
      logits_TE, bias_E, p, probs_TK, ids_TK, aux_mean_BE,
      reinterpret_cast<unsigned long long*>(counts_BE));
  check_launch("cuda route_forward");
}

void route_backward(const float* logits_TE, const int64_t* ids_TK, const float* grad_probs_TK,
                    const float* grad_aux_mean_BE, const RouteSpec& spec, float* grad_logits_TE,
                    StreamHandle stream) {
  const Spec p = device_spec(spec, "cuda route_backward");
  if (p.T == 0) return;
  route_backward_kernel<<<grid_for(p.T, kWarps), kWarps * kLanes, 0, as_stream(stream)>>>(
      logits_TE, ids_TK, grad_probs_TK, grad_aux_mean_BE, p, grad_logits_TE);
  check_launch("cuda route_backward");
}

}  // namespace moeplug::cuda
