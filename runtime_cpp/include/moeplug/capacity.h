// Token dropping over expert capacity (Megatron moe_expert_capacity_factor), without allocating.
//
// Shape legend: T tokens, K top-k, E experts.
#pragma once

#include <cstdint>

namespace moeplug {

// Each expert keeps at most `capacity` of the choices routed to it; dropped_TK[t, k] = 1 for the
// others, 0 for the kept ones. by_probs: keep the largest probs_TK (ties and NaNs as a stable
// descending sort orders them: NaN first, then earlier token first); else keep the earliest
// tokens (probs_TK unused, may be null). scratch_N holds T*K + E + 1 int64 (the caller's, so the
// MoE path allocates nothing). Each token's K ids must be distinct, as a top-k gives them.
// Throws std::invalid_argument naming the first id outside [0, E).
void drop_over_capacity(const float* probs_TK, const int64_t* ids_TK, int64_t T, int64_t K,
                        int64_t E, int64_t capacity, bool by_probs, int64_t* scratch_N,
                        uint8_t* dropped_TK);

}  // namespace moeplug
