"""Shared experts: a dense MLP every token goes through, beside the routed experts.

Legend: T tokens, D hidden, F shared-expert FFN hidden size (``moe.shared_expert_ffn_hidden_size``).

Megatron ``SharedExpertMLP`` (DeepSeek-MoE / Qwen2-MoE): out = MLP(x) [* sigmoid(x . w_g)], added
to the routed experts' output by the MoE layer (stage 5). The MLP uses ``moe.activation``, like
the routed experts. Parameter names follow Hugging Face DeepSeek-V3 (``gate_proj``, ``up_proj``,
``down_proj``); ``gate_proj`` exists only for gated activations.
"""

from __future__ import annotations

import torch
from torch import nn

from moeplug.config import MoEConfig
from moeplug.runtime import workspace
from moeplug.ops.linear import linear
from moeplug.ops.activations import (act_times_probs, act_times_probs_backward, activation_fn,
                                     is_gated)
from moeplug.quant import active_recipe


class SharedExperts(nn.Module):
    """``y = down(act(x)) * (sigmoid(x . w_g) if gated)``; act over [gate x, up x] or up x.

    Weights: ``gate_proj`` [F, D] (gated activations only), ``up_proj`` [F, D], ``down_proj``
    [D, F], and with ``shared_expert_gate`` ``output_gate`` [1, D] (w_g).
    """

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        D, F = hidden_size, moe.shared_expert_ffn_hidden_size
        if F <= 0:
            raise ValueError(f"SharedExperts: MoEConfig.shared_expert_ffn_hidden_size = {F} means "
                             f"no shared expert. Fix: build SharedExperts only when it is > 0")
        self.activation = moe.activation
        self.gate_proj = nn.Linear(D, F, bias=False) if is_gated(moe.activation) else None
        self.up_proj = nn.Linear(D, F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)
        self.output_gate = nn.Linear(D, 1, bias=False) if moe.shared_expert_gate else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self._in_workspace(x_TD):
            # The same ops into the running MoE layer's arena: no allocation after warm-up.
            up_TF = _linear(x_TD, self.up_proj.weight)
            gate_TF = None if self.gate_proj is None else _linear(x_TD, self.gate_proj.weight)
            a_TF = _ActivationParts.apply(gate_TF, up_TF, self.activation)
            y_TD = _linear(a_TF, self.down_proj.weight)
            if self.output_gate is not None:
                y_TD = _SigmoidScale.apply(y_TD, _linear(x_TD, self.output_gate.weight))
            return y_TD
        up_TF = self.up_proj(x_TD)
        # activations.py takes FC1's output: [gate | up] halves for gated activations.
        h_TX = up_TF if self.gate_proj is None else torch.cat([self.gate_proj(x_TD), up_TF], -1)
        y_TD = self.down_proj(activation_fn(self.activation)(h_TX))
        if self.output_gate is not None:
            y_TD = y_TD * torch.sigmoid(self.output_gate(x_TD))
        return y_TD

    def _in_workspace(self, x_TD: torch.Tensor) -> bool:
        """CPU, any activation, with or without the output gate; fp32 weights and input,
        autocast off or bf16, no quantization recipe (under a recipe F.linear is QuantLinear).
        Under autocast not for a leaf that requires grad: autocast would cast it once for both
        linears and sum their grads in bf16."""
        return (x_TD.device.type == "cpu" and x_TD.dtype == torch.float32 and x_TD.dim() == 2
                and x_TD.is_contiguous() and active_recipe() is None
                and (_gemm_dtype() is None or _gemm_dtype() == torch.bfloat16
                     and not (x_TD.is_leaf and x_TD.requires_grad))
                and all(p.dtype == torch.float32 and p.is_contiguous() for p in self.parameters()))


def _gemm_dtype() -> torch.dtype | None:
    """The CPU autocast dtype, or None when autocast is off."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _linear(x_NI: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    # nn.Linear without a bias: x @ W.t() (one mm, MmBackward0), under autocast with the casts
    # autograd runs; moeplug.ops.linear runs exactly those ops into workspace buffers.
    dtype = _gemm_dtype()
    return linear(x_NI, weight_OI, x_NI.dtype if dtype is None else dtype)


class _ActivationParts(torch.autograd.Function):
    """``act(cat([g, u], -1))`` for gated activations, ``act(u)`` for the others, as
    :func:`moeplug.ops.activations.activation_fn` computes it, into workspace buffers. A gated
    input is copied into one [T, 2F] buffer whose halves stay strided views as in torch: silu's
    vector kernel takes a scalar tail per row of a view but not of a contiguous tensor, so the
    layout is part of the numbers. Backward is activations.py's vjp (MulBackward0 and the
    gate's own backward, bitwise autograd's), whose [T, 2F] grad hands its halves, as views, to
    the two GEMMs (SplitBackward0 then CatBackward0)."""

    @staticmethod
    def forward(ctx, gate_TF, up_TF, name):
        if gate_TF is None:
            h_TX = up_TF
        else:
            (T, F), dt = gate_TF.shape, gate_TF.dtype
            h_TX = workspace.empty((T, 2 * F), dt)
            h_TX[:, :F].copy_(gate_TF)
            h_TX[:, F:].copy_(up_TF)
        ctx.save_for_backward(h_TX)
        ctx.name, ctx.gated = name, gate_TF is not None
        ctx.arena = workspace.current_arena()
        return act_times_probs(h_TX, None, name, workspace.empty)

    @staticmethod
    def backward(ctx, grad_TF):
        (h_TX,) = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            dh_TX, _ = act_times_probs_backward(grad_TF, h_TX, None, ctx.name, False,
                                                workspace.empty)
        if not ctx.gated:
            return None, dh_TX, None
        F = grad_TF.shape[1]
        return dh_TX[:, :F], dh_TX[:, F:], None


class _SigmoidScale(torch.autograd.Function):
    """``y * sigmoid(z)`` with z = x . w_g [T, 1] (the shared expert's output gate), into
    workspace buffers. Backward repeats MulBackward0 (dY = dOut * s; dS = dOut * y summed to
    [T, 1], as autograd's sum_to) and SigmoidBackward0 (aten::sigmoid_backward on s)."""

    @staticmethod
    def forward(ctx, y_TD, z_T1):
        s_T1 = torch.sigmoid(z_T1, out=workspace.empty(tuple(z_T1.shape), z_T1.dtype))
        out_TD = torch.mul(y_TD, s_T1, out=workspace.empty(tuple(y_TD.shape), y_TD.dtype))
        ctx.save_for_backward(y_TD, s_T1)
        ctx.arena = workspace.current_arena()
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        y_TD, s_T1 = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            grad_y = torch.mul(grad_TD, s_T1, out=workspace.empty(tuple(y_TD.shape), y_TD.dtype))
            prod_TD = torch.mul(grad_TD, y_TD, out=workspace.empty(tuple(y_TD.shape), y_TD.dtype))
            grad_s = torch.sum(prod_TD, dim=1, keepdim=True,
                               out=workspace.empty(tuple(s_T1.shape), s_T1.dtype))
            grad_z = torch.ops.aten.sigmoid_backward.grad_input(
                grad_s, s_T1, grad_input=workspace.empty(tuple(s_T1.shape), s_T1.dtype))
        return grad_y, grad_z


class _AddOutputs(torch.autograd.Function):
    """``y_TD + s_TD`` into a workspace buffer; AddBackward0 hands both the same grad."""

    @staticmethod
    def forward(ctx, y_TD, s_TD):
        return torch.add(y_TD, s_TD, out=workspace.empty(tuple(y_TD.shape), y_TD.dtype))

    @staticmethod
    def backward(ctx, grad_TD):
        return grad_TD, grad_TD


def add_shared(y_TD: torch.Tensor, s_TD: torch.Tensor) -> torch.Tensor:
    """``y_TD + s_TD`` (stage 6); for same-dtype CPU tensors into the running layer's arena."""
    if (y_TD.device.type == "cpu" and y_TD.dtype == s_TD.dtype and y_TD.shape == s_TD.shape):
        return _AddOutputs.apply(y_TD, s_TD)
    return y_TD + s_TD
