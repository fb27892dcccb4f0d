"""grouped_ffn: the routed experts' FFN, every local expert in one autograd Function, for every
activation and every mode that runs the grouped experts backend off a GPU.

Legend: G chunks, S rows of a chunk (grouped by expert), D hidden, X FC1 features (2F for gated
activations, F otherwise), F expert FFN hidden, L local experts; ``_nX`` one expert's n rows.

Per chunk and local expert e, over its rows (expert-contiguous, ``counts[g, e]`` of them):
    forward   h = x_e W13_e^T      a = act(h) * p      y = a W2_e^T
    backward  dA = dY W2   dW2 = dY^T a   (dh, dp) = vjp of act(h) * p   dX = dh W13
              dW13 = dh^T x
Two schedules, chosen by the activation's kernel:
  * SwiGLU in fp32/bf16 on the CPU: the runtime's fused kernel (moeplug.ops.swiglu), which
    computes every row on its own. All stages of one expert run back to back, so each GEMM
    reads the previous stage's output (~6-12 MB per expert at the standard shape) from L3
    instead of DRAM, and dA (and under moe_act recompute the activation) needs only a
    one-expert buffer.
  * every other activation (moeplug.ops.activations, torch's kernels, any device): FC1 for every
    expert, one activation call over the chunk's routed rows, FC2 for every expert. torch's
    elementwise kernels take the last elements of a call on a scalar path whose result may
    differ in the last bit from the vector one, so the call is over the same rows whatever the
    experts' counts: the bits do not depend on where the expert boundaries fall.
GEMMs run in the autocast dtype (each expert's weight cast into a one-expert buffer right
before its GEMM, in forward and again in backward: no whole-layer low-precision copy is kept),
bf16 row GEMMs over each expert's rows rounded up to ``_grouped.ROW_MULTIPLE``; every buffer
comes from the running layer's workspace arena, so a steady-state step allocates nothing.
Gradients come back in each input's own dtype; experts without rows get zero weight gradients.

Entry points (one Function under all three):
    expert_mlp(x_SD, probs_S, counts_L, w13, w2)              SwiGLU, the fused kernel
    grouped_mlp(x_SD, probs_S, counts_L, w13, w2, activation)  any activation
        the dynamic layer: one chunk, every row routed; ``recompute_act`` (moe_act recompute:
        keep FC1's output, rebuild the activation in backward) and ``delay_wgrad``
        (model.moe.delay_wgrad_compute: the weight-gradient GEMMs queued, moeplug.ops.delayed_wgrad)
    grouped_ffn_packed(x_GSD, counts_GL, w13, w2, activation)
        runtime.sync_free's budgeted rows on the CPU (Experts.forward_packed): G source chunks,
        each chunk's routed rows first and padding after (left unwritten), no routing weight
        (the budgeted combine applies it), FC1's output kept and the activation rebuilt
On budget rows the forward's and the backward's bodies each run as one registered op
(torch.library), which reads the counts itself, as a GPU's grouped GEMM reads its group sizes
on the device: the host-sync counter (moeplug.testing.hostsync) sees the op, not the host read
of a CPU tensor (the dynamic layer reads its counts on the host anyway).
Under torch.compile (runtime.capture) the packed form is one custom op with a fake kernel,
running the same bodies.
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug.ops import delayed_wgrad
from moeplug.runtime import workspace
from moeplug.ops._checks import check_cpu_contiguous, check_probs
from moeplug.ops._grouped import (cast as _cast, check_counts_and_probs, compute_dtype,
                                  expert_slices, mm_rows, row_multiple, with_spare_rows)
from moeplug.ops.activations import (act_into, act_times_probs_backward, act_width, fc1_rows,
                                     _probs_col)
from moeplug.ops.offload_marks import note
from moeplug.ops.swiglu import swiglu_backward_raw, swiglu_forward_raw
from moeplug.runtime import DTYPE_CODES

Slices = list[list[tuple[int, int, int]]]  # per chunk: (expert, first row, end row) with rows


def _rows(t: torch.Tensor | None, s0: int, s1: int) -> torch.Tensor | None:
    return None if t is None else t[s0:s1]


def fused_schedule(activation: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the runtime's row-local SwiGLU kernel can run (fp32/bf16 CPU tensors)."""
    return activation == "swiglu" and device.type == "cpu" and dtype in DTYPE_CODES


def _scratch(empty: workspace.Empty, max_rows: int, S: int, cols: int,
             dtype: torch.dtype) -> torch.Tensor:
    """[max_rows, cols] one-expert scratch whose row count varies step to step: taken from a
    buffer of min(S, next power of two) rows, so the workspace sees a few sizes instead of a
    new one, and a new allocation, at every distinct max_rows."""
    rows = min(S, 1 << max(0, max_rows - 1).bit_length()) if max_rows else 0
    return empty((rows, cols), dtype)[:max_rows]


class _ExpertWeights:
    """One expert's weight in the compute dtype at a time: the weight's own slice when it is in
    that dtype already, else cast into a one-expert scratch right before its GEMM. Under bf16
    autocast with fp32 weights this writes no whole-layer bf16 copy (and keeps none for
    backward, which casts again): at the standard shape the layer holds 138 MB less between
    forward and backward. No speed difference was measured (a scratch A/B of the layer against
    the square matmul: 0.814-0.818 against 0.78-0.83 before, within the noise): the backward's
    second read of the fp32 weights costs about what the whole-layer copy's write and read did."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, empty: workspace.Empty):
        self.w = w
        self.scratch = None if w.dtype == dtype else empty(tuple(w.shape[1:]), dtype)

    def __getitem__(self, e: int) -> torch.Tensor:
        if self.scratch is None:
            return self.w[e]
        return self.scratch.copy_(self.w[e])


def _max_rows(slices: Slices) -> int:
    return max((s1 - s0 for chunk in slices for _, s0, s1 in chunk), default=0)


def _routed(chunk: list[tuple[int, int, int]]) -> int:
    return chunk[-1][2] if chunk else 0  # the chunk's routed rows run from its first row


# ---- the bodies ------------------------------------------------------------------------------

def _forward(x_GSD: torch.Tensor, p_GS: torch.Tensor | None, slices: Slices,
             w13_LXD: torch.Tensor, w2_LDF: torch.Tensor, activation: str, fused: bool,
             keep_act: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(h, a or None, y) for x in the compute dtype; ``keep_act`` (one chunk only): a is kept
    for backward, else it lives in scratch and backward rebuilds it from h. ``fused``: the
    schedule of the runtime's SwiGLU kernel (:func:`fused_schedule`)."""
    G, S, D = x_GSD.shape
    dtype, empty = x_GSD.dtype, workspace.allocator(x_GSD.device)
    w13, w2 = _ExpertWeights(w13_LXD, dtype, empty), _ExpertWeights(w2_LDF, dtype, empty)
    X, F = w13_LXD.shape[1], w2_LDF.shape[2]
    h_GSX, y_GSD = empty((G, S, X), dtype), empty((G, S, D), dtype)
    a_SF = None
    if keep_act:
        a_SF = empty((S, F), dtype)
    elif fused:  # one expert's rows at a time
        a_SF = _scratch(empty, _max_rows(slices), S, F, dtype)
    m = row_multiple(x_GSD)
    with torch.autocast(x_GSD.device.type, enabled=False):  # mm(out=) is no autocast op
        for g, chunk in enumerate(slices):
            # Row GEMMs over an expert's n rows and up to m - 1 more (_grouped.ROW_MULTIPLE),
            # chunk after chunk, expert after expert: a later GEMM overwrites what an earlier
            # one wrote of its rows.
            x_g, h_g, y_g = (with_spare_rows(t[g]) for t in (x_GSD, h_GSX, y_GSD))
            p_S = None if p_GS is None else p_GS[g]
            if fused:
                a_g = with_spare_rows(a_SF)
                for e, s0, s1 in chunk:
                    n, a0 = s1 - s0, s0 if keep_act else 0
                    mm_rows(x_g, s0, w13[e].t(), h_g, s0, n, m)
                    swiglu_forward_raw(h_GSX[g, s0:s1], _rows(p_S, s0, s1), a_SF[a0:a0 + n])
                    mm_rows(a_g, a0, w2[e].t(), y_g, s0, n, m)
                continue
            for e, s0, s1 in chunk:
                mm_rows(x_g, s0, w13[e].t(), h_g, s0, s1 - s0, m)
            a_cSF = _act_times_probs_into(h_GSX[g], p_S, activation, _routed(chunk),
                                          a_SF if keep_act else empty((S, F), dtype), empty)
            a_g = with_spare_rows(a_cSF)
            for e, s0, s1 in chunk:
                mm_rows(a_g, s0, w2[e].t(), y_g, s0, s1 - s0, m)
    return h_GSX, a_SF if keep_act else None, y_GSD


def _act_times_probs_into(h_SX: torch.Tensor, p_S: torch.Tensor | None, activation: str,
                          n: int, a_SF: torch.Tensor, empty: workspace.Empty) -> torch.Tensor:
    """a[:n] = act(h[:n]) * p[:n] (moeplug.ops.activations.act_times_probs, into a_SF); the
    rows past n are left as they are."""
    if n:
        a_nF = act_into(h_SX[:n], activation, a_SF[:n])
        if p_S is not None:
            torch.mul(a_nF, _probs_col(p_S[:n], a_nF.dtype, empty), out=a_nF)
    return a_SF


def _act_times_probs(h_SX: torch.Tensor, p_S: torch.Tensor | None, activation: str, n: int,
                     empty: workspace.Empty) -> torch.Tensor:
    S, X = h_SX.shape
    return _act_times_probs_into(h_SX, p_S, activation, n,
                                 empty((S, act_width(activation, X)), h_SX.dtype), empty)


class _WeightGrads:
    """dW2_e = dY_e^T a_e and dW13_e = dh_e^T x_e in the weights' dtype (``None`` for a weight
    that needs none); experts without rows get zeros. One chunk: each expert's GEMM writes its
    slice (through a one-expert scratch when the GEMMs' dtype differs, cast while still in
    cache). More chunks (budget rows from several source ranks): each expert's GEMMs summed
    over the chunks in the GEMMs' dtype, the first into its slice and each later one added,
    as autograd sums per-chunk grads, then cast once. Run inline by the backward, or later by
    the delayed_wgrad queue: the same GEMMs on the same tensors either way."""

    def __init__(self, w13: torch.Tensor | None, w2: torch.Tensor | None, slices: Slices,
                 dtype: torch.dtype, empty: workspace.Empty):
        used = {e for chunk in slices for e, _, _ in chunk}
        self.empty, self.chunks = empty, len(slices)
        self.grads = {name: None if w is None else self._zeroed(w, used, dtype)
                      for name, w in (("w13", w13), ("w2", w2))}
        self.scratch = {name: None if g is None or (g.dtype == dtype and self.chunks == 1)
                        else empty(tuple(g.shape[1:]), dtype) for name, g in self.grads.items()}
        self.written: set[tuple[str, int]] = set()

    def _zeroed(self, w: torch.Tensor, used: set[int], dtype: torch.dtype) -> torch.Tensor:
        grad = self.empty(tuple(w.shape), w.dtype if self.chunks == 1 else dtype)
        for e in range(grad.shape[0]):
            if e not in used:
                grad[e].zero_()
        return grad

    def _mm(self, name: str, e: int, a: torch.Tensor, b: torch.Tensor) -> None:
        out, scratch = self.grads[name], self.scratch[name]
        if scratch is None:
            torch.mm(a, b, out=out[e])
        elif self.chunks == 1:
            out[e].copy_(torch.mm(a, b, out=scratch))
        elif (name, e) not in self.written:
            torch.mm(a, b, out=out[e])
        else:
            out[e].add_(torch.mm(a, b, out=scratch))
        self.written.add((name, e))

    def down(self, e: int, dY_nD: torch.Tensor, a_nF: torch.Tensor) -> None:
        if self.grads["w2"] is not None:
            self._mm("w2", e, dY_nD.t(), a_nF)

    def gate_up(self, e: int, dh_nX: torch.Tensor, x_nD: torch.Tensor) -> None:
        if self.grads["w13"] is not None:
            self._mm("w13", e, dh_nX.t(), x_nD)

    def result(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple:
        return tuple(None if g is None else _cast(g, w.dtype, self.empty)
                     for g, w in ((self.grads["w13"], w13), (self.grads["w2"], w2)))


def _backward(dY_GSD: torch.Tensor, x_GSD: torch.Tensor, h_GSX: torch.Tensor,
              a_SF: torch.Tensor | None, p_GS: torch.Tensor | None, slices: Slices,
              w13_LXD: torch.Tensor, w2_LDF: torch.Tensor, activation: str, fused: bool,
              need: tuple[bool, bool, bool, bool], delay: bool) -> list:
    """[dX, dp, dW13, dW2] (None where not needed; dX and dp in the GEMMs' and the weights'
    dtypes, the weights' grads in theirs); with ``delay`` (one chunk) the weight grads are
    queued on moeplug.ops.delayed_wgrad (summed into the weights' .grad there) and come back None."""
    G, S, D = x_GSD.shape
    dtype, empty = x_GSD.dtype, workspace.allocator(x_GSD.device)
    need_x, need_p, need_w13, need_w2 = need
    X, F = h_GSX.shape[2], w2_LDF.shape[2]
    delay = delay and (need_w13 or need_w2)
    w13, w2 = _ExpertWeights(w13_LXD, dtype, empty), _ExpertWeights(w2_LDF, dtype, empty)
    wgrad = _WeightGrads(w13_LXD if need_w13 else None, w2_LDF if need_w2 else None, slices,
                         dtype, empty)
    want_dp = need_p and p_GS is not None
    dX_GSD = empty((G, S, D), dtype) if need_x else None
    dp_GS = empty((G, S), p_GS.dtype) if want_dp else None
    max_rows = _max_rows(slices)
    m = row_multiple(x_GSD)
    # moe_act recompute: a is rebuilt from h (in the fused schedule one expert at a time).
    a_nF = (_scratch(empty, max_rows, S, F, dtype) if a_SF is None and fused and need_w2
            else None)
    with torch.autocast(x_GSD.device.type, enabled=False):
        for g, chunk in enumerate(slices):
            x_S, h_S, dY_S = x_GSD[g], h_GSX[g], dY_GSD[g]
            p_S = None if p_GS is None else p_GS[g]
            dp_S = None if dp_GS is None else dp_GS[g]
            dY_g = with_spare_rows(dY_S)
            dX_g = None if dX_GSD is None else with_spare_rows(dX_GSD[g])
            if fused:
                dA_nF = _scratch(empty, max_rows, S, F, dtype)  # one expert: cache-sized
                dA_g = with_spare_rows(dA_nF)
                dh_SX = empty((S, X), dtype)
                dh_g = with_spare_rows(dh_SX)
                for e, s0, s1 in chunk:
                    n = s1 - s0
                    mm_rows(dY_g, s0, w2[e], dA_g, 0, n, m)
                    if not delay:
                        _down_fused(wgrad, e, s0, s1, dY_S, h_S, p_S, a_SF, a_nF)
                    swiglu_backward_raw(dA_nF[:n], h_S[s0:s1], _rows(p_S, s0, s1), want_dp,
                                        dh_SX[s0:s1], _rows(dp_S, s0, s1))
                    if dX_g is not None:
                        mm_rows(dh_g, s0, w13[e], dX_g, s0, n, m)
                    if not delay:
                        wgrad.gate_up(e, dh_SX[s0:s1], x_S[s0:s1])
                if delay:
                    _defer(wgrad, w13_LXD, w2_LDF, x_GSD.device.type, [
                        lambda e=e, s0=s0, s1=s1: (
                            _down_fused(wgrad, e, s0, s1, dY_S, h_S, p_S, a_SF, a_nF),
                            wgrad.gate_up(e, dh_SX[s0:s1], x_S[s0:s1]))
                        for e, s0, s1 in chunk])
                continue
            n = _routed(chunk)
            if n == 0 and S:  # budget rows of no choice: nothing to compute
                continue
            dA_SF = empty((S, F), dtype)
            dA_g = with_spare_rows(dA_SF)
            a_S = a_SF
            if need_w2 and a_S is None and not delay:  # moe_act recompute: the same ops
                a_S = _act_times_probs(h_S, p_S, activation, n, empty)
            for e, s0, s1 in chunk:
                mm_rows(dY_g, s0, w2[e], dA_g, s0, s1 - s0, m)
            if need_w2 and not delay:
                for e, s0, s1 in chunk:
                    wgrad.down(e, dY_S[s0:s1], a_S[s0:s1])
            # The activation's vector-Jacobian product over the routed rows: the ops autograd
            # would run for activations.py's composition, into workspace buffers.
            dh_nX, dp_n = act_times_probs_backward(dA_SF[:n], h_S[:n], _rows(p_S, 0, n),
                                                   activation, want_dp, empty)
            if n < S:  # budget rows: into the chunk's buffer, the padding rows unwritten
                dh_SX = empty((S, X), dtype)
                dh_nX = dh_SX[:n].copy_(dh_nX)
            if dp_n is not None:
                dp_S[:n].copy_(dp_n)
            dh_g = with_spare_rows(dh_nX if n == S else dh_SX)
            if dX_g is not None:
                for e, s0, s1 in chunk:
                    mm_rows(dh_g, s0, w13[e], dX_g, s0, s1 - s0, m)
            if delay:
                _defer(wgrad, w13_LXD, w2_LDF, x_GSD.device.type, [
                    lambda a=a_S, h=h_S, p=p_S, n=n, dh=dh_g, dY=dY_S, x=x_S, chunk=chunk:
                        _staged_wgrads(wgrad, chunk, dY, a, h, p, n, dh, x, activation, empty)])
                continue
            for e, s0, s1 in chunk:
                wgrad.gate_up(e, dh_g[s0:s1], x_S[s0:s1])
    if delay:
        return [dX_GSD, dp_GS, None, None]
    return [dX_GSD, dp_GS, *wgrad.result(w13_LXD, w2_LDF)]


def _down_fused(wgrad: _WeightGrads, e: int, s0: int, s1: int, dY_S: torch.Tensor,
                h_S: torch.Tensor, p_S: torch.Tensor | None, a_SF: torch.Tensor | None,
                a_nF: torch.Tensor | None) -> None:
    """dW2 of expert e in the fused schedule; under moe_act recompute its activation is rebuilt
    by the same kernel on the same h."""
    if a_nF is None and a_SF is None:
        return  # no grad for w2
    a = a_SF[s0:s1] if a_SF is not None else swiglu_forward_raw(h_S[s0:s1], _rows(p_S, s0, s1),
                                                                 a_nF[:s1 - s0])
    wgrad.down(e, dY_S[s0:s1], a)


def _staged_wgrads(wgrad: _WeightGrads, chunk: list, dY_S: torch.Tensor,
                   a_S: torch.Tensor | None, h_S: torch.Tensor, p_S: torch.Tensor | None,
                   n: int, dh_g: torch.Tensor, x_S: torch.Tensor, activation: str,
                   empty: workspace.Empty) -> None:
    """The staged schedule's weight grads, queued (delay_wgrad): dW2 (a rebuilt under moe_act
    recompute), then dW13."""
    if wgrad.grads["w2"] is not None:
        a = a_S if a_S is not None else _act_times_probs(h_S, p_S, activation, n, empty)
        for e, s0, s1 in chunk:
            wgrad.down(e, dY_S[s0:s1], a[s0:s1])
    for e, s0, s1 in chunk:
        wgrad.gate_up(e, dh_g[s0:s1], x_S[s0:s1])


def _defer(wgrad: _WeightGrads, w13: torch.Tensor, w2: torch.Tensor, device_type: str,
           steps: list) -> None:
    """Queue the weight-gradient GEMMs (moeplug.ops.delayed_wgrad): they run while the dispatch's
    backward exchange carries dX, and sum into the weights' .grad."""
    def work() -> None:  # the same GEMMs on the same tensors, later
        with torch.autocast(device_type, enabled=False):
            for step in steps:
                step()
            dW13, dW2 = wgrad.result(w13, w2)
        if dW13 is not None:
            delayed_wgrad.accumulate(w13, dW13)
        if dW2 is not None:
            delayed_wgrad.accumulate(w2, dW2)
    delayed_wgrad.defer(work)


# ---- the ops: each body as one registered op, which reads the counts itself --------------------

def _slices(counts_GL: torch.Tensor) -> Slices:
    return [expert_slices(c) for c in counts_GL.tolist()]


_lib = torch.library.Library("moeplug", "FRAGMENT")
_lib.define("grouped_ffn_forward(Tensor x, Tensor? p, Tensor counts, Tensor w13, Tensor w2, "
            "str activation, bool fused, bool keep_act) -> Tensor[]")
_lib.define("grouped_ffn_backward(Tensor g, Tensor x, Tensor h, Tensor? a, Tensor? p, "
            "Tensor counts, Tensor w13, Tensor w2, str activation, bool fused, bool[4] need, "
            "bool delay) -> Tensor?[]")


def _forward_kernel(x, p, counts, w13, w2, activation, fused, keep_act):
    h, a, y = _forward(x, p, _slices(counts), w13, w2, activation, fused, keep_act)
    return [h, y] if a is None else [h, y, a]


def _backward_kernel(g, x, h, a, p, counts, w13, w2, activation, fused, need, delay):
    return _backward(g, x, h, a, p, _slices(counts), w13, w2, activation, fused, tuple(need),
                     delay)


for _key in ("CPU", "CUDA"):
    _lib.impl("grouped_ffn_forward", _forward_kernel, _key)
    _lib.impl("grouped_ffn_backward", _backward_kernel, _key)


class _GroupedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_GSD, probs_GS, counts_GL, w13_LXD, w2_LDF, activation, dtype, fused,
                keep_act, delay_wgrad, packed):
        # Casting inside the Function means autograd records no cast nodes: gradients come back
        # in each input's own dtype (fp32 master weights) from backward below.
        empty = workspace.allocator(x_GSD.device)
        G, S, D = x_GSD.shape
        x_c = _cast(x_GSD, dtype, empty)
        # Routing weights at least fp32 (as the fused kernel takes them); fp64 stays fp64.
        p32 = (None if probs_GS is None else
               _cast(probs_GS.detach(), torch.promote_types(probs_GS.dtype, torch.float32),
                     empty))
        # Budget rows: the counts are the static region's, read inside the op (see above).
        forward = torch.ops.moeplug.grouped_ffn_forward if packed else _forward_kernel
        out = forward(x_c, p32, counts_GL, w13_LXD, w2_LDF, activation, fused, keep_act)
        h, y = out[0], out[1]
        note("expert_fc1", x_c)  # model.offload names (moeplug.modules.offload)
        note("moe_act", h)
        # Saved as 2-D rows: what the paged stash packs into its pages (moeplug.runtime.stash).
        ctx.save_for_backward(x_c.view(G * S, D), h.view(G * S, h.shape[2]),
                              out[2] if keep_act else None,
                              None if p32 is None else p32.view(-1), w13_LXD, w2_LDF)
        ctx.counts, ctx.rows = counts_GL, (G, S)  # a few ints: kept out of the stash's pages
        ctx.activation, ctx.fused, ctx.packed = activation, fused, packed
        ctx.arena = workspace.current_arena()
        ctx.delay = delay_wgrad and delayed_wgrad.can_defer(w13_LXD, w2_LDF)
        ctx.dtypes = (x_GSD.dtype, None if probs_GS is None else probs_GS.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_GSD):
        x_2D, h_2X, a, p32, w13, w2 = ctx.saved_tensors
        G, S = ctx.rows
        x_c, h = x_2D.view(G, S, x_2D.shape[1]), h_2X.view(G, S, h_2X.shape[1])
        with workspace.ctx_arena(ctx):
            empty = workspace.allocator(x_c.device)
            need = [bool(ctx.needs_input_grad[i]) for i in (0, 1, 3, 4)]
            backward = torch.ops.moeplug.grouped_ffn_backward if ctx.packed else _backward_kernel
            grads = backward(
                _cast(grad_GSD, x_c.dtype, empty), x_c, h, a,
                None if p32 is None else p32.view(G, S), ctx.counts, w13, w2, ctx.activation,
                ctx.fused, need, ctx.delay)
            dX, dp = (None if t is None else _cast(t, d, empty)
                      for t, d in zip(grads[:2], ctx.dtypes))
        return dX, dp, None, grads[2], grads[3], None, None, None, None, None, None


def _run(x_SD, probs_S, counts_L, w13, w2, activation, fused, recompute_act, delay_wgrad):
    """The dynamic layer's call: one chunk, every row routed (views in and out: their backward
    allocates nothing)."""
    y = _GroupedFFN.apply(x_SD.unsqueeze(0), None if probs_S is None else probs_S.unsqueeze(0),
                          counts_L.view(1, -1), w13, w2, activation, compute_dtype(x_SD),
                          fused, not recompute_act, delay_wgrad, False)
    return y.squeeze(0)


# ---- the dynamic layer's entry points ----------------------------------------------------------

def _check_swiglu(x_SD, probs_S, counts_L, w13_L2FD, w2_LDF) -> None:
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
    check_counts_and_probs(op, counts_L, L, S, probs_S)


def expert_mlp(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts_L: torch.Tensor,
               gate_up_proj_L2FD: torch.Tensor, down_proj_LDF: torch.Tensor,
               recompute_act: bool = False, delay_wgrad: bool = False) -> torch.Tensor:
    """``y_e = down_e(silu(gate_e x) * (up_e x) * p)`` for every local expert's row slice, on
    the CPU with the runtime's fused SwiGLU kernel (CUDA tensors: moeplug.ops.cuda_ffn).

    ``recompute_act``: keep only FC1's output h for backward and rebuild the activation there
    (moe_act recompute; the same kernel on the same h, so gradients are identical).
    ``delay_wgrad`` (model.moe.delay_wgrad_compute): the backward returns dX and dp and queues
    the weight-gradient GEMMs (moeplug.ops.delayed_wgrad); the same gradients land in ``.grad``.

    Differentiable w.r.t. x_SD, probs_S and both weights. Under CPU autocast the GEMMs run in
    the autocast dtype and weight gradients come back in the weights' dtype.
    """
    _check_swiglu(x_SD, probs_S, counts_L, gate_up_proj_L2FD, down_proj_LDF)
    dtype = compute_dtype(x_SD)
    if x_SD.device.type != "cpu":
        if delay_wgrad:  # torch's grouped_mm autograd computes dW with dX: nothing to delay
            raise ValueError(f"expert_mlp: delay_wgrad is implemented for CPU tensors only, got "
                             f"x_SD on {x_SD.device}. Fix: set model.moe.delay_wgrad_compute: "
                             f"false on GPU")
        from moeplug.ops.cuda_ffn import grouped_mm_ffn
        return grouped_mm_ffn(x_SD, probs_S, counts_L.tolist(), gate_up_proj_L2FD,
                              down_proj_LDF, dtype, recompute_act)
    for name, t in (("x_SD", x_SD), ("gate_up_proj", gate_up_proj_L2FD),
                    ("down_proj", down_proj_LDF)):
        check_cpu_contiguous("expert_mlp", name, t)
    if dtype not in DTYPE_CODES:
        raise TypeError(f"expert_mlp: compute dtype {dtype} (from x_SD or autocast) is "
                        f"not supported; the SwiGLU kernel takes float32 or bfloat16. Fix: pass "
                        f"x_SD.float() or run under torch.autocast('cpu', dtype=torch.bfloat16)")
    if probs_S is not None:
        check_probs("expert_mlp", "probs_S", probs_S, (x_SD.shape[0],))
    return _run(x_SD, probs_S, counts_L, gate_up_proj_L2FD, down_proj_LDF, "swiglu", True,
                recompute_act, delay_wgrad)


def _check_activation(x_SD, probs_S, counts_L, w1_LXD, w2_LDF, activation) -> None:
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
    check_counts_and_probs(op, counts_L, L, S, probs_S)


def grouped_mlp(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts_L: torch.Tensor,
                gate_up_proj_LXD: torch.Tensor, down_proj_LDF: torch.Tensor,
                activation: str, recompute_act: bool = False,
                delay_wgrad: bool = False) -> torch.Tensor:
    """``y_e = down_e(act(gate_up_e x) * p)`` for every local expert's row slice, any
    activation of moeplug.ops.activations, any device; ``probs_S=None`` means p = 1.

    ``recompute_act``: keep only FC1's output for backward, rebuild act(h) * p there.
    ``delay_wgrad`` (model.moe.delay_wgrad_compute): the backward returns dX and dp and queues
    the weight-gradient GEMMs (moeplug.ops.delayed_wgrad); the same gradients land in ``.grad``.
    """
    _check_activation(x_SD, probs_S, counts_L, gate_up_proj_LXD, down_proj_LDF, activation)
    if delay_wgrad and x_SD.device.type != "cpu":
        # CUDA autograd runs backwards on its device threads: the per-thread queue
        # (moeplug.ops.delayed_wgrad) is only proven on CPU.
        raise ValueError(f"grouped_mlp: delay_wgrad is implemented for CPU tensors only, got "
                         f"x_SD on {x_SD.device}. Fix: set model.moe.delay_wgrad_compute: "
                         f"false on GPU")
    return _run(x_SD, probs_S, counts_L, gate_up_proj_LXD, down_proj_LDF, activation, False,
                recompute_act, delay_wgrad)


# ---- runtime.sync_free's packed budget rows ---------------------------------------------------

@torch.library.custom_op("moeplug::grouped_ffn_packed", mutates_args=(), device_types="cpu")
def _packed_op(x_GSD: torch.Tensor, counts_GL: torch.Tensor, w13_LXD: torch.Tensor,
               w2_LDF: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) of the packed form for runtime.capture's compiled region (x in the GEMMs' dtype)."""
    fused = fused_schedule(activation, x_GSD.dtype, x_GSD.device)
    h, _, y = _forward(x_GSD, None, _slices(counts_GL), w13_LXD, w2_LDF, activation, fused,
                       False)
    return y, h


@_packed_op.register_fake
def _(x_GSD, counts_GL, w13_LXD, w2_LDF, activation):
    G, S, D = x_GSD.shape
    return x_GSD.new_empty(G, S, D), x_GSD.new_empty(G, S, w13_LXD.shape[1])


@torch.library.custom_op("moeplug::grouped_ffn_packed_backward", mutates_args=(),
                         device_types="cpu")
def _packed_backward_op(g_GSD: torch.Tensor, x_GSD: torch.Tensor, h_GSX: torch.Tensor,
                        counts_GL: torch.Tensor, w13_LXD: torch.Tensor, w2_LDF: torch.Tensor,
                        activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fused = fused_schedule(activation, x_GSD.dtype, x_GSD.device)
    dX, _, dW13, dW2 = _backward(g_GSD.contiguous(), x_GSD, h_GSX, None, None,
                                 _slices(counts_GL), w13_LXD, w2_LDF, activation, fused,
                                 (True, False, True, True), False)
    return dX, dW13, dW2


@_packed_backward_op.register_fake
def _(g_GSD, x_GSD, h_GSX, counts_GL, w13_LXD, w2_LDF, activation):
    return x_GSD.new_empty(x_GSD.shape), w13_LXD.new_empty(w13_LXD.shape), \
        w2_LDF.new_empty(w2_LDF.shape)


def _packed_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x_GSD, counts_GL, w13_LXD, w2_LDF, activation = inputs
    ctx.save_for_backward(x_GSD, output[1], counts_GL, w13_LXD, w2_LDF)
    ctx.activation = activation


def _packed_backward(ctx: Any, g_y: torch.Tensor, g_h: torch.Tensor) -> tuple:
    x_GSD, h_GSX, counts_GL, w13_LXD, w2_LDF = ctx.saved_tensors
    dX, dW13, dW2 = _packed_backward_op(g_y, x_GSD, h_GSX, counts_GL, w13_LXD, w2_LDF,
                                        ctx.activation)
    return dX, None, dW13, dW2, None


_packed_op.register_autograd(_packed_backward, setup_context=_packed_setup)


def grouped_ffn_packed(x_GSD: torch.Tensor, counts_GL: torch.Tensor, w13_LXD: torch.Tensor,
                       w2_LDF: torch.Tensor, activation: str) -> torch.Tensor:
    """y_GSD of runtime.sync_free's packed budget rows (``Experts.forward_packed``): chunk g's
    first ``counts_GL[g].sum()`` rows are its routed rows in expert order, the rest padding
    (their outputs left unwritten), no routing weight; FC1's output is kept and the
    activation rebuilt in backward. Eager: into the layer's arena (nothing allocated after
    warm-up); compiled (runtime.capture): one custom op of static shape."""
    dtype = compute_dtype(x_GSD)
    if torch.compiler.is_compiling():
        x_c, w13_c, w2_c = (t.to(dtype) for t in (x_GSD, w13_LXD, w2_LDF))
        return _packed_op(x_c, counts_GL, w13_c, w2_c, activation)[0]
    return _GroupedFFN.apply(x_GSD, None, counts_GL, w13_LXD, w2_LDF, activation, dtype,
                             fused_schedule(activation, dtype, x_GSD.device), False, False, True)


__all__ = ["expert_mlp", "grouped_mlp", "grouped_ffn_packed"]
