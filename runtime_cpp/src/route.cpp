// Fused top-k routing forward/backward (see route.h for the math), parallel over fixed token
// chunks so that the aux statistics are reduced in the same order on every run.
//
// Shape legend: T tokens, E experts, K top-k, G groups, N = E / G experts per group,
// B sequences, C token chunks.
#include "moeplug/route.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "moeplug/fastmath.h"
#include "moeplug/thread_pool.h"
#include "route_topk.h"

namespace moeplug {

namespace {

using route_topk::offer;
using route_topk::top_sum;
using route_topk::topk;

constexpr float kNormEps = 1e-20f;      // moeplug.routing.scores.NORM_EPS
constexpr float kSoftplusLimit = 20.0f;  // torch's softplus threshold: softplus(z) = z above it
constexpr int64_t kTokenGrain = 64;

bool post_softmax(const RouteSpec& s) {
  return s.score == ScoreFunction::kSoftmax && s.renormalize;
}

// s = score(z) over one token's E logits. Softmax also when only the aux scores need it.
MOEPLUG_INLINE void scores(const float* __restrict z, int64_t E, ScoreFunction fn,
                           float* __restrict s) {
  if (fn == ScoreFunction::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + exp_approx(-z[e]));
  } else if (fn == ScoreFunction::kSqrtSoftplus) {
    for (int64_t e = 0; e < E; ++e) {
      const float sp = z[e] > kSoftplusLimit ? z[e] : std::log1p(std::exp(z[e]));
      s[e] = std::sqrt(sp);
    }
  } else {
    float zmax = -INFINITY;
    for (int64_t e = 0; e < E; ++e) zmax = std::max(zmax, z[e]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t e = 0; e < E; ++e) sum += (s[e] = exp_approx(z[e] - zmax));
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; ++e) s[e] *= inv;
  }
}

// The aux-loss distribution a from s: softmax already is one; others are normalised.
MOEPLUG_INLINE void aux_dist(const float* __restrict s, int64_t E, ScoreFunction fn,
                             float* __restrict a) {
  if (fn == ScoreFunction::kSoftmax) {
    for (int64_t e = 0; e < E; ++e) a[e] = s[e];
    return;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < E; ++e) sum += s[e];
  const float z = sum + kNormEps;
  for (int64_t e = 0; e < E; ++e) a[e] = s[e] / z;
}

// Top-K of sel over all E, or over the kept groups only. vals/ids get K entries, descending.
// gsel (E floats) holds the kept groups' scores side by side, in ascending expert order.
MOEPLUG_INLINE void select(const float* sel, const RouteSpec& sp, float* vals, int64_t* ids,
                           float* gvals, int64_t* gids, float* mvals, int64_t* mids,
                           float* gsel) {
  const int64_t E = sp.num_experts, K = sp.top_k;
  int64_t n = 0;
  if (sp.num_groups <= 1) {
    topk(sel, E, K, 0, vals, ids, n);
    return;
  }
  const int64_t G = sp.num_groups, N = E / G, M = sp.group_members;
  int64_t ng = 0;
  for (int64_t g = 0; g < G; ++g) {
    offer(top_sum(sel + g * N, N, M, mvals, mids), g, sp.group_topk, gvals, gids, ng);
  }
  std::sort(gids, gids + ng);  // ascending expert ids, so ties still go to the lower id
  for (int64_t i = 0; i < ng; ++i) {
    std::copy(sel + gids[i] * N, sel + (gids[i] + 1) * N, gsel + i * N);
  }
  topk(gsel, ng * N, K, 0, vals, ids, n);
  for (int64_t k = 0; k < n; ++k) ids[k] = gids[ids[k] / N] * N + ids[k] % N;
}

// Scratch for one chunk of tokens.
struct Scratch {
  explicit Scratch(const RouteSpec& sp)
      : s(sp.num_experts), sel(sp.num_experts), a(sp.num_experts), grad(sp.num_experts),
        vals(sp.num_experts), ids(sp.num_experts), gvals(std::max<int64_t>(sp.num_groups, 1)),
        gids(std::max<int64_t>(sp.num_groups, 1)), mvals(sp.num_experts),
        mids(sp.num_experts), gsel(sp.num_experts) {}
  std::vector<float> s, sel, a, grad, vals;
  std::vector<int64_t> ids;
  std::vector<float> gvals;
  std::vector<int64_t> gids;
  std::vector<float> mvals;
  std::vector<int64_t> mids;
  std::vector<float> gsel;
};

// always_inline (like everything the per-token loops call): GCC compiles a plain function for
// the default ISA and will not inline it into forward_chunk's AVX-512 / AVX2 clones (dtype.h).
MOEPLUG_INLINE void forward_tokens(const float* logits_TE, const float* bias_E,
                                   const RouteSpec& sp, int64_t t0, int64_t t1, float* probs_TK,
                                   int64_t* ids_TK, double* aux_sum_BE, int64_t* counts_BE) {
  const int64_t E = sp.num_experts, K = sp.top_k;
  const int64_t S = sp.num_tokens / std::max<int64_t>(sp.num_sequences, 1);
  Scratch w(sp);
  float* s = w.s.data();
  float* sel = w.sel.data();
  for (int64_t t = t0; t < t1; ++t) {
    const float* z = logits_TE + t * E;
    const bool need_scores = !post_softmax(sp) || sp.aux_counts != AuxCounts::kNone;
    if (need_scores) scores(z, E, sp.score, s);
    const float* choose = z;  // post-softmax chooses on the logits
    if (!post_softmax(sp)) {
      choose = s;
      if (bias_E) {
        for (int64_t e = 0; e < E; ++e) sel[e] = s[e] + bias_E[e];
        choose = sel;
      }
    }
    float* top = w.vals.data();
    int64_t* ids = ids_TK + t * K;
    select(choose, sp, top, ids, w.gvals.data(), w.gids.data(), w.mvals.data(), w.mids.data(),
           w.gsel.data());
    float* p = probs_TK + t * K;
    if (post_softmax(sp)) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += (p[k] = std::exp(top[k] - top[0]));
      for (int64_t k = 0; k < K; ++k) p[k] /= sum;
    } else {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += (p[k] = s[ids[k]]);
      if (sp.score != ScoreFunction::kSoftmax && sp.renormalize && K > 1) {
        for (int64_t k = 0; k < K; ++k) p[k] /= sum + kNormEps;
      }
    }
    if (sp.scaling != 1.0f) {
      for (int64_t k = 0; k < K; ++k) p[k] *= sp.scaling;
    }
    if (sp.aux_counts == AuxCounts::kNone) continue;
    float* a = w.a.data();
    aux_dist(s, E, sp.score, a);
    const int64_t b = t / S;
    double* acc = aux_sum_BE + b * E;
    for (int64_t e = 0; e < E; ++e) acc[e] += a[e];
    int64_t* counts = counts_BE + b * E;
    if (sp.aux_counts == AuxCounts::kRouted) {
      for (int64_t k = 0; k < K; ++k) ++counts[ids[k]];
    } else {
      int64_t n = 0;
      int64_t* plain = w.ids.data();
      topk(a, E, K, 0, top, plain, n);
      for (int64_t k = 0; k < K; ++k) ++counts[plain[k]];
    }
  }
}

// ds/dz for the element-wise score functions (torch's sigmoid and sqrt(softplus) backward).
MOEPLUG_INLINE float score_grad(float z, float s, ScoreFunction fn) {
  if (fn == ScoreFunction::kSigmoid) return s * (1.0f - s);
  const float sig = z > kSoftplusLimit ? 1.0f : 1.0f / (1.0f + std::exp(-z));
  return sig / (2.0f * s);
}

MOEPLUG_INLINE void backward_tokens(const float* logits_TE, const int64_t* ids_TK,
                                    const float* gp_TK, const float* gaux_BE, const RouteSpec& sp,
                                    int64_t t0, int64_t t1, float* dz_TE) {
  const int64_t E = sp.num_experts, K = sp.top_k;
  const int64_t S = sp.num_tokens / std::max<int64_t>(sp.num_sequences, 1);
  const float inv_S = 1.0f / static_cast<float>(S);
  Scratch w(sp);
  float* s = w.s.data();
  float* ds = w.grad.data();  // d loss / d s (element-wise scores) or d loss / d softmax
  for (int64_t t = t0; t < t1; ++t) {
    const float* z = logits_TE + t * E;
    const int64_t* ids = ids_TK + t * K;
    float* dz = dz_TE + t * E;
    for (int64_t e = 0; e < E; ++e) dz[e] = 0.0f;
    const bool need_scores = !post_softmax(sp) || gaux_BE;
    if (need_scores) scores(z, E, sp.score, s);
    for (int64_t e = 0; e < E; ++e) ds[e] = 0.0f;
    if (gp_TK) {
      const float* gp = gp_TK + t * K;
      if (post_softmax(sp)) {
        // p = softmax(z_chosen) * scaling: dz_k = p_k (g_k - sum_j g_j p_j), g = gp * scaling
        float* p = w.vals.data();
        float sum = 0.0f;
        for (int64_t k = 0; k < K; ++k) sum += (p[k] = std::exp(z[ids[k]] - z[ids[0]]));
        float dot = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          p[k] /= sum;
          dot += gp[k] * sp.scaling * p[k];
        }
        for (int64_t k = 0; k < K; ++k) dz[ids[k]] += p[k] * (gp[k] * sp.scaling - dot);
      } else if (sp.score != ScoreFunction::kSoftmax && sp.renormalize && K > 1) {
        // p_k = scaling * s_k / Z, Z = sum_j s_j + eps: ds_k = scaling / Z (g_k - sum_j g_j r_j)
        float sum = 0.0f;
        for (int64_t k = 0; k < K; ++k) sum += s[ids[k]];
        const float Z = sum + kNormEps;
        float dot = 0.0f;
        for (int64_t k = 0; k < K; ++k) dot += gp[k] * (s[ids[k]] / Z);
        for (int64_t k = 0; k < K; ++k) ds[ids[k]] += sp.scaling * (gp[k] - dot) / Z;
      } else {
        for (int64_t k = 0; k < K; ++k) ds[ids[k]] += sp.scaling * gp[k];
      }
    }
    if (gaux_BE) {
      const float* ga = gaux_BE + (t / S) * E;
      if (sp.score == ScoreFunction::kSoftmax) {
        for (int64_t e = 0; e < E; ++e) ds[e] += ga[e] * inv_S;  // a = s: same softmax
      } else {
        // a = s / Zs: ds_e += (g_e - sum_j g_j a_j) / Zs
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t e = 0; e < E; ++e) sum += s[e];
        const float Zs = sum + kNormEps;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < E; ++e) dot += ga[e] * inv_S * (s[e] / Zs);
        for (int64_t e = 0; e < E; ++e) ds[e] += (ga[e] * inv_S - dot) / Zs;
      }
    }
    if (!need_scores) continue;
    if (sp.score == ScoreFunction::kSoftmax) {
      // softmax backward: dz_e += s_e (ds_e - sum_j ds_j s_j)
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < E; ++e) dot += ds[e] * s[e];
      for (int64_t e = 0; e < E; ++e) dz[e] += s[e] * (ds[e] - dot);
    } else if (sp.score == ScoreFunction::kSigmoid) {
      for (int64_t e = 0; e < E; ++e) dz[e] += ds[e] * s[e] * (1.0f - s[e]);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        if (ds[e] != 0.0f) dz[e] += ds[e] * score_grad(z[e], s[e], sp.score);
      }
    }
  }
}

MOEPLUG_MULTIVERSION void forward_chunk(const float* logits_TE, const float* bias_E,
                                        const RouteSpec& sp, int64_t t0, int64_t t1,
                                        float* probs_TK, int64_t* ids_TK, double* aux_sum_BE,
                                        int64_t* counts_BE) {
  forward_tokens(logits_TE, bias_E, sp, t0, t1, probs_TK, ids_TK, aux_sum_BE, counts_BE);
}

MOEPLUG_MULTIVERSION void backward_chunk(const float* logits_TE, const int64_t* ids_TK,
                                         const float* gp_TK, const float* gaux_BE,
                                         const RouteSpec& sp, int64_t t0, int64_t t1,
                                         float* dz_TE) {
  backward_tokens(logits_TE, ids_TK, gp_TK, gaux_BE, sp, t0, t1, dz_TE);
}

}  // namespace

void check_route_spec(const RouteSpec& sp, const char* op) {
  const std::string name = op;
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  const int64_t T = sp.num_tokens, E = sp.num_experts, K = sp.top_k;
  if (T < 0 || E < 1 || K < 1 || K > E) {
    fail("expected num_tokens >= 0 and 1 <= top_k <= num_experts; got num_tokens=" +
         std::to_string(T) + ", num_experts=" + std::to_string(E) + ", top_k=" +
         std::to_string(K));
  }
  const int score = static_cast<int>(sp.score);
  if (score < 0 || score > 2) {
    fail("score code " + std::to_string(score) + " is unknown; expected 0 (softmax), "
         "1 (sigmoid) or 2 (sqrtsoftplus)");
  }
  if (sp.num_groups > 1) {
    const int64_t G = sp.num_groups;
    if (E % G || sp.group_topk < 1 || sp.group_topk > G || sp.group_members < 1 ||
        sp.group_members > E / G || sp.group_topk * (E / G) < K) {
      fail("group limits do not fit: num_experts=" + std::to_string(E) + ", num_groups=" +
           std::to_string(G) + ", group_topk=" + std::to_string(sp.group_topk) +
           ", group_members=" + std::to_string(sp.group_members) + ", top_k=" +
           std::to_string(K) + "; need num_groups | num_experts, 1 <= group_topk <= num_groups, "
           "1 <= group_members <= num_experts / num_groups and group_topk * (num_experts / "
           "num_groups) >= top_k");
    }
  }
  const int aux = static_cast<int>(sp.aux_counts);
  if (aux < 0 || aux > 2) {
    fail("aux_counts code " + std::to_string(aux) + " is unknown; expected 0 (none), "
         "1 (plain_topk) or 2 (routed)");
  }
  if (sp.num_sequences < 1 || T % sp.num_sequences) {
    fail("num_sequences=" + std::to_string(sp.num_sequences) + " does not split num_tokens=" +
         std::to_string(T) + " into equal sequences");
  }
}

void route_forward(const float* logits_TE, const float* bias_E, const RouteSpec& sp,
                   float* probs_TK, int64_t* ids_TK, float* aux_mean_BE, int64_t* counts_BE) {
  check_route_spec(sp, "route_forward");
  if (bias_E && sp.score == ScoreFunction::kSoftmax) {
    throw std::invalid_argument("route_forward: an expert bias needs score sigmoid or "
                                "sqrtsoftplus (softmax has none)");
  }
  const int64_t T = sp.num_tokens, E = sp.num_experts, B = sp.num_sequences;
  const bool aux = sp.aux_counts != AuxCounts::kNone;
  // Fixed chunks, each with its own partial sums, reduced in chunk order: deterministic.
  const int64_t C = std::max<int64_t>(
      1, std::min<int64_t>(get_num_threads() * 4, (T + kTokenGrain - 1) / kTokenGrain));
  const int64_t chunk = std::max<int64_t>(1, (T + C - 1) / C);
  std::vector<double> sum_CBE(aux ? static_cast<size_t>(C * B * E) : 0, 0.0);
  std::vector<int64_t> counts_CBE(aux ? static_cast<size_t>(C * B * E) : 0, 0);
  parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t t0 = std::min(T, c * chunk), t1 = std::min(T, t0 + chunk);
      forward_chunk(logits_TE, bias_E, sp, t0, t1, probs_TK, ids_TK,
                    aux ? sum_CBE.data() + c * B * E : nullptr,
                    aux ? counts_CBE.data() + c * B * E : nullptr);
    }
  });
  if (!aux) return;
  const double inv_S = T ? static_cast<double>(B) / static_cast<double>(T) : 0.0;
  for (int64_t i = 0; i < B * E; ++i) {
    double sum = 0.0;
    int64_t count = 0;
    for (int64_t c = 0; c < C; ++c) {
      sum += sum_CBE[c * B * E + i];
      count += counts_CBE[c * B * E + i];
    }
    aux_mean_BE[i] = static_cast<float>(sum * inv_S);
    counts_BE[i] = count;
  }
}

void route_backward(const float* logits_TE, const int64_t* ids_TK, const float* grad_probs_TK,
                    const float* grad_aux_mean_BE, const RouteSpec& sp, float* grad_logits_TE) {
  check_route_spec(sp, "route_backward");
  const int64_t T = sp.num_tokens, E = sp.num_experts;
  for (int64_t i = 0; i < T * sp.top_k; ++i) {
    if (ids_TK[i] < 0 || ids_TK[i] >= E) {
      throw std::invalid_argument("route_backward: ids[" + std::to_string(i / sp.top_k) + ", " +
                                  std::to_string(i % sp.top_k) + "] = " +
                                  std::to_string(ids_TK[i]) + " is outside [0, " +
                                  std::to_string(E) + "); pass the ids route_forward returned");
    }
  }
  parallel_for(0, T, kTokenGrain, [&](int64_t t0, int64_t t1) {
    backward_chunk(logits_TE, ids_TK, grad_probs_TK, grad_aux_mean_BE, sp, t0, t1,
                   grad_logits_TE);
  });
}

}  // namespace moeplug
