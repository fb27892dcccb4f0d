"""grouped_mlp: every local expert's MLP in one autograd Function, for any activation.

Shape legend: S routed rows (grouped by expert), D hidden, F expert FFN hidden size,
L local experts, X = FC1 output features (2F for gated activations, F otherwise).

The fused C++ path (:func:`moeplug.ops.expert_mlp`) covers SwiGLU; this is the torch path for
the others (see :mod:`moeplug.ops.activations`):
    forward   h_e = x_e W1_e^T (per expert)   a = act(h) * p (all rows at once)   y_e = a_e W2_e^T
    backward  dA_e = dY_e W2_e   dW2_e = dY_e^T a_e   (dh, dp) = vjp of act(h) * p
              dX_e = dh_e W1_e   dW1_e = dh_e^T x_e
Experts without rows get zero weight gradients and no GEMM. Under CPU autocast the GEMMs run in
the autocast dtype and gradients come back in each input's own dtype (fp32 master weights).
"""

from __future__ import annotations

import torch

from moeplug import delayed_wgrad
from moeplug.ops._grouped import check_counts_and_probs, compute_dtype, expert_slices
from moeplug.ops.activations import activation_fn, fc1_rows
from moeplug.ops.offload_marks import note


def _act_times_probs(h_SX: torch.Tensor, probs32_S: torch.Tensor | None, activation: str):
    a_SF = activation_fn(activation)(h_SX)
    if probs32_S is None:
        return a_SF
    # The routing weight scales the activation (Megatron weighted activation), not the rows.
    return a_SF * probs32_S.unsqueeze(-1).to(a_SF.dtype)


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, probs_S, counts, w1_LXD, w2_LDF, activation, compute_dtype,
                recompute_act, delay_wgrad):
        x_c, w1_c, w2_c = (t.to(compute_dtype).contiguous() for t in (x_SD, w1_LXD, w2_LDF))
        # Routing weights at least fp32 (as the fused kernel takes them); fp64 stays fp64.
        probs32_S = (None if probs_S is None else
                     probs_S.detach().to(torch.promote_types(probs_S.dtype, torch.float32)))
        S, D = x_c.shape
        slices = expert_slices(counts)
        h_SX = x_c.new_empty(S, w1_c.shape[1])
        y_SD = x_c.new_empty(S, D)
        with torch.autocast(x_c.device.type, enabled=False):
            for e, s0, s1 in slices:
                torch.mm(x_c[s0:s1], w1_c[e].t(), out=h_SX[s0:s1])
            a_SF = _act_times_probs(h_SX, probs32_S, activation)
            for e, s0, s1 in slices:
                torch.mm(a_SF[s0:s1], w2_c[e].t(), out=y_SD[s0:s1])
        note("expert_fc1", x_c)  # model.offload names (moeplug.modules.offload)
        note("moe_act", h_SX)
        # recompute_act (moe_act recompute): a is dropped here and rebuilt from h in backward.
        ctx.save_for_backward(x_c, h_SX, None if recompute_act else a_SF, probs32_S, w1_c, w2_c)
        ctx.slices, ctx.activation = slices, activation
        # delay_wgrad: the weights themselves (leaves), into whose .grad the deferred GEMMs sum.
        ctx.weights = ((w1_LXD, w2_LDF)
                       if delay_wgrad and delayed_wgrad.can_defer(w1_LXD, w2_LDF) else None)
        ctx.dtypes = (x_SD.dtype, None if probs_S is None else probs_S.dtype, w1_LXD.dtype,
                      w2_LDF.dtype)
        return y_SD

    @staticmethod
    def backward(ctx, grad_SD):
        x_c, h_SX, a_SF, probs32_S, w1_c, w2_c = ctx.saved_tensors
        x_dtype, p_dtype, w1_dtype, w2_dtype = ctx.dtypes
        need_x, need_p, _, need_w1, need_w2 = ctx.needs_input_grad[:5]
        slices, activation = ctx.slices, ctx.activation
        dY_SD = grad_SD.to(x_c.dtype).contiguous()
        # delay_wgrad_compute: only dX and dp here; dW2 and dW1 are queued (moeplug.delayed_wgrad)
        # and run while the dispatch's backward exchange carries dX.
        delay = ctx.weights is not None and (need_w1 or need_w2)

        def grad_w2(a_SF):
            if a_SF is None:  # moe_act recompute
                a_SF = _act_times_probs(h_SX, probs32_S, activation)
            dW2 = torch.zeros_like(w2_c)
            for e, s0, s1 in slices:
                torch.mm(dY_SD[s0:s1].t(), a_SF[s0:s1], out=dW2[e])
            return dW2

        def grad_w1(dh_SX):
            dW1 = torch.zeros_like(w1_c)
            for e, s0, s1 in slices:
                torch.mm(dh_SX[s0:s1].t(), x_c[s0:s1], out=dW1[e])
            return dW1

        with torch.autocast(x_c.device.type, enabled=False):
            if a_SF is None and need_w2 and not delay:
                a_SF = _act_times_probs(h_SX, probs32_S, activation)
            dA_SF = x_c.new_zeros(h_SX.shape[0], w2_c.shape[2])  # rows of no expert stay 0
            for e, s0, s1 in slices:
                torch.mm(dY_SD[s0:s1], w2_c[e], out=dA_SF[s0:s1])
            dW2 = grad_w2(a_SF) if need_w2 and not delay else None
            # The activation's derivative by autograd on a recomputed (cheap, elementwise) graph:
            # one implementation of every activation, forward and backward, in activations.py.
            want_dp = need_p and probs32_S is not None
            with torch.enable_grad():
                h = h_SX.detach().requires_grad_()
                p = probs32_S.detach().requires_grad_(want_dp) if probs32_S is not None else None
                a = _act_times_probs(h, p, activation)
                grads = torch.autograd.grad(a, [h, p] if want_dp else [h], dA_SF)
            dh_SX = grads[0]
            dp_S = grads[1] if want_dp else None
            dX = torch.zeros_like(x_c) if need_x else None
            for e, s0, s1 in slices:
                if need_x:
                    torch.mm(dh_SX[s0:s1], w1_c[e], out=dX[s0:s1])
            dW1 = grad_w1(dh_SX) if need_w1 and not delay else None

        def back(t, dtype):
            return None if t is None else t.to(dtype)

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
