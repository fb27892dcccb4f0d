// The fused router on CUDA: moeplug/route.h's math (scores, expert bias, group-limited top-k,
// weights, aux statistics) and its backward, one thread per token with the token's scores in
// registers/local memory (E <= kMaxRouteExperts). Ties go to the lower expert id, as on the CPU.
// The aux statistics are summed with atomicAdd, so unlike the CPU kernel their float sums are
// not bitwise reproducible run to run (counts are exact).
#include <cmath>

#include "common.cuh"
#include "moeplug/route.h"

namespace moeplug::cuda {

namespace {

constexpr float kNormEps = 1e-20f;
constexpr float kSoftplusLimit = 20.0f;

struct Spec {
  int E, K, score, G, group_topk, members, aux;
  bool renormalize;
  float scaling;
  int64_t T, S;
};

__device__ void scores(const float* z, const Spec& p, float* s) {
  if (p.score == 1) {
    for (int e = 0; e < p.E; ++e) s[e] = 1.0f / (1.0f + expf(-z[e]));
  } else if (p.score == 2) {
    for (int e = 0; e < p.E; ++e) s[e] = sqrtf(z[e] > kSoftplusLimit ? z[e] : log1pf(expf(z[e])));
  } else {
    float m = -INFINITY, sum = 0.0f;
    for (int e = 0; e < p.E; ++e) m = fmaxf(m, z[e]);
    for (int e = 0; e < p.E; ++e) sum += (s[e] = expf(z[e] - m));
    for (int e = 0; e < p.E; ++e) s[e] /= sum;
  }
}

// Descending insertion of (v, id) into the n best of at most cap (see route.cpp's offer).
__device__ void offer(float v, int id, int cap, float* vals, int* ids, int& n) {
  if (n == cap && !(v > vals[n - 1])) return;
  int pos = n < cap ? n : cap - 1;
  while (pos > 0 && v > vals[pos - 1]) {
    vals[pos] = vals[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  vals[pos] = v;
  ids[pos] = id;
  if (n < cap) ++n;
}

__device__ void select(const float* sel, const Spec& p, float* vals, int* ids) {
  int n = 0;
  if (p.G <= 1) {
    for (int e = 0; e < p.E; ++e) offer(sel[e], e, p.K, vals, ids, n);
    return;
  }
  const int N = p.E / p.G;
  float gvals[kMaxRouteExperts];
  int gids[kMaxRouteExperts];
  float mvals[kMaxRouteExperts];
  int mids[kMaxRouteExperts];
  int ng = 0;
  for (int g = 0; g < p.G; ++g) {
    int nm = 0;
    for (int j = 0; j < N; ++j) offer(sel[g * N + j], j, p.members, mvals, mids, nm);
    float score = 0.0f;
    for (int j = 0; j < nm; ++j) score += mvals[j];
    offer(score, g, p.group_topk, gvals, gids, ng);
  }
  for (int i = 1; i < ng; ++i) {  // ascending group ids: ties still go to the lower expert id
    for (int j = i; j > 0 && gids[j] < gids[j - 1]; --j) {
      const int t = gids[j];
      gids[j] = gids[j - 1];
      gids[j - 1] = t;
    }
  }
  for (int i = 0; i < ng; ++i) {
    for (int j = 0; j < N; ++j) offer(sel[gids[i] * N + j], gids[i] * N + j, p.K, vals, ids, n);
  }
}

__global__ void route_forward_kernel(const float* logits_TE, const float* bias_E, Spec p,
                                     float* probs_TK, int64_t* ids_TK, float* aux_mean_BE,
                                     unsigned long long* counts_BE) {
  float z[kMaxRouteExperts], s[kMaxRouteExperts], sel[kMaxRouteExperts];
  float vals[kMaxRouteExperts];
  int ids[kMaxRouteExperts];
  const bool post = p.score == 0 && p.renormalize;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < p.T;
       t += int64_t(gridDim.x) * blockDim.x) {
    for (int e = 0; e < p.E; ++e) z[e] = logits_TE[t * p.E + e];
    scores(z, p, s);
    for (int e = 0; e < p.E; ++e) sel[e] = post ? z[e] : s[e] + (bias_E ? bias_E[e] : 0.0f);
    select(sel, p, vals, ids);
    float* pr = probs_TK + t * p.K;
    float sum = 0.0f;
    for (int k = 0; k < p.K; ++k) {
      ids_TK[t * p.K + k] = ids[k];
      sum += (pr[k] = post ? expf(vals[k] - vals[0]) : s[ids[k]]);
    }
    const bool divide = post || (p.score != 0 && p.renormalize && p.K > 1);
    for (int k = 0; k < p.K; ++k) pr[k] = (divide ? pr[k] / (sum + (post ? 0.0f : kNormEps)) : pr[k]) * p.scaling;
    if (!p.aux) continue;
    float ssum = 0.0f;
    for (int e = 0; e < p.E; ++e) ssum += s[e];
    const float zs = p.score == 0 ? 1.0f : ssum + kNormEps;
    const int64_t b = t / p.S;
    int n = 0;
    for (int e = 0; e < p.E; ++e) {
      const float a = s[e] / zs;
      atomicAdd(aux_mean_BE + b * p.E + e, a / float(p.S));
      if (p.aux == 1) offer(a, e, p.K, vals, ids, n);
    }
    if (p.aux == 2) {
      for (int k = 0; k < p.K; ++k) ids[k] = int(ids_TK[t * p.K + k]);
    }
    for (int k = 0; k < p.K; ++k) atomicAdd(counts_BE + b * p.E + ids[k], 1ull);
  }
}

__global__ void route_backward_kernel(const float* logits_TE, const int64_t* ids_TK,
                                      const float* gp_TK, const float* gaux_BE, Spec p,
                                      float* dz_TE) {
  float z[kMaxRouteExperts], s[kMaxRouteExperts], ds[kMaxRouteExperts];
  const bool post = p.score == 0 && p.renormalize;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < p.T;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t* ids = ids_TK + t * p.K;
    float* dz = dz_TE + t * p.E;
    for (int e = 0; e < p.E; ++e) {
      z[e] = logits_TE[t * p.E + e];
      dz[e] = 0.0f;
      ds[e] = 0.0f;
    }
    scores(z, p, s);
    if (gp_TK) {
      const float* gp = gp_TK + t * p.K;
      if (post) {
        float sum = 0.0f, dot = 0.0f;
        for (int k = 0; k < p.K; ++k) sum += expf(z[ids[k]] - z[ids[0]]);
        for (int k = 0; k < p.K; ++k) dot += gp[k] * p.scaling * expf(z[ids[k]] - z[ids[0]]) / sum;
        for (int k = 0; k < p.K; ++k) {
          const float pk = expf(z[ids[k]] - z[ids[0]]) / sum;
          dz[ids[k]] += pk * (gp[k] * p.scaling - dot);
        }
      } else if (p.score != 0 && p.renormalize && p.K > 1) {
        float sum = 0.0f, dot = 0.0f;
        for (int k = 0; k < p.K; ++k) sum += s[ids[k]];
        const float Z = sum + kNormEps;
        for (int k = 0; k < p.K; ++k) dot += gp[k] * (s[ids[k]] / Z);
        for (int k = 0; k < p.K; ++k) ds[ids[k]] += p.scaling * (gp[k] - dot) / Z;
      } else {
        for (int k = 0; k < p.K; ++k) ds[ids[k]] += p.scaling * gp[k];
      }
    }
    if (gaux_BE) {
      const float* ga = gaux_BE + (t / p.S) * p.E;
      if (p.score == 0) {
        for (int e = 0; e < p.E; ++e) ds[e] += ga[e] / float(p.S);
      } else {
        float sum = 0.0f, dot = 0.0f;
        for (int e = 0; e < p.E; ++e) sum += s[e];
        const float Zs = sum + kNormEps;
        for (int e = 0; e < p.E; ++e) dot += ga[e] / float(p.S) * (s[e] / Zs);
        for (int e = 0; e < p.E; ++e) ds[e] += (ga[e] / float(p.S) - dot) / Zs;
      }
    }
    if (p.score == 0) {
      float dot = 0.0f;
      for (int e = 0; e < p.E; ++e) dot += ds[e] * s[e];
      for (int e = 0; e < p.E; ++e) dz[e] += s[e] * (ds[e] - dot);
    } else if (p.score == 1) {
      for (int e = 0; e < p.E; ++e) dz[e] += ds[e] * s[e] * (1.0f - s[e]);
    } else {
      for (int e = 0; e < p.E; ++e) {
        const float sig = z[e] > kSoftplusLimit ? 1.0f : 1.0f / (1.0f + expf(-z[e]));
        if (ds[e] != 0.0f) dz[e] += ds[e] * sig / (2.0f * s[e]);
      }
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

constexpr int kRouteThreads = 64;  // each thread holds several KiB of per-token scores

}  // namespace

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
  route_forward_kernel<<<grid_for(p.T, kRouteThreads), kRouteThreads, 0, as_stream(stream)>>>(
      logits_TE, bias_E, p, probs_TK, ids_TK, aux_mean_BE,
      reinterpret_cast<unsigned long long*>(counts_BE));
  check_launch("cuda route_forward");
}

void route_backward(const float* logits_TE, const int64_t* ids_TK, const float* grad_probs_TK,
                    const float* grad_aux_mean_BE, const RouteSpec& spec, float* grad_logits_TE,
                    StreamHandle stream) {
  const Spec p = device_spec(spec, "cuda route_backward");
  if (p.T == 0) return;
  route_backward_kernel<<<grid_for(p.T, kRouteThreads), kRouteThreads, 0, as_stream(stream)>>>(
      logits_TE, ids_TK, grad_probs_TK, grad_aux_mean_BE, p, grad_logits_TE);
  check_launch("cuda route_backward");
}

}  // namespace moeplug::cuda
