"""Score functions and top-k selection (Megatron ``topk_routing_with_score_function``).

Legend: T tokens, E experts, K top-k, G expert groups, E/G experts per group.

    softmax, renormalize=True  (Megatron post-softmax, Mixtral): ids = top-k of z;
                                probs = softmax over the K chosen logits
    softmax, renormalize=False (Megatron pre-softmax): s = softmax(z) over all E;
                                ids = top-k of s; probs = chosen s (not renormalised)
    sigmoid / sqrtsoftplus:     s = sigmoid(z) or sqrt(softplus(z)); ids = top-k of s + bias
                                (bias steers selection only); probs = chosen *unbiased* s, divided
                                by (their sum + 1e-20) when renormalize and K > 1
    finally probs *= scaling_factor.
The 1e-20 keeps 0/0 finite without letting a router shrink all scores to game the normaliser
(Megatron #1545 discussed a larger epsilon doing exactly that).
"""

from __future__ import annotations

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
NORM_EPS = 1e-20


def score(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-expert scores s for every token: softmax over E, sigmoid, or sqrt(softplus)."""
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits_TE)
    if score_function == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(logits_TE))
    raise ValueError(f"score_function = {score_function!r}: unknown. Fix: use one of "
                     f"{', '.join(SCORE_FUNCTIONS)}")


def aux_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """The full distribution the aux losses use: softmax(z), or s / (sum_E s + 1e-20)."""
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    s_TE = score(logits_TE, score_function)
    return s_TE / (s_TE.sum(dim=-1, keepdim=True) + NORM_EPS)


def group_limited_topk(scores_TE: torch.Tensor, k: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best of ``num_groups`` contiguous expert groups.

    A group's score is the sum of its top ``k // group_topk`` scores (DeepSeek-V3 node-limited
    routing); the other groups are masked to -inf before the plain top-k.
    Returns (top scores_TK, ids_TK).
    """
    T, E = scores_TE.shape
    per_group = max(k // group_topk, 1)
    group_score_TG = scores_TE.view(T, num_groups, E // num_groups).topk(per_group, dim=-1)[0].sum(-1)
    group_ids_TG = group_score_TG.topk(group_topk, dim=-1, sorted=False)[1]
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, group_ids_TG, True)
    keep_TE = keep_TG.repeat_interleave(E // num_groups, dim=1)
    return scores_TE.masked_fill(~keep_TE, float("-inf")).topk(k, dim=-1)


def select_topk(scores_TE: torch.Tensor, k: int, num_groups: int | None = None,
                group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain or group-limited top-k of ``scores_TE``: (top scores_TK, ids_TK)."""
    if num_groups:
        return group_limited_topk(scores_TE, k, num_groups, group_topk)
    return scores_TE.topk(k, dim=-1)


def topk_routing(logits_TE: torch.Tensor, k: int, *, score_function: str = "softmax",
                 renormalize: bool = True, expert_bias_E: torch.Tensor | None = None,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to K experts; returns (probs_TK, ids_TK) in the dtype of the logits."""
    if score_function == "softmax":
        if expert_bias_E is not None:
            raise ValueError("topk_routing: expert_bias_E with score_function='softmax'. Fix: use "
                             "'sigmoid' or 'sqrtsoftplus' with an expert bias")
        if renormalize:
            top_TK, ids_TK = select_topk(logits_TE, k, num_groups, group_topk)
            probs_TK = torch.softmax(top_TK, dim=-1)
        else:
            probs_TK, ids_TK = select_topk(torch.softmax(logits_TE, dim=-1), k, num_groups,
                                           group_topk)
    else:
        s_TE = score(logits_TE, score_function)
        if expert_bias_E is None:
            probs_TK, ids_TK = select_topk(s_TE, k, num_groups, group_topk)
        else:
            # Bias decides *which* experts, never *how much*: gather the unbiased scores.
            ids_TK = select_topk(s_TE + expert_bias_E.to(s_TE.dtype), k, num_groups, group_topk)[1]
            probs_TK = s_TE.gather(1, ids_TK)
        if renormalize and k > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + NORM_EPS)
    if scaling_factor != 1.0:
        probs_TK = probs_TK * scaling_factor
    return probs_TK, ids_TK
