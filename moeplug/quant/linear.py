"""Quantized GEMMs for the emulated recipes, and the context that turns them on.

``QuantLinear`` quantizes each GEMM operand along that GEMM's contraction axis, then multiplies
the dequantized values in fp32 (exact emulation: the only error is the quantization):
    forward   y  = Q(x, x, K) Q(w, w, K)^T
    backward  dx = Q(g, g, N) Q(w, w, N)        dW = Q(T g, g, M)^T Q(T x, x, M)
T is the recipe's weight-gradient transform (NVFP4's random Hadamard; identity otherwise).
Shape legend: M rows, K input features, N output features.

A precision plugin's ``autocast`` enters ``recipe_plan(recipe, bf16_first, bf16_last)``; the
model's ``run_blocks`` enters ``block_scope(i, n)`` around transformer block i of n, which makes
the recipe active for that block (unless it is one of the first/last kept in bf16). While a
recipe is active on this thread every ``F.linear`` goes through ``QuantLinear`` (attention,
dense MLP, shared experts) and the experts backends and dispatchers ask ``active_recipe()``.
Embedding, router, output head and MTP blocks stay in the autocast dtype, as in Megatron-Core.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moeplug.ops.activations import activation_fn

_state = threading.local()


def active_recipe():
    """The recipe of the innermost ``recipe_scope`` on this thread, or None."""
    return getattr(_state, "recipe", None)


def row_alignment(configured: int = 1) -> int:
    """Rows-per-expert multiple for the routing: ``configured`` when set (> 1), else the active
    recipe's alignment (16 FP8, 32 MXFP8/NVFP4), else 1."""
    recipe = active_recipe()
    return configured if configured > 1 or recipe is None else recipe.row_alignment


class QuantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, recipe, key, out_dtype):
        y_MN = recipe.fake(x_MK, "x", 1, key) @ recipe.fake(w_NK, "w", 1, key).t()
        ctx.save_for_backward(x_MK, w_NK)
        ctx.recipe, ctx.key = recipe, key
        return y_MN.to(out_dtype)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_NK = ctx.saved_tensors
        r, key = ctx.recipe, ctx.key
        g_MN = g_MN.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (r.fake(g_MN, "g", 1, key) @ r.fake(w_NK, "w", 0, key, record=False))
            dx = dx.to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            gt, xt = r.wgrad_inputs(g_MN, x_MK.float())
            dw = (r.fake(gt, "g", 0, key, record=False).t()
                  @ r.fake(xt, "x", 0, key, record=False)).to(w_NK.dtype)
        return dx, dw, None, None, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def quant_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe,
                 key=None) -> torch.Tensor:
    """``F.linear`` through ``recipe``; ``key`` names the GEMM for stateful (delayed) recipes."""
    lead = x.shape[:-1]
    y = QuantLinear.apply(x.reshape(-1, x.shape[-1]), w, recipe,
                          id(w) if key is None else key, _out_dtype(x))
    y = y.reshape(*lead, w.shape[0])
    return y if b is None else y + b.to(y.dtype)


def quant_expert_mlp(x_SD, probs_S, counts_L, w1_LXD, w2_LDF, activation, recipe):
    """Every local expert's MLP with both GEMMs through ``recipe`` (rows grouped by expert)."""
    act = activation_fn(activation)
    ys, start = [], 0
    for e, n in enumerate(counts_L.tolist()):
        if n == 0:  # no rows: no GEMM (and no amax of an empty tensor)
            continue
        x_nD = x_SD[start:start + n]
        h_nX = quant_linear(x_nD, w1_LXD[e], None, recipe, (id(w1_LXD), e))
        a_nF = act(h_nX)
        if probs_S is not None:  # Megatron weighted activation
            a_nF = a_nF * probs_S[start:start + n].unsqueeze(-1).to(h_nX.dtype)
        start += n
        ys.append(quant_linear(a_nF, w2_LDF[e], None, recipe, (id(w2_LDF), e)))
    return torch.cat(ys, dim=0) if ys else x_SD.new_zeros(0, w2_LDF.shape[1])


class _LinearMode(TorchFunctionMode):
    def __init__(self, recipe):
        super().__init__()
        self.recipe = recipe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return quant_linear(x, w, b, self.recipe)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recipe_scope(recipe):
    """Run the enclosed forward under ``recipe`` (None: full precision, e.g. bf16 layers)."""
    prev = active_recipe()
    _state.recipe = recipe
    try:
        if recipe is None:
            yield
        else:
            with _LinearMode(recipe):
                yield
    finally:
        _state.recipe = prev


@contextlib.contextmanager
def recipe_plan(recipe, bf16_first_layers: int = 0, bf16_last_layers: int = 0):
    """Make ``recipe`` the plan for the transformer blocks run inside (see ``block_scope``)."""
    prev = getattr(_state, "plan", None)
    _state.plan = (recipe, bf16_first_layers, bf16_last_layers)
    try:
        yield
    finally:
        _state.plan = prev


def block_scope_factory(index: int, num_blocks: int):
    """A factory of fresh recipe scopes for block ``index`` of the ``num_blocks`` being run (a
    pipeline chunk counts its own blocks), with the plan read now: full recompute re-runs a
    block during backward, outside the plan, and must run it under the same recipe."""
    plan = getattr(_state, "plan", None)
    if plan is None:
        return contextlib.nullcontext
    recipe, first, last = plan
    keep_bf16 = index < first or index >= num_blocks - last
    chosen = None if keep_bf16 else recipe
    return lambda: recipe_scope(chosen)


def block_scope(index: int, num_blocks: int):
    """The recipe scope for block ``index`` of the ``num_blocks`` being run; a no-op without a
    plan."""
    return block_scope_factory(index, num_blocks)()
