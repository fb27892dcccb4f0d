"""expert_mlp: the fused grouped SwiGLU expert MLP, one autograd Function for all local experts.

Shape legend: S routed rows (grouped by expert), D hidden, F expert FFN hidden size,
L local experts; an ``_nX`` suffix is one expert's slice of n rows.

Forward, per expert e over its row slice (GEMMs write straight into preallocated [S, .] buffers):
    h = x_e @ W13_e^T          a = swiglu(h, p)  (C++ kernel)          y = a @ W2_e^T
Backward, per expert e:
    dA = dY W2    dW2 = dY^T a    (dh, dp) = swiglu_backward    dX = dh W13    dW13 = dh^T x
All stages of one expert run back to back, so each GEMM reads the previous stage's output
(~6-12 MB per expert at the standard shape) from L3 instead of DRAM, and dA needs only a
one-expert scratch buffer.
Zero-count experts get zero weight gradients. On CUDA the same math runs through
``torch.nn.functional.grouped_mm``; on CPU a per-expert ``torch.mm(out=...)`` loop measured
faster than grouped_mm for every one of the six GEMM groups (see benchmarks/test_bench_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeplug import delayed_wgrad
from moeplug.ops import cuda_ops, reference, workspace
from moeplug.ops._grouped import (cast as _cast, check_counts_and_probs, compute_dtype,
                                  expert_slices, keep_for_backward, mm_rows, row_multiple,
                                  weight_grad as _weight_grad, with_spare_rows)
from moeplug.ops._checks import check_cpu_contiguous, check_probs
from moeplug.ops.offload_marks import note
from moeplug.ops.swiglu import swiglu_backward_raw, swiglu_forward_raw
from moeplug.runtime import DTYPE_CODES


def _rows(t: torch.Tensor | None, s0: int, s1: int) -> torch.Tensor | None:
    return None if t is None else t[s0:s1]


def _scratch(max_rows: int, S: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_rows, cols] one-expert scratch whose row count varies step to step: taken from a
    buffer of min(S, next power of two) rows, so the workspace cache sees
    a few sizes instead of a new one, and a new allocation, at every distinct max_rows."""
    rows = min(S, 1 << max(0, max_rows - 1).bit_length()) if max_rows else 0
    return workspace.empty((rows, cols), dtype)[:max_rows]


class _ExpertWeights:
    """One expert's weight in the compute dtype at a time: the weight's own slice when it is in
    that dtype already, else cast into a one-expert scratch right before its GEMM. Under bf16
    autocast with fp32 weights this writes no whole-layer bf16 copy (and keeps none for
    backward, which casts again): at the standard shape the layer holds 138 MB less between
    forward and backward. No speed difference was measured (a scratch A/B of the layer against
    the square matmul: 0.814-0.818 against 0.78-0.83 before, within the noise): the backward's
    second read of the fp32 weights costs about what the whole-layer copy's write and read did."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype):
        self.w = w
        self.scratch = None if w.dtype == dtype else workspace.empty(tuple(w.shape[1:]), dtype)

    def __getitem__(self, e: int) -> torch.Tensor:
        if self.scratch is None:
            return self.w[e]
        return self.scratch.copy_(self.w[e])


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, probs_S, probs32_S, counts, w13_L2FD, w2_LDF, compute_dtype,
                recompute_act, delay_wgrad):
        # Casting inside the Function means autograd records no cast nodes: gradients come back
        # in each input's own dtype (fp32 master weights) from backward below.
        x_c = _cast(x_SD, compute_dtype)
        w13_c = _ExpertWeights(w13_L2FD, compute_dtype)
        w2_c = _ExpertWeights(w2_LDF, compute_dtype)
        S, D = x_c.shape
        F2 = w13_L2FD.shape[1]
        slices = expert_slices(counts)
        h_S2F = workspace.empty((S, F2), compute_dtype)
        y_SD = workspace.empty((S, D), compute_dtype)
        # torch.mm(out=...) is not an autocast op; the dtype choice was made above.
        # recompute_act (moe_act recompute): a is never kept whole, one expert's rows at a time
        # in a scratch buffer, rebuilt from h in backward.
        max_rows = max((s1 - s0 for _, s0, s1 in slices), default=0)
        a_SF = (_scratch(max_rows, S, F2 // 2, compute_dtype) if recompute_act else
                workspace.empty((S, F2 // 2), compute_dtype))
        # Row GEMMs over the expert's n rows and up to m - 1 more (_grouped.ROW_MULTIPLE), in
        # the experts' order: the next expert's own GEMMs overwrite what they wrote of its rows.
        m = row_multiple(x_c)
        x_g, h_g, a_g, y_g = (with_spare_rows(t) for t in (x_c, h_S2F, a_SF, y_SD))
        with torch.autocast("cpu", enabled=False):
            for e, s0, s1 in slices:
                n = s1 - s0
                mm_rows(x_g, s0, w13_c[e].t(), h_g, s0, n, m)
                a0 = 0 if recompute_act else s0  # the scratch holds one expert's rows
                swiglu_forward_raw(h_S2F[s0:s1], _rows(probs32_S, s0, s1), a_g[a0:a0 + n])
                mm_rows(a_g, a0, w2_c[e].t(), y_g, s0, n, m)
        note("expert_fc1", x_c)  # model.offload names (moeplug.modules.offload)
        note("moe_act", h_S2F)
        ctx.save_for_backward(x_c, h_S2F, None if recompute_act else a_SF, probs32_S, w13_L2FD,
                              w2_LDF)
        ctx.recompute_act = recompute_act
        keep_for_backward(ctx, x_SD, probs_S, w13_L2FD, w2_LDF, slices, delay_wgrad)
        return y_SD

    @staticmethod
    def backward(ctx, grad_SD):
        with workspace.ctx_arena(ctx):
            return _ExpertMLP._backward(ctx, grad_SD)

    @staticmethod
    def _backward(ctx, grad_SD):
        x_c, h_S2F, a_SF, probs32_S, w13, w2 = ctx.saved_tensors
        x_dtype, p_dtype, w13_dtype, w2_dtype = ctx.dtypes
        need_x, need_p, _, _, need_w13, need_w2 = ctx.needs_input_grad[:6]
        slices = ctx.slices
        dY_SD = grad_SD.to(x_c.dtype).contiguous()
        S, D = x_c.shape
        F_ = h_S2F.shape[1] // 2
        # delay_wgrad_compute: only dX and dp here; dW2 and dW13 are queued (moeplug.delayed_wgrad)
        # and run while the dispatch's backward exchange carries dX.
        delay = ctx.weights is not None and (need_w13 or need_w2)

        want_dp = need_p and probs32_S is not None
        max_rows = max((s1 - s0 for _, s0, s1 in slices), default=0)
        dA_nF = _scratch(max_rows, S, F_, x_c.dtype)  # one expert at a time: cache-sized
        dh_S2F = workspace.empty((S, 2 * F_), x_c.dtype)
        dp_S = workspace.empty((S,), torch.float32) if want_dp else None
        dX_SD = workspace.empty((S, D), x_c.dtype) if need_x else None
        m = row_multiple(x_c)  # row GEMMs over up to m - 1 more rows, as in forward
        dY_g, dA_g, dh_g = (with_spare_rows(t) for t in (dY_SD, dA_nF, dh_S2F))
        dX_g = None if dX_SD is None else with_spare_rows(dX_SD)
        w13_c, w2_c = _ExpertWeights(w13, x_c.dtype), _ExpertWeights(w2, x_c.dtype)
        wgrad = _WeightGrads(x_c, h_S2F, a_SF, probs32_S, dY_SD, dh_S2F, slices,
                             w13 if need_w13 else None, w2 if need_w2 else None)
        for e, s0, s1 in slices:
            n = s1 - s0
            mm_rows(dY_g, s0, w2_c[e], dA_g, 0, n, m)
            if not delay:
                wgrad.down(e, s0, s1)
            swiglu_backward_raw(dA_g[:n], h_S2F[s0:s1], _rows(probs32_S, s0, s1), want_dp,
                                dh_S2F[s0:s1], _rows(dp_S, s0, s1))
            if need_x:
                mm_rows(dh_g, s0, w13_c[e], dX_g, s0, n, m)
            if not delay:
                wgrad.gate_up(e, s0, s1)

        def back(t, dtype):
            return None if t is None else _cast(t, dtype)

        dW13 = dW2 = None  # delayed: summed into the weights' .grad by the queued work
        if not delay:
            dW13, dW2 = back(wgrad.dW13, w13_dtype), back(wgrad.dW2, w2_dtype)
        else:
            w13_leaf, w2_leaf = ctx.weights

            def deferred() -> None:
                for e, s0, s1 in slices:  # the same GEMMs on the same tensors, later
                    wgrad.down(e, s0, s1)
                    wgrad.gate_up(e, s0, s1)
                if need_w13:
                    delayed_wgrad.accumulate(w13_leaf, _cast(wgrad.dW13, w13_dtype))
                if need_w2:
                    delayed_wgrad.accumulate(w2_leaf, _cast(wgrad.dW2, w2_dtype))

            delayed_wgrad.defer(deferred)
        return (back(dX_SD, x_dtype), back(dp_S, p_dtype), None, None, dW13, dW2, None, None,
                None)


class _WeightGrads:
    """The experts' weight gradients, one expert at a time: dW2_e = dY_e^T a_e and
    dW13_e = dh_e^T x_e (``None`` for a weight that needs none), in the weights' own dtype. Run
    inline by the backward, or later by the delayed_wgrad queue; both call the same GEMMs.
    Weights in another dtype than the GEMMs' (fp32 under bf16 autocast): each expert's GEMM
    writes a one-expert scratch that is cast into its slice while still in cache, instead of a
    whole-layer bf16 gradient cast afterwards (the same values)."""

    def __init__(self, x_c, h_S2F, a_SF, probs32_S, dY_SD, dh_S2F, slices, w13, w2):
        self.x_c, self.h_S2F, self.a_SF, self.probs32_S = x_c, h_S2F, a_SF, probs32_S
        self.dY_SD, self.dh_S2F = dY_SD, dh_S2F
        self.dW13 = _weight_grad(w13, slices) if w13 is not None else None
        self.dW2 = _weight_grad(w2, slices) if w2 is not None else None
        self.s13, self.s2 = (None if w is None or w.dtype == x_c.dtype else
                             workspace.empty(tuple(w.shape[1:]), x_c.dtype) for w in (w13, w2))
        max_rows = max((s1 - s0 for _, s0, s1 in slices), default=0)
        # moe_act recompute: a is rebuilt from h, one expert at a time, in a scratch buffer.
        self.a_nF = (_scratch(max_rows, x_c.shape[0], h_S2F.shape[1] // 2, x_c.dtype)
                     if a_SF is None and w2 is not None else None)

    def down(self, e: int, s0: int, s1: int) -> None:
        if self.dW2 is None:
            return
        if self.a_SF is None:  # moe_act recompute: the same kernel on the same h
            a = swiglu_forward_raw(self.h_S2F[s0:s1], _rows(self.probs32_S, s0, s1),
                                   self.a_nF[:s1 - s0])
        else:
            a = self.a_SF[s0:s1]
        _mm_into(self.dY_SD[s0:s1].t(), a, self.dW2[e], self.s2)

    def gate_up(self, e: int, s0: int, s1: int) -> None:
        if self.dW13 is not None:
            _mm_into(self.dh_S2F[s0:s1].t(), self.x_c[s0:s1], self.dW13[e], self.s13)


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
             scratch: torch.Tensor | None) -> None:
    """``out = a @ b``, through ``scratch`` (the GEMMs' dtype) when ``out`` is in another."""
    if scratch is None:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b, out=scratch))


def _check(x_SD, probs_S, counts_L, w13_L2FD, w2_LDF) -> list[int]:
    op = "expert_mlp"
    if x_SD.dim() != 2:
        raise ValueError(f"{op}: x_SD must be 2-D [S, D], got shape {tuple(x_SD.shape)}. "
                         f"Fix: flatten tokens to rows first")
    S, D = x_SD.shape
    if w13_L2FD.dim() != 3 or w2_LDF.dim() != 3:
        raise ValueError(f"{op}: gate_up_proj must be [L, 2F, D] and down_proj [L, D, F]; got "
                         f"{tuple(w13_L2FD.shape)} and {tuple(w2_LDF.shape)}. Fix: pass the "
                         f"Experts module's stacked weights")
    L, F2, D13 = w13_L2FD.shape
    if F2 % 2 or D13 != D or tuple(w2_LDF.shape) != (L, D, F2 // 2):
        raise ValueError(f"{op}: weight shapes do not fit x_SD [S, D={D}]: gate_up_proj "
                         f"{tuple(w13_L2FD.shape)} (want [L, 2F, {D}]), down_proj "
                         f"{tuple(w2_LDF.shape)} (want [L, {D}, F]). Fix: check hidden_size "
                         f"and ffn_hidden_size of the experts")
    if counts_L.dtype != torch.int64 or counts_L.device.type != "cpu" or counts_L.dim() != 1:
        raise ValueError(f"{op}: counts_L must be a 1-D int64 CPU tensor, got dtype "
                         f"{counts_L.dtype} on {counts_L.device} with shape "
                         f"{tuple(counts_L.shape)}. Fix: pass Dispatched.counts_L")
    return check_counts_and_probs(op, counts_L, L, S, probs_S)


def _grouped_mm_path(x_SD, probs_S, counts, w13_L2FD, w2_LDF, compute_dtype):
    """CUDA: torch's grouped GEMM (autograd included) plus the fused CUDA SwiGLU (the plain
    one where the extension is not loaded)."""
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    if x_SD.device.type == "cuda":
        # From pinned memory, non-blocking: a pageable host->device copy would wait for the
        # stream to drain (one more host sync per layer). (This path also runs on CPU tensors.)
        offs = offs.pin_memory().to(x_SD.device, non_blocking=True)
    x_c = x_SD.to(compute_dtype)
    h_S2F = F.grouped_mm(x_c, w13_L2FD.to(compute_dtype).transpose(-2, -1), offs=offs)
    a_SF = (cuda_ops.swiglu(h_S2F, probs_S) if cuda_ops.available(h_S2F)
            else reference.swiglu(h_S2F, probs_S))
    return F.grouped_mm(a_SF, w2_LDF.to(compute_dtype).transpose(-2, -1), offs=offs)


def expert_mlp(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts_L: torch.Tensor,
               gate_up_proj_L2FD: torch.Tensor, down_proj_LDF: torch.Tensor,
               recompute_act: bool = False, delay_wgrad: bool = False) -> torch.Tensor:
    """``y_e = down_e(silu(gate_e x) * (up_e x) * p)`` for every local expert's row slice.

    ``recompute_act``: keep only FC1's output h for backward and rebuild the activation there
    (moe_act recompute; the same kernel on the same h, so gradients are identical).
    ``delay_wgrad`` (model.moe.delay_wgrad_compute): the backward returns dX and dp and queues
    the weight-gradient GEMMs (moeplug.delayed_wgrad); the same gradients land in ``.grad``.

    Differentiable w.r.t. x_SD, probs_S and both weights. Under CPU autocast the GEMMs run in
    the autocast dtype and weight gradients come back in the weights' dtype.
    """
    counts = _check(x_SD, probs_S, counts_L, gate_up_proj_L2FD, down_proj_LDF)
    dtype = compute_dtype(x_SD)
    if x_SD.device.type != "cpu":
        if delay_wgrad:  # torch's grouped_mm autograd computes dW with dX: nothing to delay
            raise ValueError(f"expert_mlp: delay_wgrad is implemented for CPU tensors only, got "
                             f"x_SD on {x_SD.device}. Fix: set model.moe.delay_wgrad_compute: "
                             f"false on GPU")
        return _grouped_mm_path(x_SD, probs_S, counts, gate_up_proj_L2FD, down_proj_LDF, dtype)
    for name, t in (("x_SD", x_SD), ("gate_up_proj", gate_up_proj_L2FD),
                    ("down_proj", down_proj_LDF)):
        check_cpu_contiguous("expert_mlp", name, t)
    if dtype not in DTYPE_CODES:
        raise TypeError(f"expert_mlp: compute dtype {dtype} (from x_SD or autocast) is "
                        f"not supported; the SwiGLU kernel takes float32 or bfloat16. Fix: pass "
                        f"x_SD.float() or run under torch.autocast('cpu', dtype=torch.bfloat16)")
    probs32_S = None if probs_S is None else check_probs("expert_mlp", "probs_S", probs_S,
                                                         (x_SD.shape[0],))
    return _ExpertMLP.apply(x_SD, probs_S, probs32_S, counts, gate_up_proj_L2FD, down_proj_LDF,
                            dtype, recompute_act, delay_wgrad)
