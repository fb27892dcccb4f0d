"""Router gate: logits in fp32 (or fp64, or the GEMM in the input's dtype), input jitter,
force-balanced logits for benchmarks.

Legend: T tokens, D hidden, E experts.
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace
from moeplug.ops._grouped import compute_dtype
from moeplug.ops.linear import linear

# None: the gate GEMM in the input's dtype (Megatron with moe_router_dtype unset), see below.
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "input": None}


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor,
                  dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """``logits_TE = x_TD @ weight_ED.T`` computed in ``dtype`` (fp32 or fp64), autocast off.

    ``dtype=None`` is Megatron's gate with ``moe_router_dtype`` unset: the GEMM runs in the
    input's dtype (the autocast dtype where autocast is on, so bf16 in a bf16 run, as HF's
    bf16 blocks run their gate too), and the logits come back in fp32, where the scores, the
    top-k and the losses are computed. A bf16 gate is ~16x cheaper on a GPU (the fp32 one, with
    no TF32, took 0.6 of the Qwen3-shape layer's ~8.9 ms on an H200), at the cost of logits
    rounded to bf16. Without autocast and with fp32 inputs it is the fp32 gate.

    Routing decisions flip on tiny logit differences, so Megatron keeps the gate GEMM out of
    bf16 (``moe_router_dtype``). Inputs of another dtype go through :class:`_UpcastGate`, which
    keeps them as they came and casts again in backward (Megatron's
    RouterGatingLinearFunction): autograd of the composition would keep the fp32 copy of x,
    T*D floats a layer beside the bf16 x the rest of the layer keeps.

    CPU inputs already in ``dtype`` (and the ``None`` gate's CPU inputs) take
    :func:`moeplug.ops.linear.linear` instead: the same GEMMs and casts that autograd runs
    (bitwise the same numbers), written into the running MoE layer's workspace (no allocation
    after warm-up).
    """
    if dtype is None:
        dtype = compute_dtype(x_TD)
        if dtype != torch.float32 and dtype != torch.float64:
            return _input_dtype_logits(x_TD, weight_ED, dtype)
    if (x_TD.device.type == "cpu" and x_TD.dtype == dtype and weight_ED.dtype == dtype
            and x_TD.dim() == 2 and x_TD.is_contiguous() and weight_ED.is_contiguous()):
        return linear(x_TD, weight_ED, dtype)
    if x_TD.dim() == 2 and (x_TD.dtype != dtype or weight_ED.dtype != dtype):
        return _UpcastGate.apply(x_TD, weight_ED, dtype)
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        return x_TD.to(dtype) @ weight_ED.to(dtype).t()


class _UpcastGate(torch.autograd.Function):
    """``x.to(dtype) @ w.to(dtype).t()`` (autocast off) keeping x and w as they came. The
    backward casts them again and runs the GEMMs autograd runs for the composition
    (MmBackward0's: ``g @ w`` and, w.t() being column-major, ``(g.t() @ x)``; then the casts
    back to the inputs' dtypes), so the gradients are bitwise the composition's."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, weight_ED: torch.Tensor, dtype: torch.dtype):
        ctx.save_for_backward(x_TD, weight_ED)
        ctx.dtype = dtype
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            return x_TD.to(dtype) @ weight_ED.to(dtype).t()

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):
        x_TD, weight_ED = ctx.saved_tensors
        dx = dw = None
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = grad_TE.mm(weight_ED.to(ctx.dtype)).to(x_TD.dtype)
            if ctx.needs_input_grad[1]:
                dw = grad_TE.t().mm(x_TD.to(ctx.dtype)).to(weight_ED.dtype)
        return dx, dw, None


def _input_dtype_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of the gate GEMM in ``dtype`` (bf16, fp16): on the CPU
    :func:`moeplug.ops.linear.linear`, elsewhere torch's composition, whose ops it runs."""
    if x_TD.device.type == "cpu" and x_TD.dim() == 2:
        return linear(x_TD, weight_ED, dtype, torch.float32)
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        return (x_TD.to(dtype) @ weight_ED.to(dtype).t()).float()


def input_jitter(x_TD: torch.Tensor, eps: float) -> torch.Tensor:
    """Multiplicative uniform noise ``x * U(1 - eps, 1 + eps)`` (Switch Transformer); a new
    draw per call from torch's global RNG, so seed it for reproducible runs.

    Contiguous CPU inputs take :class:`_Jitter`: the same draw and products in the running MoE
    layer's workspace (no allocation after warm-up)."""
    if eps <= 0.0:
        return x_TD
    if x_TD.device.type == "cpu" and x_TD.is_contiguous():
        return _Jitter.apply(x_TD, eps)
    noise_TD = torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)
    return x_TD * noise_TD


class _Jitter(torch.autograd.Function):
    """``x * noise`` with the noise drawn into a workspace buffer (``uniform_`` on a contiguous
    buffer of x's shape and dtype: the draw ``torch.empty_like(x).uniform_`` makes, bitwise) and
    the product and its gradient (``grad * noise``, what MulBackward0 computes) there too."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, eps: float):
        shape = tuple(x_TD.shape)
        noise_TD = workspace.empty(shape, x_TD.dtype).uniform_(1.0 - eps, 1.0 + eps)
        out_TD = workspace.empty(shape, x_TD.dtype)
        torch.mul(x_TD, noise_TD, out=out_TD)
        ctx.save_for_backward(noise_TD)
        ctx.arena = workspace.current_arena()
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        (noise_TD,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        with workspace.ctx_arena(ctx):
            grad_x = workspace.empty(tuple(grad_TD.shape), grad_TD.dtype)
            torch.mul(grad_TD, noise_TD, out=grad_x)
        return grad_x, None


class _RandomLogits(torch.autograd.Function):
    """Forward: random normal logits (drawn into a workspace buffer on CPU: ``normal_`` is what
    ``torch.randn`` fills with, bitwise); backward: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, seed: int):
        gen = torch.Generator(device=logits_TE.device).manual_seed(seed)
        if logits_TE.device.type == "cpu":
            return workspace.empty(tuple(logits_TE.shape), logits_TE.dtype).normal_(
                generator=gen)
        return torch.randn(logits_TE.shape, generator=gen, dtype=logits_TE.dtype,
                           device=logits_TE.device)

    @staticmethod
    def backward(ctx, grad_TE):
        return grad_TE, None


def force_balanced_logits(logits_TE: torch.Tensor, seed: int = 42) -> torch.Tensor:
    """Replace the logits with i.i.d. normal ones (Megatron ``moe_router_force_load_balancing``),
    so every expert gets ~T*K/E tokens whatever the weights: benchmarks then measure the
    balanced case. The draw depends only on ``seed`` and the shape (not on call count), so two
    calls route identically; the gate still gets a (straight-through) gradient."""
    return _RandomLogits.apply(logits_TE, seed)
