// Fused SwiGLU with an optional per-row routing weight (Megatron's weighted_swiglu).
//
// Shape legend: S rows, F expert FFN hidden size. h_S2F = [gate | up] per row.
// a_SF[s, f] = silu(h[s, f]) * h[s, F + f] * p[s]   (p = 1 when probs_S is null)
// h and a are fp32 or bf16 (math in fp32); probs and grad_probs are fp32.
#pragma once

#include <cstdint>

#include "moeplug/dtype.h"

namespace moeplug {

void swiglu_forward(const void* h_S2F, const float* probs_S, int64_t S, int64_t F, DType dtype,
                    void* a_SF);

// Given grad_a_SF, writes grad_h_S2F and, when grad_probs_S is non-null (probs_S must be too),
// grad_probs_S[s] = sum_f grad_a[s, f] * silu(g) * u.
void swiglu_backward(const void* grad_a_SF, const void* h_S2F, const float* probs_S, int64_t S,
                     int64_t F, DType dtype, void* grad_h_S2F, float* grad_probs_S);

}  // namespace moeplug
