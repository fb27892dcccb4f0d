"""linear: ``(x.to(dtype) @ weight.to(dtype).t()).to(out_dtype)``, a bias-free ``nn.Linear``
for CPU tensors with the casts, the product and every gradient in workspace buffers
(moeplug.runtime.workspace), so the router's gate and the shared experts' projections allocate
nothing after warm-up.

Shape legend: N rows, I input features, O output features.

The ops are those autograd runs for the composition, so the numbers are bitwise the same:
forward the casts (none where the dtypes already agree) and ``mm(x_c, W_c.t())``; backward the
cast of the grad to ``dtype``, MmBackward0 for a row-major x and the column-major ``W.t()``
(dX = dY @ W and dW = dY^T @ X, mm_mat2_backward's transposed form, so the weight's grad is a
contiguous [O, I] that AccumulateGrad adopts as ``weight.grad`` without a copy) and each
ToCopyBackward0 (the grads cast back to their inputs' dtypes).

Under CPU autocast ``nn.Linear`` is this with ``dtype`` the autocast dtype and ``out_dtype`` the
same. Autocast also caches a leaf weight's cast for the rest of its region and then sums a
weight used twice there in ``dtype`` before the cast back; this casts per call, which is the
same numbers wherever each weight is used once per region (the MoE layer's: one micro-batch is
one region; a recompute runs in a region of its own).
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself in ``dtype``, else its cast into a workspace buffer."""
    return t if t.dtype == dtype else workspace.empty(tuple(t.shape), dtype).copy_(t)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, weight_OI: torch.Tensor, dtype: torch.dtype,
                out_dtype: torch.dtype):
        with torch.autocast(device_type="cpu", enabled=False):
            x_c, w_c = _to(x_NI, dtype), _to(weight_OI, dtype)
            y_NO = workspace.empty((x_c.shape[0], w_c.shape[0]), dtype)
            torch.mm(x_c, w_c.t(), out=y_NO)
        ctx.save_for_backward(x_c, w_c)
        ctx.dtypes = (x_NI.dtype, weight_OI.dtype)
        ctx.arena = workspace.current_arena()
        return _to(y_NO, out_dtype)

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        x_c, w_c = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        need_x, need_w, _, _ = ctx.needs_input_grad
        grad_x = grad_w = None
        with workspace.ctx_arena(ctx):
            grad_c = _to(grad_NO, x_c.dtype)
            if need_x:
                gx = torch.mm(grad_c, w_c, out=workspace.empty(tuple(x_c.shape), x_c.dtype))
                grad_x = _to(gx, x_dtype)
            if need_w:
                gw = torch.mm(grad_c.t(), x_c, out=workspace.empty(tuple(w_c.shape), w_c.dtype))
                grad_w = _to(gw, w_dtype)
        return grad_x, grad_w, None, None


def linear(x_NI: torch.Tensor, weight_OI: torch.Tensor, dtype: torch.dtype,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(x_NI.to(dtype) @ weight_OI.to(dtype).t()).to(out_dtype or dtype)`` for 2-D CPU
    tensors, autocast off inside, into workspace buffers (module docstring)."""
    return _Linear.apply(x_NI, weight_OI, dtype, dtype if out_dtype is None else out_dtype)
