"""cast: ``x.to(dtype)`` for CPU tensors, differentiable, with the result and its grad in
workspace buffers (moeplug.runtime.workspace), so a cast on the MoE path allocates nothing after
warm-up. The same conversions as ``Tensor.to`` and its ToCopyBackward0 (``copy_`` both ways),
so the same numbers.
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype):
        ctx.in_dtype = x.dtype
        ctx.arena = workspace.current_arena()
        return workspace.empty(tuple(x.shape), dtype).copy_(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with workspace.ctx_arena(ctx):
            return workspace.empty(tuple(grad.shape), ctx.in_dtype).copy_(grad), None


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``; CPU tensors of another dtype go through workspace buffers."""
    if x.dtype == dtype or x.device.type != "cpu":
        return x.to(dtype)
    return _Cast.apply(x, dtype)
