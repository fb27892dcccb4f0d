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

from moeplug.runtime import workspace
from moeplug.ops._checks import ptr
from moeplug.runtime import get_runtime

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
    if ids_TK.device.type == "cpu" and probs_TK.device.type == "cpu":
        # The runtime's kernel over the running MoE layer's arena (issue 7).
        dropped_TK = _dropped_in_workspace(probs_TK, ids_TK, num_experts, capacity, policy)
    else:
        dropped_TK = _dropped_by_torch(probs_TK, ids_TK, num_experts, capacity, policy)
    return zero_dropped(probs_TK, dropped_TK), dropped_TK


def _dropped_by_torch(probs_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int,
                      capacity: int, policy: str) -> torch.Tensor:
    """:func:`drop_over_capacity`'s ``dropped_TK`` in plain torch (any device)."""
    T, K = ids_TK.shape
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
    return rank_TE.gather(1, ids_TK) >= capacity


def _dropped_in_workspace(probs_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int,
                          capacity: int, policy: str) -> torch.Tensor:
    """:func:`drop_over_capacity`'s ``dropped_TK`` (CPU) from the runtime's kernel, every buffer
    from the running layer's workspace: no allocation (torch.sort's CPU kernel made its own
    index range even with ``out=``). Integer and boolean results, the same selection as the
    torch path's stable sort: exactly equal (tests/test_moe_allocations.py)."""
    T, K = ids_TK.shape
    ws = workspace.empty
    by_probs = policy == "probs"
    probs32 = None
    if by_probs:
        probs32 = probs_TK.detach()
        if probs32.dtype != torch.float32 or not probs32.is_contiguous():
            probs32 = ws((T, K), torch.float32).copy_(probs32)
    ids = ids_TK if ids_TK.dtype == torch.int64 and ids_TK.is_contiguous() else \
        ws((T, K), torch.int64).copy_(ids_TK)
    dropped_TK = ws((T, K), torch.bool)
    scratch = ws((T * K + num_experts + 1,), torch.int64)
    get_runtime().drop_over_capacity(
        probs=ptr(probs32), ids=ids.data_ptr(), num_tokens=T, top_k=K, num_experts=num_experts,
        capacity=capacity, by_probs=by_probs, scratch=scratch.data_ptr(),
        dropped=dropped_TK.data_ptr())
    return dropped_TK


class _ZeroDropped(torch.autograd.Function):
    """``probs_TK.masked_fill(dropped_TK, 0.0)`` into workspace buffers: masked_fill is clone +
    masked_fill_, and MaskedFillBackward0 is ``grad.masked_fill(mask, 0)``."""

    @staticmethod
    def forward(ctx, probs_TK, dropped_TK):
        ctx.save_for_backward(dropped_TK)
        ctx.arena = workspace.current_arena()
        out = workspace.empty(tuple(probs_TK.shape), probs_TK.dtype).copy_(probs_TK)
        return out.masked_fill_(dropped_TK, 0.0)

    @staticmethod
    def backward(ctx, grad_TK):
        (dropped_TK,) = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            grad = workspace.empty(tuple(grad_TK.shape), grad_TK.dtype).copy_(grad_TK)
        return grad.masked_fill_(dropped_TK, 0.0), None


def zero_dropped(probs_TK: torch.Tensor, dropped_TK: torch.Tensor) -> torch.Tensor:
    """``probs_TK.masked_fill(dropped_TK, 0.0)`` (CPU: into the running layer's arena)."""
    if probs_TK.device.type != "cpu":
        return probs_TK.masked_fill(dropped_TK, 0.0)
    return _ZeroDropped.apply(probs_TK, dropped_TK)


def dropped_fraction(dropped_TK: torch.Tensor) -> torch.Tensor:
    """``dropped_TK.float().mean()`` (T > 0); on the CPU into the running layer's arena: the
    cast, then torch's CPU mean (sum over every element, then ``div_`` by their count)."""
    if dropped_TK.device.type != "cpu":
        return dropped_TK.float().mean()
    f = workspace.empty(tuple(dropped_TK.shape), torch.float32).copy_(dropped_TK)
    total = torch.sum(f, tuple(range(f.dim())), out=workspace.empty((), torch.float32))
    return total.div_(workspace.empty((), torch.float32).fill_(f.numel()))


def kept(dropped_TK: torch.Tensor) -> torch.Tensor:
    """``~dropped_TK`` (CPU: into the running layer's arena)."""
    if dropped_TK.device.type != "cpu":
        return ~dropped_TK
    return torch.bitwise_not(dropped_TK, out=workspace.empty(tuple(dropped_TK.shape),
                                                             torch.bool))
