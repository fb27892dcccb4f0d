"""Expert capacity and token dropping (Megatron ``moe_expert_capacity_factor``).

Legend: T tokens, E experts, K top-k.

    C = ceil(T * K / E * capacity_factor)
Each expert keeps at most C of the token choices routed to it:
    policy ``probs``     keep the C choices with the largest routing weight (ties: earlier token)
    policy ``position``  keep the first C choices in token order, i.e. drop the tokens at the
                         end of the micro-batch (with b-major tokens: the last sequences)
A dropped choice keeps its (valid, distinct) expert id but gets weight 0 and is marked in
``dropped_TK``; the surviving weights are not renormalised (Megatron).
"""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T*K/E * capacity_factor)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def drop_over_capacity(probs_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int,
                       capacity: int, policy: str = "probs"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (probs_TK with dropped choices zeroed, dropped_TK bool)."""
    T, K = ids_TK.shape
    if policy not in DROP_POLICIES:
        raise ValueError(f"token_drop_policy = {policy!r}: unknown. Fix: use 'probs' or 'position'")
    if capacity >= T or T == 0:  # an expert can receive at most T choices: nothing can drop
        return probs_TK, torch.zeros_like(ids_TK, dtype=torch.bool)
    chosen_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=ids_TK.device)
    chosen_TE.scatter_(1, ids_TK, True)
    if policy == "position":
        rank_TE = torch.cumsum(chosen_TE.to(torch.int32), dim=0) - 1
    else:
        # Rank the choices of each expert by weight, largest first; unchosen entries sort last.
        key_TE = torch.full((T, num_experts), -1.0, dtype=torch.float64, device=ids_TK.device)
        key_TE.scatter_(1, ids_TK, probs_TK.detach().to(torch.float64))
        order_TE = torch.sort(key_TE, dim=0, descending=True, stable=True).indices
        rank_TE = torch.empty_like(order_TE).scatter_(
            0, order_TE, torch.arange(T, device=ids_TK.device).unsqueeze(1).expand(T, num_experts))
    dropped_TK = rank_TE.gather(1, ids_TK) >= capacity
    return probs_TK.masked_fill(dropped_TK, 0.0), dropped_TK
