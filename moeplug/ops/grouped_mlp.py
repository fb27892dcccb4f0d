"""grouped_mlp: every local expert's MLP in one autograd Function, for any activation.

Shape legend: S routed rows (grouped by expert), D hidden, F expert FFN hidden size,
L local experts, X = FC1 output features (2F for gated activations, F otherwise).

The fused C++ path (:func:`moeplug.ops.expert_mlp`) covers SwiGLU; this is the torch path for
the others (see :mod:`moeplug.ops.activations`):
    forward   h_e = x_e W1_e^T (per expert)   a = act(h) * p (all rows at once)   y_e = a_e W2_e^T
    backward  dA_e = dY_e W2_e   dW2_e = dY_e^T a_e   (dh, dp) = vjp of act(h) * p
              dX_e = dh_e W1_e   dW1_e = dh_e^T x_e
The activation and its vjp are activations.py's out= versions (bitwise autograd's), and on CPU
every buffer comes from the layer's workspace: a steady-state step allocates nothing.
Experts without rows get zero weight gradients and no GEMM. Under CPU autocast the GEMMs run in
the autocast dtype and gradients come back in each input's own dtype (fp32 master weights).
"""

from __future__ import annotations

import torch

from moeplug import delayed_wgrad
from moeplug.ops import workspace
from moeplug.ops._grouped import cast as _cast, check_counts_and_probs, compute_dtype
from moeplug.ops._grouped import (expert_slices, keep_for_backward, mm_rows, row_multiple,
                                  weight_grad, with_spare_rows)
from moeplug.ops.activations import act_times_probs, act_times_probs_backward, fc1_rows
from moeplug.ops.offload_marks import note


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, probs_S, counts, w1_LXD, w2_LDF, activation, compute_dtype,
                recompute_act, delay_wgrad):
        empty = workspace.allocator(x_SD.device)
        x_c, w1_c, w2_c = (_cast(t, compute_dtype, empty) for t in (x_SD, w1_LXD, w2_LDF))
        # Routing weights at least fp32 (as the fused kernel takes them); fp64 stays fp64.
        probs32_S = (None if probs_S is None else
                     _cast(probs_S.detach(), torch.promote_types(probs_S.dtype, torch.float32),
                           empty))
        S, D = x_c.shape
        slices = expert_slices(counts)  # they cover all S rows (check_counts_and_probs)
        h_SX = empty((S, w1_c.shape[1]), x_c.dtype)
        y_SD = empty((S, D), x_c.dtype)
        # Row GEMMs over up to m - 1 rows more than the expert's (_grouped.ROW_MULTIPLE), in
        # the experts' order: the next expert's own GEMM overwrites what they wrote of its rows.
        m = row_multiple(x_c)
        with torch.autocast(x_c.device.type, enabled=False):
            x_g, h_g = with_spare_rows(x_c), with_spare_rows(h_SX)
            for e, s0, s1 in slices:
                mm_rows(x_g, s0, w1_c[e].t(), h_g, s0, s1 - s0, m)
            a_SF = act_times_probs(h_SX, probs32_S, activation, empty)
            a_g, y_g = with_spare_rows(a_SF), with_spare_rows(y_SD)
            for e, s0, s1 in slices:
                mm_rows(a_g, s0, w2_c[e].t(), y_g, s0, s1 - s0, m)
        note("expert_fc1", x_c)  # model.offload names (moeplug.modules.offload)
        note("moe_act", h_SX)
        # recompute_act (moe_act recompute): a is dropped here and rebuilt from h in backward.
        ctx.save_for_backward(x_c, h_SX, None if recompute_act else a_SF, probs32_S, w1_c, w2_c)
        ctx.activation = activation
        keep_for_backward(ctx, x_SD, probs_S, w1_LXD, w2_LDF, slices, delay_wgrad)
        return y_SD

    @staticmethod
    def backward(ctx, grad_SD):
        with workspace.ctx_arena(ctx):
            return _GroupedMLP._backward(ctx, grad_SD)

    @staticmethod
    def _backward(ctx, grad_SD):
        x_c, h_SX, a_SF, probs32_S, w1_c, w2_c = ctx.saved_tensors
        x_dtype, p_dtype, w1_dtype, w2_dtype = ctx.dtypes
        need_x, need_p, _, need_w1, need_w2 = ctx.needs_input_grad[:5]
        slices, activation = ctx.slices, ctx.activation
        empty = workspace.allocator(x_c.device)
        dY_SD = _cast(grad_SD, x_c.dtype, empty)
        # delay_wgrad_compute: only dX and dp here; dW2 and dW1 are queued (moeplug.delayed_wgrad)
        # and run while the dispatch's backward exchange carries dX.
        delay = ctx.weights is not None and (need_w1 or need_w2)

        def grad_w2(a_SF):
            if a_SF is None:  # moe_act recompute
                a_SF = act_times_probs(h_SX, probs32_S, activation, empty)
            dW2 = weight_grad(w2_c, slices, empty)
            for e, s0, s1 in slices:
                torch.mm(dY_SD[s0:s1].t(), a_SF[s0:s1], out=dW2[e])
            return dW2

        def grad_w1(dh_SX):
            dW1 = weight_grad(w1_c, slices, empty)
            for e, s0, s1 in slices:
                torch.mm(dh_SX[s0:s1].t(), x_c[s0:s1], out=dW1[e])
            return dW1

        with torch.autocast(x_c.device.type, enabled=False):
            if a_SF is None and need_w2 and not delay:
                a_SF = act_times_probs(h_SX, probs32_S, activation, empty)
            dA_SF = empty((h_SX.shape[0], w2_c.shape[2]), x_c.dtype)
            m = row_multiple(x_c)  # row GEMMs over up to m - 1 more rows, as in forward
            dY_g, dA_g = with_spare_rows(dY_SD), with_spare_rows(dA_SF)
            for e, s0, s1 in slices:
                mm_rows(dY_g, s0, w2_c[e], dA_g, s0, s1 - s0, m)
            dW2 = grad_w2(a_SF) if need_w2 and not delay else None
            # The activation's vector-Jacobian product: the ops autograd would run for
            # activations.py's composition, into workspace buffers.
            want_dp = need_p and probs32_S is not None
            dh_SX, dp_S = act_times_probs_backward(dA_SF, h_SX, probs32_S, activation, want_dp,
                                                   empty)
            dX = None
            if need_x:
                dX = empty(tuple(x_c.shape), x_c.dtype)
                dh_g, dX_g = with_spare_rows(dh_SX), with_spare_rows(dX)
                for e, s0, s1 in slices:
                    mm_rows(dh_g, s0, w1_c[e], dX_g, s0, s1 - s0, m)
            dW1 = grad_w1(dh_SX) if need_w1 and not delay else None

        def back(t, dtype):
            return None if t is None else _cast(t, dtype, empty)

        if delay:
            w1, w2 = ctx.weights

            def deferred() -> None:  # the same GEMMs on the same tensors, later
                with torch.autocast(x_c.device.type, enabled=False):
                    if need_w2:
                        delayed_wgrad.accumulate(w2, back(grad_w2(a_SF), w2_dtype))
                    if need_w1:
                        delayed_wgrad.accumulate(w1, back(grad_w1(dh_SX), w1_dtype))

            delayed_wgrad.defer(deferred)
        return (back(dX, x_dtype), back(dp_S, p_dtype), None, back(dW1, w1_dtype),
                back(dW2, w2_dtype), None, None, None, None)


def _check(x_SD, probs_S, counts_L, w1_LXD, w2_LDF, activation) -> list[int]:
    op = "grouped_mlp"
    if x_SD.dim() != 2 or w1_LXD.dim() != 3 or w2_LDF.dim() != 3:
        raise ValueError(f"{op}: want x_SD [S, D], gate_up_proj [L, X, D], down_proj [L, D, F]; "
                         f"got {tuple(x_SD.shape)}, {tuple(w1_LXD.shape)}, {tuple(w2_LDF.shape)}. "
                         f"Fix: flatten tokens to rows and pass the Experts' stacked weights")
    S, D = x_SD.shape
    L, X, D1 = w1_LXD.shape
    Fh = w2_LDF.shape[2]
    if D1 != D or tuple(w2_LDF.shape) != (L, D, Fh) or X != fc1_rows(activation, Fh):
        raise ValueError(f"{op}: with activation {activation!r} and x_SD [S, D={D}], want "
                         f"gate_up_proj [L, {fc1_rows(activation, Fh)}, {D}] and down_proj "
                         f"[L, {D}, F={Fh}]; got {tuple(w1_LXD.shape)} and "
                         f"{tuple(w2_LDF.shape)}. Fix: build the experts with the same "
                         f"activation, hidden_size and ffn_hidden_size")
    return check_counts_and_probs(op, counts_L, L, S, probs_S)


def grouped_mlp(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts_L: torch.Tensor,
                gate_up_proj_LXD: torch.Tensor, down_proj_LDF: torch.Tensor,
                activation: str, recompute_act: bool = False,
                delay_wgrad: bool = False) -> torch.Tensor:
    """``y_e = down_e(act(gate_up_e x) * p)`` for every local expert's row slice.

    ``recompute_act``: keep only FC1's output for backward, rebuild act(h) * p there.
    ``delay_wgrad`` (model.moe.delay_wgrad_compute): the backward returns dX and dp and queues
    the weight-gradient GEMMs (moeplug.delayed_wgrad); the same gradients land in ``.grad``.

    Differentiable w.r.t. x_SD, probs_S and both weights; ``probs_S=None`` means p = 1.
    """
    counts = _check(x_SD, probs_S, counts_L, gate_up_proj_LXD, down_proj_LDF, activation)
    if delay_wgrad and x_SD.device.type != "cpu":
        # CUDA autograd runs backwards on its device threads: the per-thread queue
        # (moeplug.delayed_wgrad) is only proven on CPU.
        raise ValueError(f"grouped_mlp: delay_wgrad is implemented for CPU tensors only, got "
                         f"x_SD on {x_SD.device}. Fix: set model.moe.delay_wgrad_compute: "
                         f"false on GPU")
    return _GroupedMLP.apply(x_SD, probs_S, counts, gate_up_proj_LXD, down_proj_LDF, activation,
                             compute_dtype(x_SD), recompute_act, delay_wgrad)
