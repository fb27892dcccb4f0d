"""Rows between the ranks of one machine through the shared-memory heap (moeplug.parallel.shm_heap):
the direct-write transport. The writer copies rows straight into the reader's data region; the
C++ kernels run on the runtime's thread pool without the GIL.

Legend: T tokens, K choices per token, W ranks, P rows a rank receives, C row runs.

    seq = heap.arrive(row_bytes(streams))                        every op starts so (collective)
    got = to_experts(heap, seq, [(x_TD, False), (p_TK, True)],   token t's row (or choice (t, k)'s
                     dest_rank_TK, dest_row_TK, rows_W)           row) to dest_rank's row dest_row
    got = to_sources(heap, seq, [y_PD], chunks_C4, rows_W)       runs (src_row, rank, row, n)
    y_TD = pull_sum(heap, y_PD, src_rank_TK, src_row_TK)         the single-copy combine: each
                                                                  rank sums its rows read straight
                                                                  out of the peers' y_PD

Split for overlap (two ops in flight: moeplug.parallel.shm_heap): ``*_start`` does this rank's
part - its rows written into the peers' areas (or, pulling, read out of theirs), DONE published -
and returns a pending op; :func:`landed` / :func:`pulled` wait for every peer's DONE and hand
the rows over. to_experts(...) is landed(to_experts_start(...)), and so on.

Both return this rank's received rows, ``rows_W[rank]`` per stream, as tensors over its receive
area in the heap (SymmetricHeap.receive_area): the rows are written once, by the sender, where
the receiver uses them - no copy out. The area stays this rank's while any of them lives.
Each stream's part of a receiver's area starts at a 64-byte boundary after the previous one's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeplug.runtime import workspace
from moeplug.parallel import host_buffers
from moeplug.parallel.shm_heap import SymmetricHeap
from moeplug.runtime import dtype_code, get_runtime


def row_bytes(streams: list[tuple[torch.Tensor, bool]]) -> int:
    """Bytes of one row of every stream together (what heap.arrive checks across ranks)."""
    return sum(_row_bytes(t) for t, _ in streams)


@dataclass(frozen=True)
class Landing:
    """An op whose rows this rank has written (DONE published); its receive area is held here,
    so no later op lands on it, until :func:`landed` hands the rows over."""
    heap: SymmetricHeap
    seq: int
    area: torch.Tensor
    specs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]  # each stream's dtype, row shape
    rows: int


def to_experts(heap: SymmetricHeap, seq: int, streams: list[tuple[torch.Tensor, bool]],
               dest_rank_TK: torch.Tensor, dest_row_TK: torch.Tensor, rows_W: list[int],
               fixed: bool = False, option: str = "heap_bytes") -> list[torch.Tensor]:
    """Scatter token rows ([T, ...], per_choice False) or choice rows ([T*K, ...], True) to
    ``dest_rank_TK``/``dest_row_TK`` (rank -1: skip); ``rows_W``: rows each rank receives."""
    return landed(to_experts_start(heap, seq, streams, dest_rank_TK, dest_row_TK, rows_W, fixed,
                                   option))


def to_experts_start(heap: SymmetricHeap, seq: int, streams: list[tuple[torch.Tensor, bool]],
                     dest_rank_TK: torch.Tensor, dest_row_TK: torch.Tensor, rows_W: list[int],
                     fixed: bool = False, option: str = "heap_bytes") -> Landing:
    """:func:`to_experts` up to this rank's DONE (no wait for the peers')."""
    T, K = dest_rank_TK.shape
    dest_rank = dest_rank_TK.contiguous()
    dest_row = dest_row_TK.contiguous()
    core = get_runtime()
    area, bases = _areas(heap, seq, streams, rows_W, fixed, option)
    for i, base_W in enumerate(bases):
        t, per_choice = streams[i]
        expect = T * K if per_choice else T
        if t.shape[0] != expect:
            raise ValueError(f"to_experts: stream {i} has {t.shape[0]} rows, expected {expect} "
                             f"({'T*K' if per_choice else 'T'})")
        core.scatter_rows(src=t.data_ptr(), num_tokens=T, top_k=K, row_bytes=_row_bytes(t),
                          per_choice=per_choice, dest_rank=dest_rank.data_ptr(),
                          dest_row=dest_row.data_ptr(), dest_base=base_W.data_ptr(),
                          world=heap.world)
    heap.publish_done(seq)
    return _landing(heap, seq, area, streams, rows_W)


def to_sources(heap: SymmetricHeap, seq: int, streams: list[torch.Tensor],
               chunks_C4: torch.Tensor, rows_W: list[int], fixed: bool = False,
               option: str = "heap_bytes") -> list[torch.Tensor]:
    """Copy row runs of each stream ``[P, ...]``: chunk (src_row, rank, dest_row, rows)."""
    return landed(to_sources_start(heap, seq, streams, chunks_C4, rows_W, fixed, option))


def to_sources_start(heap: SymmetricHeap, seq: int, streams: list[torch.Tensor],
                     chunks_C4: torch.Tensor, rows_W: list[int], fixed: bool = False,
                     option: str = "heap_bytes") -> Landing:
    """:func:`to_sources` up to this rank's DONE (no wait for the peers')."""
    pairs = [(t, False) for t in streams]
    chunks = chunks_C4.contiguous()
    core = get_runtime()
    area, bases = _areas(heap, seq, pairs, rows_W, fixed, option)
    for t, base_W in zip(streams, bases):
        core.copy_chunks(src=t.data_ptr(), row_bytes=_row_bytes(t), chunks=chunks.data_ptr(),
                         num_chunks=chunks.shape[0], dest_base=base_W.data_ptr(),
                         world=heap.world)
    heap.publish_done(seq)
    return _landing(heap, seq, area, pairs, rows_W)


def landed(op: Landing) -> list[torch.Tensor]:
    """Wait until every rank has written its rows of ``op``; this rank's rows, per stream."""
    op.heap.wait_done(op.seq)
    return _received(op.area, op.specs, op.rows)


def sum_rows(rows: torch.Tensor, row_map_TK: torch.Tensor,
             weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * rows[row_map[t, k]] (plain sum without weights; row_map < 0 adds
    nothing): the sum on receipt, read straight from the heap."""
    T, K = row_map_TK.shape
    D = rows.shape[1]
    y = host_buffers.empty((T, D), rows.dtype)
    rm = row_map_TK.contiguous()
    w = None if weights_TK is None else weights_TK.detach().float().contiguous()
    get_runtime().sum_received_rows(rows=rows.data_ptr(), num_rows=rows.shape[0],
                                    row_map=rm.data_ptr(), weights=0 if w is None else w.data_ptr(),
                                    y=y.data_ptr(), num_tokens=T, top_k=K, hidden=D,
                                    dtype=dtype_code(rows, "sum_rows", "rows"))
    return y


@dataclass(frozen=True)
class Pull:
    """A pull this rank has done (DONE published): ``y`` is its sum; ``y_PD`` (its own rows,
    which slower peers may still be reading) is held here until :func:`pulled`."""
    heap: SymmetricHeap
    seq: int
    y: torch.Tensor
    y_PD: torch.Tensor


def pull_sum(heap: SymmetricHeap, y_PD: torch.Tensor, src_rank_TK: torch.Tensor,
             src_row_TK: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_k row src_row[t, k] of rank src_rank[t, k]'s ``y_PD`` (rank < 0: nothing), one
    op: every rank publishes where its y_PD lies, reads its rows out of the peers' memory with
    process_vm_readv into a cache-sized block and sums them there (fp32, k order: bitwise
    :func:`sum_rows` of the rows :func:`to_sources` would have brought), then waits until every
    rank has read its rows, so y_PD may go. One pass over the rows, no heap in between. Needs
    ``heap.single_copy`` (probed at set-up)."""
    return pulled(pull_sum_start(heap, y_PD, src_rank_TK, src_row_TK))


def pull_sum_start(heap: SymmetricHeap, y_PD: torch.Tensor, src_rank_TK: torch.Tensor,
                   src_row_TK: torch.Tensor) -> Pull:
    """:func:`pull_sum` up to this rank's DONE: arrive (every y_PD is ready once it returns),
    pull and sum, publish; the wait for the peers to finish reading ours is :func:`pulled`."""
    y_PD = y_PD.contiguous()
    T, K = src_rank_TK.shape
    D = y_PD.shape[1] if y_PD.dim() == 2 else 0
    seq = heap.arrive(_row_bytes(y_PD), [y_PD.data_ptr()])
    bases = heap.read_slots(1).reshape(-1).contiguous()
    pids = _int64s(list(heap.pids))
    y = host_buffers.empty((T, D), y_PD.dtype)
    rank, row = src_rank_TK.contiguous(), src_row_TK.contiguous()
    get_runtime().pull_sum_rows(pids=pids.data_ptr(), bases=bases.data_ptr(), rank=heap.rank,
                                world=heap.world, src_rank=rank.data_ptr(),
                                src_row=row.data_ptr(), y=y.data_ptr(), num_tokens=T, top_k=K,
                                hidden=D, dtype=dtype_code(y_PD, "pull_sum", "y_PD"))
    heap.publish_done(seq)
    return Pull(heap, seq, y, y_PD)


def pulled(op: Pull) -> torch.Tensor:
    """Wait until every rank has read its rows of ``op`` out of ours; the sum."""
    op.heap.wait_done(op.seq)
    return op.y


# ---- layout -----------------------------------------------------------------------------------

def _row_bytes(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("shm_rows: rows must be contiguous; pass t.contiguous()")
    return math.prod(t.shape[1:]) * t.element_size()


def _offsets(rows: int, sizes: list[int]) -> tuple[list[int], int]:
    offs, at = [], 0
    for s in sizes:
        offs.append(at)
        at = -(-(at + rows * s) // 64) * 64
    return offs, at


def _areas(heap: SymmetricHeap, seq: int, streams, rows_W: list[int], fixed: bool, option: str
           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's receive area for the op, and each stream's base address in every rank's."""
    sizes = [_row_bytes(t) for t, _ in streams]
    layouts = [_offsets(int(n), sizes) for n in rows_W]
    area, addr_W = heap.receive_area(seq, [total for _, total in layouts], fixed, option)
    return area, [_int64s([addr_W[r] + layouts[r][0][i] for r in range(heap.world)])
                  for i in range(len(streams))]


def _int64s(values: list[int]) -> torch.Tensor:
    """``values`` as an int64 tensor in the running layer's workspace, written through a numpy
    view (torch.tensor(values) allocates)."""
    out = workspace.empty((len(values),), torch.int64)
    out.numpy()[:] = values
    return out


def _landing(heap: SymmetricHeap, seq: int, area: torch.Tensor, streams, rows_W: list[int]
             ) -> Landing:
    specs = tuple((t.dtype, tuple(t.shape[1:])) for t, _ in streams)
    return Landing(heap, seq, area, specs, int(rows_W[heap.rank]))


def _received(area: torch.Tensor, specs, rows: int) -> list[torch.Tensor]:
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
    offs, _ = _offsets(rows, sizes)
    out = []
    for (dtype, shape), off, size in zip(specs, offs, sizes):
        view = area[off:off + rows * size].view(dtype)
        out.append(view.view(rows, *shape))
    return out
