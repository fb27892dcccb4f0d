"""Fused SwiGLU with an optional per-row routing weight, over the C++ kernel.

Shape legend: S rows, F expert FFN hidden size; ``h_S2F = [gate | up]``.
"""

from __future__ import annotations

import torch

from moeplug.ops._checks import check_probs, check_rows, ptr
from moeplug.runtime import get_runtime


def swiglu_forward_raw(h_S2F: torch.Tensor, probs32_S: torch.Tensor | None,
                       out_SF: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel call without autograd (expert_mlp reuses it inside its own Function)."""
    S, F2 = h_S2F.shape
    a_SF = h_S2F.new_empty(S, F2 // 2) if out_SF is None else out_SF
    get_runtime().swiglu_forward(h=h_S2F.data_ptr(), probs=ptr(probs32_S), a=a_SF.data_ptr(),
                                 num_rows=S, ffn_hidden=F2 // 2,
                                 dtype=check_rows("swiglu", "h_S2F", h_S2F, 2, "[S, 2F]"))
    return a_SF


def swiglu_backward_raw(grad_SF: torch.Tensor, h_S2F: torch.Tensor,
                        probs32_S: torch.Tensor | None, want_probs_grad: bool,
                        out_S2F: torch.Tensor | None = None,
                        out_probs_S: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (grad_h_S2F, grad_probs_S or None); grad_SF must match h's dtype."""
    S, F2 = h_S2F.shape
    grad_SF = grad_SF.to(h_S2F.dtype).contiguous()
    grad_h_S2F = torch.empty_like(h_S2F) if out_S2F is None else out_S2F
    grad_probs_S = None
    if want_probs_grad:
        grad_probs_S = torch.empty(S, dtype=torch.float32) if out_probs_S is None else out_probs_S
    get_runtime().swiglu_backward(grad_a=grad_SF.data_ptr(), h=h_S2F.data_ptr(),
                                  probs=ptr(probs32_S), grad_h=grad_h_S2F.data_ptr(),
                                  grad_probs=ptr(grad_probs_S), num_rows=S, ffn_hidden=F2 // 2,
                                  dtype=check_rows("swiglu", "h_S2F", h_S2F, 2, "[S, 2F]"))
    return grad_h_S2F, grad_probs_S


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_S2F, probs_S, probs32_S):
        ctx.save_for_backward(h_S2F, probs32_S)
        ctx.probs_dtype = None if probs_S is None else probs_S.dtype
        return swiglu_forward_raw(h_S2F, probs32_S)

    @staticmethod
    def backward(ctx, grad_SF):
        h_S2F, probs32_S = ctx.saved_tensors
        want_dp = probs32_S is not None and ctx.needs_input_grad[1]
        grad_h_S2F, grad_probs_S = swiglu_backward_raw(grad_SF, h_S2F, probs32_S, want_dp)
        if grad_probs_S is not None:
            grad_probs_S = grad_probs_S.to(ctx.probs_dtype)
        return grad_h_S2F, grad_probs_S, None


def swiglu(h_S2F: torch.Tensor, probs_S: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:] * probs[:, None]`` in one pass (fp32 math for bf16)."""
    check_rows("swiglu", "h_S2F", h_S2F, 2, "[S, 2F]")
    if h_S2F.shape[1] % 2:
        raise ValueError(f"swiglu: h_S2F has {h_S2F.shape[1]} columns; expected an even number "
                         f"(gate half then up half). Fix: pass the [S, 2F] gate_up projection")
    probs32_S = None
    if probs_S is not None:
        probs32_S = check_probs("swiglu", "probs_S", probs_S, (h_S2F.shape[0],))
    return _SwiGLU.apply(h_S2F, probs_S, probs32_S)
