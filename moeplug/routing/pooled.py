"""The load-balancing loss as Hugging Face transformers computes it: one loss over the router
logits of every MoE layer of the model together (``load_balancing_loss_func`` of the Mixtral,
Qwen2/3-MoE, ... modeling files), not a per-layer loss summed over the layers as Megatron's.

Legend: T tokens of one layer, E experts, K top-k, L MoE layers, N = L * T rows pooled.

    s_TE        = softmax(logits_TE)                          each layer's full distribution
    C_E         = sum over layers of #{t : e in topk(s_t, K)}  (no gradient: HF's histc)
    P_E         = sum over layers of sum_t s[t, e]
    hf_aux_loss = E * sum_e (C_E / N) * (P_E / N)              times router_aux_loss_coef

Its value and gradient are not a sum of per-layer terms (the counts of one layer weight the
probabilities of all others), so each layer's router hands its statistics up
(``RouterOutput.pooled_aux``) and the model adds :func:`pooled_aux_loss` of them once
(moeplug.modules.stages). With per-layer f_i = C_E / (K T) and P_i = P_E / T, moeplug's
``aux_loss`` summed over L layers is about L / K times this at the same coefficient
(tests/test_hf_aux_loss.py proves the formula equal to transformers' own function).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

HF_AUX_LOSS = "hf_aux_loss"


@dataclass(frozen=True)
class PooledAuxStats:
    """One MoE layer's part of :func:`pooled_aux_loss`."""

    counts_E: torch.Tensor      # float32 [E], no gradient: top-k choices per expert
    prob_sum_E: torch.Tensor    # float32 [E], with gradient: the softmax summed over tokens
    num_tokens: int             # T, this layer's rows
    coeff: float                # the loss's coefficient (router_aux_loss_coef)


def pooled_aux_stats(logits_TE: torch.Tensor, top_k: int, coeff: float) -> PooledAuxStats:
    """The statistics transformers' load_balancing_loss_func takes from one layer's logits."""
    s_TE = torch.softmax(logits_TE.float(), dim=-1)
    with torch.no_grad():
        ids_TK = torch.topk(s_TE, top_k, dim=-1).indices
        counts_E = torch.zeros(s_TE.shape[-1], dtype=torch.float32, device=s_TE.device)
        counts_E.scatter_add_(0, ids_TK.reshape(-1),
                              torch.ones(ids_TK.numel(), dtype=torch.float32,
                                         device=s_TE.device))
    return PooledAuxStats(counts_E, s_TE.sum(0), int(logits_TE.shape[0]), float(coeff))


def pooled_aux_loss(stats: Sequence[PooledAuxStats]) -> torch.Tensor:
    """coeff * E * sum_e (C_E / N) * (P_E / N) over every layer in ``stats`` (the layers of one
    forward, in any order); a float32 scalar."""
    coeffs = {s.coeff for s in stats}
    if len(coeffs) != 1:
        raise ValueError(f"pooled_aux_loss: the layers' coefficients differ ({sorted(coeffs)}); "
                         f"one loss over all layers has one coefficient")
    total_rows = sum(s.num_tokens for s in stats)
    counts_E = torch.stack([s.counts_E for s in stats]).sum(0)
    prob_sum_E = torch.stack([s.prob_sum_E for s in stats]).sum(0)
    if total_rows == 0:
        return prob_sum_E.sum() * 0.0
    num_experts = counts_E.shape[0]
    loss = num_experts * torch.sum((counts_E / total_rows) * (prob_sum_E / total_rows))
    return coeffs.pop() * loss
