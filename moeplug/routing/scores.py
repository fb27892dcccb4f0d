"""Score functions and top-k selection (Megatron ``topk_routing_with_score_function``).

Legend: T tokens, E experts, K top-k, G expert groups, N = E/G experts per group.

    softmax, renormalize=True  (Megatron post-softmax, Mixtral): ids = top-k of z;
                                probs = softmax over the K chosen logits
    softmax, renormalize=False (Megatron pre-softmax): s = softmax(z) over all E;
                                ids = top-k of s; probs = chosen s (not renormalised)
    sigmoid / sqrtsoftplus:     s = sigmoid(z) or sqrt(softplus(z)); ids = top-k of s + bias
                                (bias steers selection only); probs = chosen *unbiased* s, divided
                                by (their sum + 1e-20) when renormalize and K > 1
    group-limited (num_groups G, group_topk): before the top-k, keep only the group_topk groups
                                with the best group score (``group_score``: sum of a group's top
                                k // group_topk selection scores, or of its top 2 like HF)
    finally probs *= scaling_factor.
The 1e-20 keeps 0/0 finite without letting a router shrink all scores to game the normaliser
(Megatron #1545 discussed a larger epsilon doing exactly that).
"""

from __future__ import annotations

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
GROUP_SCORES = ("topk_share", "top2_sum")  # see group_limited_topk
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


def group_limited_topk(scores_TE: torch.Tensor, k: int, num_groups: int, group_topk: int,
                       group_score: str = "topk_share") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best of ``num_groups`` contiguous expert groups.

    A group's score is the sum of its top n scores: n = k // group_topk for ``topk_share``
    (Megatron), n = 2 for ``top2_sum`` (Hugging Face / DeepSeek-V3's reference code); the two
    agree when k // group_topk == 2 (DeepSeek-V3: 8 // 4). The other groups are masked to -inf
    before the plain top-k. Returns (top scores_TK, ids_TK).
    """
    T, E = scores_TE.shape
    per_group = group_members(k, group_topk, group_score)
    group_TGN = scores_TE.view(T, num_groups, E // num_groups)
    group_score_TG = group_TGN.topk(per_group, dim=-1)[0].sum(-1)
    group_ids_TG = group_score_TG.topk(group_topk, dim=-1, sorted=False)[1]
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, group_ids_TG, True)
    keep_TE = keep_TG.repeat_interleave(E // num_groups, dim=1)
    return scores_TE.masked_fill(~keep_TE, float("-inf")).topk(k, dim=-1)


def group_members(k: int, group_topk: int, group_score: str) -> int:
    """How many of a group's best scores sum to the group's score (see group_limited_topk)."""
    if group_score == "topk_share":
        return max(k // group_topk, 1)
    if group_score == "top2_sum":
        return 2
    raise ValueError(f"group_score = {group_score!r}: unknown. Fix: use one of "
                     f"{', '.join(GROUP_SCORES)}")


def select_topk(scores_TE: torch.Tensor, k: int, num_groups: int | None = None,
                group_topk: int | None = None, group_score: str = "topk_share"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain or group-limited top-k of ``scores_TE``: (top scores_TK, ids_TK)."""
    if num_groups:
        return group_limited_topk(scores_TE, k, num_groups, group_topk, group_score)
    return scores_TE.topk(k, dim=-1)


def topk_routing(logits_TE: torch.Tensor, k: int, *, score_function: str = "softmax",
                 renormalize: bool = True, expert_bias_E: torch.Tensor | None = None,
                 num_groups: int | None = None, group_topk: int | None = None,
                 group_score: str = "topk_share", scaling_factor: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to K experts; returns (probs_TK, ids_TK) in the dtype of the logits."""
    groups = (num_groups, group_topk, group_score)
    if score_function == "softmax":
        if expert_bias_E is not None:
            raise ValueError("topk_routing: expert_bias_E with score_function='softmax'. Fix: use "
                             "'sigmoid' or 'sqrtsoftplus' with an expert bias")
        if renormalize:
            top_TK, ids_TK = select_topk(logits_TE, k, *groups)
            probs_TK = torch.softmax(top_TK, dim=-1)
        else:
            probs_TK, ids_TK = select_topk(torch.softmax(logits_TE, dim=-1), k, *groups)
    else:
        s_TE = score(logits_TE, score_function)
        if expert_bias_E is None:
            probs_TK, ids_TK = select_topk(s_TE, k, *groups)
        else:
            # Bias decides *which* experts, never *how much*: gather the unbiased scores.
            ids_TK = select_topk(s_TE + expert_bias_E.to(s_TE.dtype), k, *groups)[1]
            probs_TK = s_TE.gather(1, ids_TK)
        if renormalize and k > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + NORM_EPS)
    if scaling_factor != 1.0:
        probs_TK = probs_TK * scaling_factor
    return probs_TK, ids_TK
