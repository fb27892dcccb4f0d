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

from moeplug.ops._grouped import host_counts
from moeplug.ops.activations import activation_fn
from moeplug.ops.offload_marks import note

_state = threading.local()


def active_recipe():
    """The recipe of the innermost ``recipe_scope`` on this thread, or None."""
    return getattr(_state, "recipe", None)


def row_alignment(configured: int = 1) -> int:
    """Rows-per-expert multiple for the routing: ``configured`` when set (> 1), else the active
    recipe's alignment (16 FP8, 32 MXFP8/NVFP4), else 1."""
    recipe = active_recipe()
    return configured if configured > 1 or recipe is None else recipe.row_alignment


def _quant_forward(x_MK, w_NK, recipe, key, out_dtype):
    return (recipe.fake(x_MK, "x", 1, key) @ recipe.fake(w_NK, "w", 1, key).t()).to(out_dtype)


def _quant_backward(r, key, x_MK, w_NK, g_MN, need_x: bool, need_w: bool):
    """(dx, dw) of ``_quant_forward``, each None where not needed."""
    g_MN = g_MN.float()
    dx = dw = None
    if need_x:
        dx = (r.fake(g_MN, "g", 1, key) @ r.fake(w_NK, "w", 0, key, record=False))
        dx = dx.to(x_MK.dtype)
    if need_w:
        gt, xt = r.wgrad_inputs(g_MN, x_MK.float())
        dw = (r.fake(gt, "g", 0, key, record=False).t()
              @ r.fake(xt, "x", 0, key, record=False)).to(w_NK.dtype)
    return dx, dw


class QuantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, recipe, key, out_dtype):
        ctx.save_for_backward(x_MK, w_NK)
        ctx.recipe, ctx.key = recipe, key
        return _quant_forward(x_MK, w_NK, recipe, key, out_dtype)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_NK = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        dx, dw = _quant_backward(ctx.recipe, ctx.key, x_MK, w_NK, g_MN, need_x, need_w)
        return dx, dw, None, None, None


def _act_times_probs(act, h_MX, p_M):
    a_MF = act(h_MX)  # Megatron's weighted activation: the routing weight after act
    return a_MF if p_M is None else a_MF * p_M.unsqueeze(-1).to(h_MX.dtype)


class _QuantActDown(torch.autograd.Function):
    """One expert's ``down(act(h) * p)`` through the recipe, keeping h, p and the weight but not
    the activation: backward rebuilds act(h) * p from h (moe_act recompute), with the autocast
    state of the forward, then runs the same GEMM gradients as QuantLinear."""

    @staticmethod
    def forward(ctx, h_MX, p_M, w_NF, act, recipe, key, out_dtype):
        ctx.save_for_backward(h_MX, p_M, w_NF)
        ctx.act, ctx.recipe, ctx.key = act, recipe, key
        dev = h_MX.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return _quant_forward(_act_times_probs(act, h_MX, p_M), w_NF, recipe, key, out_dtype)

    @staticmethod
    def backward(ctx, g_MN):
        h_MX, p_M, w_NF = ctx.saved_tensors
        need_h, need_p, need_w = ctx.needs_input_grad[:3]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(h_MX.device.type, dtype=dtype, enabled=enabled):
            h = h_MX.detach().requires_grad_(need_h)
            p = None if p_M is None else p_M.detach().requires_grad_(need_p)
            a_MF = _act_times_probs(ctx.act, h, p)
        da, dw = _quant_backward(ctx.recipe, ctx.key, a_MF.detach(), w_NF, g_MN,
                                 need_h or need_p, need_w)
        dh = dp = None
        wrt = [t for t in (h, p) if t is not None and t.requires_grad]
        if wrt:
            grads = iter(torch.autograd.grad(a_MF, wrt, da))
            dh = next(grads) if need_h else None
            dp = next(grads) if p is not None and need_p else None
        return dh, dp, dw, None, None, None, None


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


def quant_expert_mlp(x_SD, probs_S, counts_L, w1_LXD, w2_LDF, activation, recipe,
                     recompute_act: bool = False):
    """Every local expert's MLP with both GEMMs through ``recipe`` (rows grouped by expert): the
    quantized expert FFN, for the dynamic layer and runtime.sync_free's budget rows alike (a
    fixed B rows per expert, empty slots zero rows of weight 0: they raise no amax and add
    nothing to a weight gradient).

    ``recompute_act`` (moe_act recompute): FC2 keeps FC1's output instead of its input and
    rebuilds act(h) * p in backward (the same ops, so the same gradients). The rows and FC1's
    outputs are what model.offload's ``expert_fc1`` / ``moe_act`` mean (offload_marks.note).
    """
    act = activation_fn(activation)
    note("expert_fc1", x_SD)  # each expert's FC1 keeps a view of these rows
    ys, start = [], 0
    for e, n in enumerate(host_counts(counts_L)):
        if n == 0:  # no rows: no GEMM (and no amax of an empty tensor)
            continue
        p_n = None if probs_S is None else probs_S[start:start + n]
        ys.append(_quant_expert_rows(x_SD[start:start + n], p_n, w1_LXD, w2_LDF, e, act,
                                     recipe, recompute_act))
        start += n
    return torch.cat(ys, dim=0) if ys else x_SD.new_zeros(0, w2_LDF.shape[1])


def _quant_expert_rows(x_nD, p_n, w1_LXD, w2_LDF, e: int, act, recipe,
                       recompute_act: bool) -> torch.Tensor:
    """Local expert ``e``'s ``down(act(up(x)) * p)`` over its rows, both GEMMs through
    ``recipe`` under the keys (parameter, expert) that stateful recipes name them by; FC1's
    output is noted as ``moe_act``."""
    h_nX = quant_linear(x_nD, w1_LXD[e], None, recipe, (id(w1_LXD), e))
    note("moe_act", h_nX)
    key = (id(w2_LDF), e)
    if recompute_act:
        return _QuantActDown.apply(h_nX, p_n, w2_LDF[e], act, recipe, key, _out_dtype(h_nX))
    return quant_linear(_act_times_probs(act, h_nX, p_n), w2_LDF[e], None, recipe, key)


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
    """A factory of fresh recipe scopes for layer ``index`` of the model's ``num_blocks`` (a
    pipeline chunk passes its layers' global indices), with the plan read now: full recompute
    re-runs a block during backward, outside the plan, and must run it under the same recipe."""
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
