"""Dropped and padded rows, shared by the dispatchers.

Legend: T tokens, K top-k, D hidden, L local experts, S real rows, P padded rows (P >= S).

Dropped choices (``RouterOutput.dropped_TK``) go to a *sink* expert numbered after the real
ones, so a stable permute puts their rows last, where the dispatcher cuts them off; combine
appends zero rows in their place before the unpermute.

Padding gives every local expert a fixed row count: exactly ``capacity * ep_size`` rows
(pad-to-capacity, static shapes; the sum of the ranks' capacities when their token counts
differ) or the next multiple of ``pad_multiple`` (quantised GEMMs need
16/32-row tiles). Padded rows are zeros with routing weight 0, so the experts' outputs for them
are discarded and the layer's output and gradients do not change. On the CPU the padded counts,
positions, rows and their grads are workspace buffers (no allocation in a layer's arena after
warm-up), the same numbers as the torch ops they replace (tests/test_moe_allocations.py).
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace


def sink_dropped(ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, sink: int) -> torch.Tensor:
    """``ids_TK`` with every dropped choice sent to expert ``sink``."""
    if dropped_TK is None:
        return ids_TK
    if ids_TK.device.type == "cpu":  # masked_fill (clone + masked_fill_) into the arena
        out = workspace.empty(tuple(ids_TK.shape), ids_TK.dtype).copy_(ids_TK)
        return out.masked_fill_(dropped_TK, sink)
    return ids_TK.masked_fill(dropped_TK, sink)


class _TokenRows(torch.autograd.Function):
    """``x.reshape(-1, D)`` of a non-contiguous input (under tensor parallelism the MoE layer
    gets its token chunk as a [B, S/tp, D] view of s-major [S, B, D] activations), the copy
    written into a workspace buffer; backward is the reshape's (its grad copied back into x's
    shape), into a workspace buffer."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape, ctx.arena = tuple(x.shape), workspace.current_arena()
        out = workspace.empty(tuple(x.shape), x.dtype).copy_(x)
        return out.view(-1, x.shape[-1])

    @staticmethod
    def backward(ctx, grad_TD):
        with workspace.ctx_arena(ctx):
            return workspace.empty(ctx.shape, grad_TD.dtype).copy_(grad_TD.view(ctx.shape))


class _RowsAs(torch.autograd.Function):
    """``y_TD.view(shape)``; backward is the view's (the grad as [T, D] rows), a non-contiguous
    grad (tensor parallelism's s-major one) copied into a workspace buffer."""

    @staticmethod
    def forward(ctx, y_TD, shape):
        ctx.arena = workspace.current_arena()
        return y_TD.view(shape)

    @staticmethod
    def backward(ctx, grad):
        if not grad.is_contiguous():
            with workspace.ctx_arena(ctx):
                grad = workspace.empty(tuple(grad.shape), grad.dtype).copy_(grad)
        return grad.view(-1, grad.shape[-1]), None


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([..., D]) as [T, D] rows, b-major: a view when ``x`` is contiguous, else (CPU) a
    copy in the running layer's workspace with the same values as ``reshape``'s."""
    if _plain(x):
        return x.reshape(-1, x.shape[-1])
    return _TokenRows.apply(x)


def rows_as(y_TD: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y_TD`` viewed in the shape of ``x``, the input :func:`token_rows` flattened; where that
    input was not contiguous, its grad will not be either, and the backward copies it into the
    running layer's workspace instead of reshape's fresh buffer."""
    if _plain(x):
        return y_TD.reshape(x.shape)
    return _RowsAs.apply(y_TD, tuple(x.shape))


def _plain(x: torch.Tensor) -> bool:
    return x.is_contiguous() or x.device.type != "cpu" or workspace.current_arena() is None


class _RowRange(torch.autograd.Function):
    """``x_RD[t0:t1]``; backward is SliceBackward0's (zeros of x's shape, the grad copied into
    rows t0:t1) written into a workspace buffer."""

    @staticmethod
    def forward(ctx, x_RD, t0, t1):
        ctx.shape, ctx.t0 = tuple(x_RD.shape), t0
        ctx.arena = workspace.current_arena()
        return x_RD[t0:t1]

    @staticmethod
    def backward(ctx, grad_SD):
        with workspace.ctx_arena(ctx):
            grad_RD = workspace.empty(ctx.shape, grad_SD.dtype)
        t0, t1 = ctx.t0, ctx.t0 + grad_SD.shape[0]
        grad_RD[:t0].zero_()
        grad_RD[t1:].zero_()
        grad_RD[t0:t1].copy_(grad_SD)
        return grad_RD, None, None


def row_range(x_RD: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """``x_RD[t0:t1]``; on the CPU its backward's buffer comes from the workspace (a slice's
    backward allocates a zero-filled copy of the whole input)."""
    if x_RD.device.type != "cpu":
        return x_RD[t0:t1]
    return _RowRange.apply(x_RD, t0, t1)


def first_rows(x_RD: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``x_RD[:num_rows]`` (the rows before the sink's): :func:`row_range` from row 0."""
    return row_range(x_RD, 0, num_rows)


class _CatRows(torch.autograd.Function):
    """``torch.cat(parts)`` along rows into a workspace buffer; CatBackward0 hands each part
    its rows of the grad as a view (narrow)."""

    @staticmethod
    def forward(ctx, *parts):
        out = workspace.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                              parts[0].dtype)
        t = 0
        for p in parts:
            out[t:t + p.shape[0]].copy_(p)
            t += p.shape[0]
        ctx.rows = [p.shape[0] for p in parts]
        return out

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.split(ctx.rows))


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` (dim 0); same-dtype CPU parts into a workspace buffer."""
    if len(parts) < 2 or any(p.device.type != "cpu" or p.dtype != parts[0].dtype
                             for p in parts):
        return torch.cat(parts)
    return _CatRows.apply(*parts)


def padded_counts(counts_L: torch.Tensor, capacity: int | None, pad_multiple: int,
                  ep_size: int = 1, capacity_W: list[int] | None = None) -> torch.Tensor:
    """Rows per local expert after padding (int64 CPU). Raises if an expert already holds more
    rows than the capacity allows (the router did not drop as it promised).

    Each EP rank computes its capacity from its own tokens (Megatron), so ranks with different
    token counts have different capacities: pass every rank's in ``capacity_W`` and a local
    expert gets their sum (the most rows the W ranks may send it), not this rank's C * W.
    On the CPU the result is a workspace buffer (no allocation in a layer's arena)."""
    cpu = counts_L.device.type == "cpu"
    if capacity is not None:
        limit = capacity * ep_size if capacity_W is None else sum(capacity_W)
        # The host's counts as Python ints: counts_L.max() would allocate its 0-d result.
        most = max(counts_L.tolist(), default=0)
        if most > limit:
            how = (f"capacity * ep_size = {capacity} * {ep_size}" if capacity_W is None else
                   f"the sum of the EP ranks' capacities {list(capacity_W)}")
            raise ValueError(f"padding to capacity: an expert received {most} rows but "
                             f"{how} = {limit}. Fix: the router must drop choices over "
                             f"capacity before setting RouterOutput.capacity")
        if not cpu:
            return torch.full_like(counts_L, limit)
        return workspace.empty(tuple(counts_L.shape), counts_L.dtype).fill_(limit)
    if pad_multiple > 1:
        if not cpu:
            return (counts_L + pad_multiple - 1) // pad_multiple * pad_multiple
        # The same integer ops with the numbers as 0-d tensors in the workspace (a Python
        # number becomes a freshly allocated wrapped tensor per op).
        m, m_1 = (workspace.empty((), counts_L.dtype).fill_(v)
                  for v in (pad_multiple, pad_multiple - 1))
        out = torch.add(counts_L, m_1, out=workspace.empty(tuple(counts_L.shape), counts_L.dtype))
        return torch.mul(torch.floor_divide(out, m, out=out), m, out=out)
    return counts_L


def pad_rows(x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor,
             target_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Insert zero rows (weight 0) after each expert's real rows so expert e holds target_L[e].

    Returns (x_PD, probs_P, index_S) with ``x_PD[index_S] == x_SD``; index_S is None (and the
    inputs are returned as they are) when no padding is needed. On the CPU every result and
    grad is a workspace buffer (:class:`_PadRows`).
    """
    if torch.equal(counts_L, target_L):
        return x_SD, probs_S, None
    if x_SD.device.type == "cpu" and counts_L.device.type == "cpu":
        index_S = _pad_index(counts_L.tolist(), target_L.tolist(), x_SD.shape[0])
        P = int(sum(target_L.tolist()))
        return _PadRows.apply(x_SD, index_S, P), _PadRows.apply(probs_S, index_S, P), index_S
    src_start_L = torch.cumsum(counts_L, 0) - counts_L
    dst_start_L = torch.cumsum(target_L, 0) - target_L
    expert_S = torch.repeat_interleave(torch.arange(len(counts_L)), counts_L)
    index_S = (torch.arange(x_SD.shape[0]) - src_start_L[expert_S] + dst_start_L[expert_S])
    index_S = index_S.to(x_SD.device)
    P = int(target_L.sum())
    x_PD = x_SD.new_zeros(P, x_SD.shape[1]).index_copy(0, index_S, x_SD)
    probs_P = probs_S.new_zeros(P).index_copy(0, index_S, probs_S)
    return x_PD, probs_P, index_S


def unpad_rows(y_PD: torch.Tensor, index_S: torch.Tensor | None) -> torch.Tensor:
    """The real rows of ``y_PD`` (inverse of :func:`pad_rows`); padded rows get no gradient."""
    if index_S is None:
        return y_PD
    if y_PD.device.type == "cpu" and index_S.device.type == "cpu":
        return _UnpadRows.apply(y_PD, index_S)
    return y_PD.index_select(0, index_S)


def _pad_index(counts: list[int], targets: list[int], num_rows: int) -> torch.Tensor:
    """index_S: real row s of expert e goes to s - (e's first real row) + (e's first padded
    row), one arange per expert into a workspace buffer (the torch path's cumsum,
    repeat_interleave and gathers each allocate)."""
    index_S = workspace.empty((num_rows,), torch.int64)
    src = dst = 0
    for c, t in zip(counts, targets):
        if c:
            torch.arange(dst, dst + c, out=index_S[src:src + c])
        src, dst = src + c, dst + t
    return index_S


class _PadRows(torch.autograd.Function):
    """``x_S.new_zeros(P, ...).index_copy(0, index_S, x_S)`` into a workspace buffer (zeros,
    then index_copy_: the same copies). Backward is IndexCopyBackward0's grad of the source,
    ``grad_P.index_select(0, index_S)`` (the zeros need none)."""

    @staticmethod
    def forward(ctx, x_S, index_S, num_padded):
        out = workspace.empty((num_padded, *x_S.shape[1:]), x_S.dtype).zero_()
        out.index_copy_(0, index_S, x_S)
        ctx.save_for_backward(index_S)
        ctx.arena = workspace.current_arena()
        return out

    @staticmethod
    def backward(ctx, grad_P):
        (index_S,) = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            out = workspace.empty((index_S.shape[0], *grad_P.shape[1:]), grad_P.dtype)
        return torch.index_select(grad_P, 0, index_S, out=out), None, None


class _UnpadRows(torch.autograd.Function):
    """``y_P.index_select(0, index_S)`` into a workspace buffer. Backward is
    IndexSelectBackward0's ``zeros(P, ...).index_add_(0, index_S, grad_S)``: the rows of
    index_S are distinct, so row index_S[s] is 0 + grad_S[s] (which turns -0.0 into +0.0, so
    it is not a plain copy): grad_S + 0 into a workspace buffer, index_copy_'d into zeros.
    (index_add_ itself may allocate a sort buffer for its scatter.)"""

    @staticmethod
    def forward(ctx, y_P, index_S):
        out = workspace.empty((index_S.shape[0], *y_P.shape[1:]), y_P.dtype)
        torch.index_select(y_P, 0, index_S, out=out)
        ctx.save_for_backward(index_S)
        ctx.num_padded = y_P.shape[0]
        ctx.arena = workspace.current_arena()
        return out

    @staticmethod
    def backward(ctx, grad_S):
        (index_S,) = ctx.saved_tensors
        shape, dt = tuple(grad_S.shape), grad_S.dtype
        with workspace.ctx_arena(ctx):
            zero = workspace.empty((), dt).zero_()
            grad_plus_0 = torch.add(grad_S, zero, out=workspace.empty(shape, dt))
            grad_P = workspace.empty((ctx.num_padded, *shape[1:]), dt).zero_()
        return grad_P.index_copy_(0, index_S, grad_plus_0), None


def append_sink_rows(y_SD: torch.Tensor, num_sink_rows: int) -> torch.Tensor:
    """Zero rows standing in for the dropped choices, so unpermute sums nothing for them."""
    if num_sink_rows == 0:
        return y_SD
    if y_SD.device.type == "cpu":
        return _AppendZeroRows.apply(y_SD, num_sink_rows)
    return torch.cat([y_SD, y_SD.new_zeros(num_sink_rows, y_SD.shape[1])])


class _AppendZeroRows(torch.autograd.Function):
    """``cat([y_SD, zeros(n, D)])`` into a workspace buffer; CatBackward0 hands y_SD the first
    S rows of the grad (a view, as torch's narrow)."""

    @staticmethod
    def forward(ctx, y_SD, num_rows):
        S, D = y_SD.shape
        out = workspace.empty((S + num_rows, D), y_SD.dtype)
        out[:S].copy_(y_SD)
        out[S:].zero_()
        ctx.num_real = S
        return out

    @staticmethod
    def backward(ctx, grad_RD):
        return grad_RD[:ctx.num_real], None
