"""RMSNorm (Zhang & Sennrich 2019), as in Llama/Mixtral.

Legend: D hidden size; ``x_ND`` any leading dims N flattened conceptually.
"""

from __future__ import annotations

import torch
from torch import nn


def _rms_norm(x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    in_dtype = x_ND.dtype
    x32_ND = x_ND.float()
    inv_rms_N1 = torch.rsqrt(x32_ND.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * (x32_ND * inv_rms_N1).to(in_dtype)


class _RMSNorm(torch.autograd.Function):
    """:func:`_rms_norm` keeping only its input for backward. Autograd of the composition
    keeps the input's fp32 copy and the normalized output (6 bytes an element of a bf16
    input), where Megatron's fused norm keeps the input (2). The backward runs the same
    composition again on the saved input and takes autograd's gradients of it, so they are
    bitwise what they were; the price is one more elementwise pass over the input."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x_ND, weight_D)
        ctx.eps = eps
        return _rms_norm(x_ND, weight_D, eps)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        x_ND, weight_D = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        with torch.enable_grad():
            x_ND = x_ND.detach().requires_grad_(want_x)
            w_D = weight_D.detach().requires_grad_(want_w)
            wanted = [t for t in (x_ND, w_D) if t.requires_grad]
            grads = iter(torch.autograd.grad(_rms_norm(x_ND, w_D, ctx.eps), wanted, grad_ND))
        return (next(grads) if want_x else None, next(grads) if want_w else None, None)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps).

    The statistic is computed in fp32 even under bf16 autocast: a bf16 mean of squares loses the
    small components and the norm drifts (same choice as Hugging Face's MixtralRMSNorm, which our
    parity test relies on). Under autograd it keeps only its input for backward
    (:class:`_RMSNorm`); recompute ``layernorm`` also drops its output once the next module has
    run (moeplug.ops.discard).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        # Compiled (runtime.capture, torch.compile), AOTAutograd's partitioner picks what the
        # backward keeps itself, and the nested autograd.grad would break the graph.
        if (torch.is_grad_enabled() and (x_ND.requires_grad or self.weight.requires_grad)
                and not torch.compiler.is_compiling()):
            return _RMSNorm.apply(x_ND, self.weight, self.eps)
        return _rms_norm(x_ND, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
