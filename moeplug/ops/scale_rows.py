"""scale_rows: ``x_SD * probs_S.unsqueeze(-1).to(x_SD.dtype)`` (Megatron
moe_apply_probs_on_input's input scaling) with its result and grads in workspace buffers, so the
MoE layer allocates nothing for it after warm-up (tests/test_moe_allocations.py).

Legend: S rows, D hidden.
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace


class _ScaleRows(torch.autograd.Function):
    """Forward: the weights cast to x's dtype as ``Tensor.to`` does (skipped when they already
    are), then the broadcast mul. Backward replays MulBackward0 (dX = dY * p_c;
    dp_c = (dY * x) summed to p_c's [S, 1], i.e. sum(dim=1, keepdim=True) in x's dtype) and
    ToCopyBackward0 (dp_c back to the weights' dtype)."""

    @staticmethod
    def forward(ctx, x_SD, probs_S):
        (S, D), dt = x_SD.shape, x_SD.dtype
        p_S1 = probs_S.unsqueeze(-1)
        if probs_S.dtype != dt:
            p_S1 = workspace.empty((S, 1), dt).copy_(p_S1)
        out = torch.mul(x_SD, p_S1, out=workspace.empty((S, D), dt))
        ctx.save_for_backward(x_SD, p_S1)
        ctx.probs_dtype = probs_S.dtype
        ctx.arena = workspace.current_arena()
        return out

    @staticmethod
    def backward(ctx, grad_SD):
        x_SD, p_S1 = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad
        (S, D), dt = x_SD.shape, x_SD.dtype
        grad_x = grad_p = None
        with workspace.ctx_arena(ctx):
            if need_x:
                grad_x = torch.mul(grad_SD, p_S1, out=workspace.empty((S, D), dt))
            if need_p:
                prod_SD = torch.mul(grad_SD, x_SD, out=workspace.empty((S, D), dt))
                grad_p = torch.sum(prod_SD, dim=1, keepdim=True,
                                   out=workspace.empty((S, 1), dt))
                if ctx.probs_dtype != dt:
                    grad_p = workspace.empty((S, 1), ctx.probs_dtype).copy_(grad_p)
                grad_p = grad_p.squeeze(-1)
        return grad_x, grad_p


def scale_rows(x_SD: torch.Tensor, probs_S: torch.Tensor) -> torch.Tensor:
    """``x_SD * probs_S.unsqueeze(-1).to(x_SD.dtype)``; for CPU tensors into workspace buffers."""
    if x_SD.device.type != "cpu" or x_SD.dim() != 2:
        return x_SD * probs_S.unsqueeze(-1).to(x_SD.dtype)
    return _ScaleRows.apply(x_SD, probs_S)


def ones(probs_S: torch.Tensor) -> torch.Tensor:
    """``torch.ones_like(probs_S)``; on the CPU a workspace buffer."""
    if probs_S.device.type != "cpu":
        return torch.ones_like(probs_S)
    return workspace.empty(tuple(probs_S.shape), probs_S.dtype).fill_(1.0)
