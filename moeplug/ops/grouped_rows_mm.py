"""grouped_rows_mm: ``y[rows of group g] = x[rows of group g] @ w[g]^T`` over a static-shaped
buffer whose first ``sum(counts)`` rows are the groups' rows in order, as one op whose kernel
reads the counts itself - for the sync-free static region (moeplug.moe.budgeted).

Legend: S rows (the static buffer), G groups (experts), N output and K input features.

Why an op of our own: the static region's experts ran as a batched GEMM over every budget slot,
so with ``runtime.token_budget: 2.0`` half the GEMM rows were padding. A grouped GEMM takes the
group ends as a tensor, so no host read happens in the traced region; as a
``torch.library.custom_op`` with a fake kernel it is one opaque node of static shape in the
captured graph, forward and backward (inductor cannot compile ``torch._grouped_mm`` outside
bf16: its fake kernel checks CUDA's dtype rules).

The CPU kernel reads the counts on the host, as torch's own CPU grouped GEMM reads its offsets:
the counts are a CPU tensor, so there is no device to wait for. It runs one ``torch.mm`` per
group, as the dynamic path's experts do (moeplug.ops.grouped_ffn), bf16 row GEMMs over each
group's rows rounded up to ``_grouped.ROW_MULTIPLE``. It replaced ``torch._grouped_mm``, which
refused rows of no multiple of 16 bytes (odd feature counts took a zero-padded copy) and cannot
pad rows; in fp32 the sync-free benchmark moved within its noise (dynamic / replay at the mid
shape 0.80-0.83 before, 0.80-0.86 after, alternating runs).

Rows past ``sum(counts)`` are left unwritten (whatever the buffer held): the caller never reads
them into a real row (moeplug.moe.budgeted.slots.combine_rows masks them). Registered for the CPU only; on a GPU
the static region keeps its own path.

``grouped_rows_act`` is the activation between the two GEMMs over the same routed rows (the
budget's other rows, half the buffer at ``token_budget: 2.0``, were activated for nothing):
SwiGLU by the runtime's fused kernel (the dynamic path's experts run it too), the other
activations as ``activation_fn`` computes them. The ``_out`` twins write given buffers (the
static stages' eager form, moeplug.moe.budgeted.arena).
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace
from moeplug.ops._grouped import (expert_slices, mm_rows, row_multiple, with_spare_rows,
                                  zero_unused_experts)
from moeplug.ops.activations import act_into, act_times_probs_backward, act_width
from moeplug.ops.swiglu import swiglu_backward_raw, swiglu_forward_raw


def _groups(counts_G: torch.Tensor) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of every group with rows."""
    return expert_slices(counts_G.tolist())


def _forward_into(x_SK: torch.Tensor, w_GNK: torch.Tensor, counts_G: torch.Tensor,
                  y_SN: torch.Tensor) -> None:
    m, x_g, y_g = row_multiple(x_SK), with_spare_rows(x_SK), with_spare_rows(y_SN)
    for g, s0, s1 in _groups(counts_G):  # in order: a later group overwrites its padded rows
        mm_rows(x_g, s0, w_GNK[g].t(), y_g, s0, s1 - s0, m)


def _backward_into(g_SN: torch.Tensor, x_SK: torch.Tensor, w_GNK: torch.Tensor,
                   counts_G: torch.Tensor, dx_SK: torch.Tensor, dw_GNK: torch.Tensor) -> None:
    groups = _groups(counts_G)
    zero_unused_experts(dw_GNK, groups)
    m, g_g, dx_g = row_multiple(g_SN), with_spare_rows(g_SN), with_spare_rows(dx_SK)
    for g, s0, s1 in groups:
        mm_rows(g_g, s0, w_GNK[g], dx_g, s0, s1 - s0, m)
        torch.mm(g_SN[s0:s1].t(), x_SK[s0:s1], out=dw_GNK[g])


@torch.library.custom_op("moeplug::grouped_rows_mm", mutates_args=(), device_types="cpu")
def grouped_rows_mm(x_SK: torch.Tensor, w_GNK: torch.Tensor, counts_G: torch.Tensor
                    ) -> torch.Tensor:
    """[S, K] rows x [G, N, K] weights -> [S, N]; group g takes the next counts_G[g] rows."""
    y_SN = x_SK.new_empty(x_SK.shape[0], w_GNK.shape[1])
    _forward_into(x_SK, w_GNK, counts_G, y_SN)
    return y_SN


@grouped_rows_mm.register_fake
def _(x_SK, w_GNK, counts_G):
    return x_SK.new_empty(x_SK.shape[0], w_GNK.shape[1])


@torch.library.custom_op("moeplug::grouped_rows_mm_backward", mutates_args=(),
                         device_types="cpu")
def grouped_rows_mm_backward(g_SN: torch.Tensor, x_SK: torch.Tensor, w_GNK: torch.Tensor,
                             counts_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [S, K], dw [G, N, K]); an empty group's dw is zero."""
    dx_SK, dw_GNK = g_SN.new_empty(x_SK.shape), g_SN.new_empty(w_GNK.shape, dtype=w_GNK.dtype)
    _backward_into(g_SN, x_SK, w_GNK, counts_G, dx_SK, dw_GNK)
    return dx_SK, dw_GNK


@grouped_rows_mm_backward.register_fake
def _(g_SN, x_SK, w_GNK, counts_G):
    return x_SK.new_empty(x_SK.shape), w_GNK.new_empty(w_GNK.shape)


def _setup_context(ctx, inputs, output):
    x_SK, w_GNK, counts_G = inputs
    ctx.save_for_backward(x_SK, w_GNK, counts_G)


def _backward(ctx, g_SN):
    x_SK, w_GNK, counts_G = ctx.saved_tensors
    dx_SK, dw_GNK = grouped_rows_mm_backward(g_SN.contiguous(), x_SK, w_GNK, counts_G)
    return dx_SK, dw_GNK, None


grouped_rows_mm.register_autograd(_backward, setup_context=_setup_context)


# ---- the activation over the routed rows ---------------------------------------------------

def _routed(counts_G: torch.Tensor) -> int:
    # Python ints: a tensor sum would allocate its 0-d result every call.
    return sum(counts_G.tolist())


def _fused(name: str, h: torch.Tensor) -> bool:
    return name == "swiglu" and h.dtype in (torch.float32, torch.bfloat16)


def _act_forward_into(h_SX: torch.Tensor, counts_G: torch.Tensor, name: str,
                      a_SF: torch.Tensor) -> None:
    n = _routed(counts_G)
    if n == 0:
        return
    if _fused(name, h_SX):
        swiglu_forward_raw(h_SX[:n], None, a_SF[:n])
    else:
        act_into(h_SX[:n], name, a_SF[:n])


def _act_backward_into(g_SF: torch.Tensor, h_SX: torch.Tensor, counts_G: torch.Tensor,
                       name: str, dh_SX: torch.Tensor) -> None:
    n = _routed(counts_G)
    if n == 0:
        return
    if _fused(name, h_SX):
        swiglu_backward_raw(g_SF[:n], h_SX[:n], None, False, dh_SX[:n])
    else:
        dh, _ = act_times_probs_backward(g_SF[:n], h_SX[:n], None, name, False, workspace.empty)
        dh_SX[:n].copy_(dh)


@torch.library.custom_op("moeplug::grouped_rows_act", mutates_args=(), device_types="cpu")
def grouped_rows_act(h_SX: torch.Tensor, counts_G: torch.Tensor, name: str) -> torch.Tensor:
    """The activation ``name`` of the first ``sum(counts_G)`` rows of h [S, X] -> [S, F]."""
    a_SF = h_SX.new_empty(h_SX.shape[0], act_width(name, h_SX.shape[1]))
    _act_forward_into(h_SX.contiguous(), counts_G, name, a_SF)
    return a_SF


@grouped_rows_act.register_fake
def _(h_SX, counts_G, name):
    return h_SX.new_empty(h_SX.shape[0], act_width(name, h_SX.shape[1]))


@torch.library.custom_op("moeplug::grouped_rows_act_backward", mutates_args=(),
                         device_types="cpu")
def grouped_rows_act_backward(g_SF: torch.Tensor, h_SX: torch.Tensor, counts_G: torch.Tensor,
                              name: str) -> torch.Tensor:
    """dh [S, X] of :func:`grouped_rows_act` for its routed rows (the rest unwritten)."""
    dh_SX = h_SX.new_empty(h_SX.shape)
    _act_backward_into(g_SF.contiguous(), h_SX.contiguous(), counts_G, name, dh_SX)
    return dh_SX


@grouped_rows_act_backward.register_fake
def _(g_SF, h_SX, counts_G, name):
    return h_SX.new_empty(h_SX.shape)


def _act_setup_context(ctx, inputs, output):
    h_SX, counts_G, name = inputs
    ctx.save_for_backward(h_SX, counts_G)
    ctx.name = name


def _act_backward(ctx, g_SF):
    h_SX, counts_G = ctx.saved_tensors
    return grouped_rows_act_backward(g_SF, h_SX, counts_G, ctx.name), None, None


grouped_rows_act.register_autograd(_act_backward, setup_context=_act_setup_context)


# ---- the ``_out`` twins: the static stages' eager form --------------------------------------
# Each writes given buffers (moeplug.moe.budgeted.arena's workspace buffers); never traced.
# Ops, not plain calls, so that they stay one opaque node, as the functional ops are: the
# host-sync counter sees the op, not the kernel's read of the CPU counts (a GPU kernel reads
# them on the device). Defined with torch.library's plain API: a call is the dispatcher and the
# CPU kernel. As ``custom_op``s they cost ~60-70 us a call more (its Python autograd and
# in-place layers, run for every call; 92 against 30 us at [64, 64]), seven calls a chunk in
# each layer's forward and backward: the eager static layer ran at 0.91 of the dynamic one at
# the small sync-free benchmark shape (benchmarks/test_bench_sync_free.py).
_out_ops = torch.library.Library("moeplug", "FRAGMENT")


def _out_op(schema: str, kernel):
    name = schema.split("(", 1)[0]
    _out_ops.define(schema)
    _out_ops.impl(name, kernel, "CPU")
    return getattr(torch.ops.moeplug, name).default


# grouped_rows_mm into y_SN (rows contiguous; spare rows its storage holds past S may be
# written as bf16 padding).
grouped_rows_mm_out = _out_op(
    "grouped_rows_mm_out(Tensor x_SK, Tensor w_GNK, Tensor counts_G, Tensor(a!) y_SN) -> ()",
    _forward_into)
# grouped_rows_mm_backward into dx_SK and dw_GNK.
grouped_rows_mm_backward_out = _out_op(
    "grouped_rows_mm_backward_out(Tensor g_SN, Tensor x_SK, Tensor w_GNK, Tensor counts_G, "
    "Tensor(a!) dx_SK, Tensor(b!) dw_GNK) -> ()", _backward_into)
# grouped_rows_act into a_SF (h and a contiguous).
grouped_rows_act_out = _out_op(
    "grouped_rows_act_out(Tensor h_SX, Tensor counts_G, str name, Tensor(a!) a_SF) -> ()",
    _act_forward_into)
# grouped_rows_act_backward into dh_SX (all contiguous).
grouped_rows_act_backward_out = _out_op(
    "grouped_rows_act_backward_out(Tensor g_SF, Tensor h_SX, Tensor counts_G, str name, "
    "Tensor(a!) dh_SX) -> ()", _act_backward_into)
