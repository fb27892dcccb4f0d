// Token permutation for MoE dispatch/combine.
//
// Shape legend: T tokens, K top-k choices, D hidden, E experts, S = T*K routed rows.
// All buffers are row-major and contiguous; x/y rows are fp32 or bf16 (DType), ids and
// row_map int64, probs fp32.
#pragma once

#include <cstdint>

#include "moeplug/dtype.h"

namespace moeplug {

// Groups the rows of x_TD by expert (counting sort, stable: inside an expert, rows keep
// (token, k) order). Writes x_SD [T*K, D], row_map_TK [T, K] (the x_SD row of each (t, k))
// and counts_E [E]. Throws std::invalid_argument naming the first (t, k) whose id is not in
// [0, E).
void permute(const void* x_TD, const int64_t* ids_TK, int64_t T, int64_t K, int64_t D, int64_t E,
             DType dtype, void* x_SD, int64_t* row_map_TK, int64_t* counts_E);

// y_TD[t] = sum_k p[t, k] * y_SD[row_map[t, k]] (plain sum when probs_TK is null), summed in
// fp32. row_map entries must lie in [0, S) and be distinct (as permute produces them).
void unpermute(const void* y_SD, const int64_t* row_map_TK, const float* probs_TK, int64_t T,
               int64_t K, int64_t D, int64_t S, DType dtype, void* y_TD);

// Backward of unpermute. grad_y_SD[row_map[t, k]] = p[t, k] * grad_TD[t] (rows that no (t, k)
// reads are left untouched: the caller zero-fills them); grad_probs_TK[t, k] =
// dot(grad_TD[t], y_SD[row_map[t, k]]) when both probs_TK and grad_probs_TK are non-null.
void unpermute_backward(const void* grad_TD, const void* y_SD, const int64_t* row_map_TK,
                        const float* probs_TK, int64_t T, int64_t K, int64_t D, int64_t S,
                        DType dtype, void* grad_y_SD, float* grad_probs_TK);

// Slot maps: the sync-free layer's static shapes (moeplug.modules.static_moe). slot_TK[t, k]
// is the row of an [S, D] buffer that choice (t, k) owns, or -1 where it has none (dropped by
// the router or over the token budget); the non-negative entries are distinct. Rows no choice
// owns are neither read nor written.
//
// x_SD[slot[t, k]] = p[t, k] * x_TD[t] (the gather to the slots; a copy when probs_TK is
// null).
void to_slots(const void* x_TD, const int64_t* slot_TK, const float* probs_TK, int64_t T,
              int64_t K, int64_t D, int64_t S, DType dtype, void* x_SD);
// y_TD[t] = sum_k p[t, k] * y_SD[slot[t, k]] over the choices with a slot (plain sum when
// probs_TK is null; zeros for a token with none), summed in fp32 as unpermute sums. It is also
// to_slots's backward (probs null).
void from_slots(const void* y_SD, const int64_t* slot_TK, const float* probs_TK, int64_t T,
                int64_t K, int64_t D, int64_t S, DType dtype, void* y_TD);
// Backward of from_slots: grad_y_SD[slot[t, k]] = p[t, k] * grad_TD[t] (grad_TD[t] when probs
// is null: to_slots's forward; nothing written when grad_y_SD is null); grad_probs_TK[t, k] =
// dot(grad_TD[t], y_SD[slot[t, k]]), 0 for a choice without a slot, when probs_TK and
// grad_probs_TK are non-null (with grad_TD = x and y_SD = the slots' grads: to_slots' weight
// grads).
void from_slots_backward(const void* grad_TD, const void* y_SD, const int64_t* slot_TK,
                         const float* probs_TK, int64_t T, int64_t K, int64_t D, int64_t S,
                         DType dtype, void* grad_y_SD, float* grad_probs_TK);

// The weighted row sum under unpermute and the direct-write combines (shm_heap.h), for tokens
// [t0, t1): y_TD[t] = sum_k w[t, k] * rows[row_map[t, k]] (w null: plain sum), accumulated in
// fp32 in k order; a choice with row_map < 0 adds nothing (a token with none gets zeros). No
// checks: the callers validate row_map. One definition, so every combine is bitwise the same.
void weighted_row_sums(const float* rows, const int64_t* row_map_TK, const float* w_TK,
                       int64_t t0, int64_t t1, int64_t K, int64_t D, float* y_TD);
void weighted_row_sums(const uint16_t* rows, const int64_t* row_map_TK, const float* w_TK,
                       int64_t t0, int64_t t1, int64_t K, int64_t D, uint16_t* y_TD);

}  // namespace moeplug
