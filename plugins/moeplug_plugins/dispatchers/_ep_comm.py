"""The multi-rank steps of the dispatchers: count exchange, uneven all-to-all, chunk sorting, and
the all-gather / reduce-scatter pair. Every tensor step is differentiable (moeplug.parallel.comm).

Legend: W ranks in the EP group, E experts (global), L local experts (E = W * L), S rows held by
this rank's experts, N rows this rank sent, T local tokens, G gathered tokens (sum of every
rank's T), ``...`` trailing dims (hidden size, or none for probs).

Global expert e lives on EP rank ``e // L`` as its local expert ``e % L``, so this rank's
``counts_E`` (rows per global expert, after permute) viewed as ``[W, L]`` is already split by
destination rank: row r goes to rank r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function

from moeplug.api import comm, get_runtime, workspace


@dataclass(frozen=True)
class A2APlan:
    """Row counts of one dispatch all-to-all, for both directions.

    send_W:    rows this rank sends to each EP rank (the way there).
    recv_W:    rows this rank receives from each EP rank.
    counts_WL: rows received from rank w for local expert l (int64 CPU); arrival order is
               (source rank, local expert)-major, the experts want (local expert, source rank).
    """

    send_W: list[int]
    recv_W: list[int]
    counts_WL: torch.Tensor

    @property
    def counts_L(self) -> torch.Tensor:
        if self.counts_WL.shape[0] == 1:  # one rank: its row, no reduction (no allocation)
            return self.counts_WL[0]
        L = self.counts_WL.shape[1]
        return torch.sum(self.counts_WL, dim=0, out=workspace.empty((L,), torch.int64))


def local_plan(counts_E: torch.Tensor, num_rows: int) -> A2APlan:
    """The plan of a one-rank EP group, where rows go nowhere: :func:`exchange_counts`'s
    numbers, built from views and ``num_rows`` (= counts_E.sum()) without a collective or an
    allocation. Its sort is the identity (one source rank), and is never run."""
    return A2APlan(send_W=[num_rows], recv_W=[num_rows], counts_WL=counts_E.view(1, -1))


def exchange_counts(counts_E: torch.Tensor, group: Any) -> A2APlan:
    """All-to-all of per-expert row counts: rank r sends ``counts_E[r*L:(r+1)*L]`` to rank r."""
    W = comm.group_size(group)
    counts_E = counts_E.to(torch.int64).cpu()
    if counts_E.numel() % W:
        raise ValueError(f"counts_E has {counts_E.numel()} experts, not divisible by the EP size "
                         f"{W}. Fix: choose num_experts a multiple of the expert-parallel size")
    L = counts_E.numel() // W
    with torch.no_grad():
        counts_WL = comm.all_to_all(counts_E.view(W, L), [1] * W, [1] * W, group)
    # The row sums in Python: the lists are what the collectives take, and torch's sums would
    # each allocate a result.
    sent, received = counts_E.tolist(), counts_WL.tolist()
    return A2APlan(send_W=[sum(sent[w * L:(w + 1) * L]) for w in range(W)],
                   recv_W=[sum(row) for row in received], counts_WL=counts_WL)


def all_to_all_there(rows_N: torch.Tensor, plan: A2APlan, group: Any) -> torch.Tensor:
    """Each rank's rows to the ranks owning their experts; arrives (source rank, expert)-major."""
    return comm.all_to_all(rows_N, plan.recv_W, plan.send_W, group)


def all_to_all_back(rows_S: torch.Tensor, plan: A2APlan, group: Any) -> torch.Tensor:
    """The inverse of :func:`all_to_all_there` (rows must be back in arrival order)."""
    return comm.all_to_all(rows_S, plan.send_W, plan.recv_W, group)


class _MoveChunks(Function):
    """The sort by local expert on CPU: each (source rank, expert) chunk of ``rows`` copied to
    its place in a workspace buffer, by the runtime's ``move_row_chunks`` (contiguous copies in
    parallel pieces, no per-chunk Python); backward moves the gradient's chunks back. Replaces
    an index_select, whose backward zero-filled a fresh buffer, and its [S] index."""

    @staticmethod
    def forward(ctx, rows, counts_WL, to_expert_major):
        ctx.counts_WL, ctx.to_expert_major = counts_WL, to_expert_major
        ctx.arena = workspace.current_arena()
        return _move(rows, counts_WL, to_expert_major)

    @staticmethod
    def backward(ctx, grad):
        with workspace.ctx_arena(ctx):
            return _move(grad, ctx.counts_WL, not ctx.to_expert_major), None, None


def _move(rows: torch.Tensor, counts_WL: torch.Tensor, to_expert_major: bool) -> torch.Tensor:
    return torch.ops.moeplug_plugins.move_row_chunks(rows.contiguous(), counts_WL,
                                                     to_expert_major)


# The runtime's kernel as a torch.library op, so that tensors without data take its fake kernel
# (the meta device of ``moeplug plan --dry-run``, FakeTensorMode): the kernel reads data
# pointers, which those tensors do not have. The dry run's shadows (moeplug.plan.fake_step) run
# the op itself on the real counts, so its chunk sort index comes from this same kernel.
@torch.library.custom_op("moeplug_plugins::move_row_chunks", mutates_args=(), device_types="cpu")
def _move_op(rows: torch.Tensor, counts_WL: torch.Tensor, to_expert_major: bool
             ) -> torch.Tensor:
    """``rows`` [S, ...] with chunk (a, b) of the source-major counts ``c`` [A, B] moved to
    its place in (b, a)-major order (``to_expert_major``; else the inverse)."""
    out = workspace.empty(tuple(rows.shape), rows.dtype)
    W, L = counts_WL.shape
    get_runtime().move_row_chunks(
        src=rows.data_ptr(), dst=out.data_ptr(),
        row_bytes=rows[0].numel() * rows.element_size() if rows.shape[0] else 0,
        counts=counts_WL.data_ptr(), num_ranks=W, local_experts=L,
        to_expert_major=to_expert_major)
    return out


@_move_op.register_fake
def _(rows, counts_WL, to_expert_major):
    return rows.new_empty(rows.shape)


def _apply_moves(rows: torch.Tensor, plan: A2APlan, to_expert_major: bool) -> torch.Tensor:
    """``rows`` with its chunks moved. On CPU the runtime's chunk copies; on a GPU one
    index_select (a copy kernel per chunk would be a launch per (source rank, expert) pair)."""
    counts_WL = plan.counts_WL.to(torch.int64).contiguous()
    if rows.device.type == "cpu":
        return _MoveChunks.apply(rows, counts_WL, to_expert_major)
    return rows.index_select(0, gather_index(counts_WL, to_expert_major).to(rows.device))


def gather_index(counts_WL: torch.Tensor, to_expert_major: bool) -> torch.Tensor:
    """idx with ``rows[idx]`` = the rows moved as :func:`_move` moves them: the row numbers
    0..S-1 moved by the same kernel (one definition of the chunk layout)."""
    S = int(counts_WL.sum())
    return _move(torch.arange(S, dtype=torch.int64).view(S, 1), counts_WL,
                 to_expert_major).view(S)


def sort_by_local_expert(rows_S: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """Arrived rows ((source rank, local expert)-major) in local-expert-major order."""
    return _apply_moves(rows_S, plan, True)


def unsort_by_local_expert(rows_S: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """Inverse of :func:`sort_by_local_expert`: expert-major rows back to arrival order."""
    return _apply_moves(rows_S, plan, False)


# --- allgather dispatcher ----------------------------------------------------------------------

def gather_sizes(num_tokens: int, group: Any) -> list[int]:
    """Tokens on every EP rank (ranks may hold different T)."""
    return comm.gather_ints(num_tokens, group)


def gather_capacities(capacity: int, group: Any) -> list[int]:
    """Every EP rank's capacity. Each rank's C comes from its own token count (Megatron), so
    they differ when the ranks hold different numbers of tokens; pad-to-capacity then gives a
    local expert the sum, the most rows the ranks may send it (moeplug.routing.padded_counts)."""
    return gather_sizes(capacity, group)


def all_gather_tokens(t_T: torch.Tensor, sizes_W: list[int], group: Any) -> torch.Tensor:
    """[T, ...] -> [G, ...], every rank's tokens in rank order; backward reduce-scatters."""
    return comm.all_gather(t_T, group, sizes_W)


def reduce_scatter_tokens(y_G: torch.Tensor, sizes_W: list[int], group: Any) -> torch.Tensor:
    """[G, ...] -> [T, ...]: sum of every rank's partial output for this rank's tokens."""
    return comm.reduce_scatter(y_G, group, sizes_W)
