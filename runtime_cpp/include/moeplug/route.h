// Fused top-k routing after the gate GEMM: scores, expert bias, group-limited top-k, the routing
// weights and the aux-loss statistics in one pass over each token's logits, and the matching
// backward. The math is moeplug.routing.scores.topk_routing plus the inputs of
// moeplug.routing.aux_losses (the Python reference these kernels are tested against).
//
// Shape legend: T tokens, E experts, K top-k, G expert groups, B sequences (T = B * S, b-major).
//
//   score        softmax | sigmoid | sqrtsoftplus (s = sqrt(softplus(z)))
//   selection    post-softmax (softmax, renormalize): the logits z; pre-softmax: softmax(z);
//                sigmoid / sqrtsoftplus: s + bias (the bias steers the choice only)
//   groups       with G > 1, only the group_topk groups whose best `group_members` selection
//                scores sum highest stay eligible
//   probs        post-softmax: softmax over the K chosen logits; otherwise the chosen s,
//                divided by (their sum + 1e-20) when renormalize and K > 1; then * scaling
//   aux          a = softmax(z) (softmax) or s / (sum_E s + 1e-20); aux_mean_BE[b] = the mean
//                of a over sequence b's tokens (differentiable); counts_BE[b, e] = how many of
//                sequence b's choices named e: the plain top-k of a (Megatron's default) or the
//                routed ids
// Ties between equal scores go to the lower expert id. Logits, probs and aux are fp32.
#pragma once

#include <cstdint>

namespace moeplug {

enum class ScoreFunction : int { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };
// Which choices aux counts_BE counts.
enum class AuxCounts : int { kNone = 0, kPlainTopk = 1, kRouted = 2 };

struct RouteSpec {
  int64_t num_tokens = 0;     // T
  int64_t num_experts = 0;    // E
  int64_t top_k = 0;          // K
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool renormalize = true;
  int64_t num_groups = 0;     // G; 0 or 1: no group limit
  int64_t group_topk = 0;     // groups kept
  int64_t group_members = 0;  // best scores summed per group
  float scaling = 1.0f;
  AuxCounts aux_counts = AuxCounts::kNone;  // kNone: no aux statistics at all
  int64_t num_sequences = 1;  // B; must divide T when aux statistics are wanted
};

// Throws std::invalid_argument naming the field when the spec is inconsistent.
void check_route_spec(const RouteSpec& spec, const char* op);

// bias_E may be null (only with sigmoid / sqrtsoftplus). aux_mean_BE and counts_BE are written
// only when spec.aux_counts != kNone.
void route_forward(const float* logits_TE, const float* bias_E, const RouteSpec& spec,
                   float* probs_TK, int64_t* ids_TK, float* aux_mean_BE, int64_t* counts_BE);

// grad_logits_TE = d(probs_TK)/d(logits)^T grad_probs_TK + d(aux_mean_BE)/d(logits)^T
// grad_aux_mean_BE; either gradient may be null (it contributes nothing).
void route_backward(const float* logits_TE, const int64_t* ids_TK, const float* grad_probs_TK,
                    const float* grad_aux_mean_BE, const RouteSpec& spec, float* grad_logits_TE);

}  // namespace moeplug
