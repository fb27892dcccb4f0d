"""Pieces shared by the grouped expert FFN (:mod:`moeplug.ops.grouped_ffn`) and the grouped row
GEMMs (:mod:`moeplug.ops.grouped_rows_mm`): rows grouped by expert with one count per local
expert, GEMMs in the autocast dtype when autocast is on.

Shape legend: S routed rows (grouped by expert), L local experts.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from moeplug.ops import delayed_wgrad
from moeplug.runtime import workspace
from moeplug.runtime.workspace import Empty


@functools.lru_cache(maxsize=None)
def budget_counts(num_local: int, rows: int) -> torch.Tensor:
    """counts_L of runtime.sync_free's budget rows: every local expert ``rows`` rows. One CPU
    tensor per shape, never written, whose ints :func:`host_counts` knows without reading it."""
    counts_L = torch.full((num_local,), rows, dtype=torch.int64)
    _KNOWN[id(counts_L)] = [rows] * num_local
    return counts_L


_KNOWN: dict[int, list[int]] = {}  # id of a budget_counts tensor (kept alive by its cache)


def host_counts(counts_L: torch.Tensor) -> list[int]:
    """counts_L's ints: known on the host for budget rows (made from ints, never read back, so
    a sync-free call reads nothing), else read off the CPU tensor."""
    known = _KNOWN.get(id(counts_L))
    return list(known) if known is not None else counts_L.tolist()


def expert_slices(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start, end) for every expert that received rows; empty experts get no GEMM."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def keep_for_backward(ctx: Any, x_SD: torch.Tensor, probs_S: torch.Tensor | None,
                      w1: torch.Tensor, w2: torch.Tensor, slices: list[tuple[int, int, int]],
                      delay_wgrad: bool) -> None:
    """What both ops' backward reads from ``ctx`` besides its saved tensors: the expert slices,
    the running layer's arena (backward re-enters it), the weights themselves when their
    gradient GEMMs are deferred (``delay_wgrad``: leaves, into whose .grad the deferred GEMMs
    sum), and the dtypes each gradient goes back in (x, probs, w1, w2)."""
    ctx.slices = slices
    ctx.arena = workspace.current_arena()
    ctx.weights = (w1, w2) if delay_wgrad and delayed_wgrad.can_defer(w1, w2) else None
    ctx.dtypes = (x_SD.dtype, None if probs_S is None else probs_S.dtype, w1.dtype, w2.dtype)


def cast(t: torch.Tensor, dtype: torch.dtype, empty: Empty = workspace.empty) -> torch.Tensor:
    """``t.to(dtype).contiguous()``, into a buffer from ``empty`` when it is a cast."""
    if t.dtype == dtype:
        return t.contiguous()
    return empty(tuple(t.shape), dtype).copy_(t)


def weight_grad(w: torch.Tensor, slices: list[tuple[int, int, int]],
                empty: Empty = workspace.empty) -> torch.Tensor:
    """Uninitialised [L, ...] grad like ``w`` whose experts without rows are zero (the rest get
    mm(out=)).

    From the workspace too: AccumulateGrad usually adopts it as ``param.grad``, and the cache
    only hands it out again once that grad has been dropped (zero_grad) or summed into.
    """
    return zero_unused_experts(empty(tuple(w.shape), w.dtype), slices)


def zero_unused_experts(grad: torch.Tensor, slices: list[tuple[int, int, int]]) -> torch.Tensor:
    """``grad`` ([L, ...]) with the experts that got no rows zeroed (the rest get mm(out=))."""
    used = {e for e, _, _ in slices}
    for e in range(grad.shape[0]):
        if e not in used:
            grad[e].zero_()
    return grad


# bf16 row GEMMs on the CPU take each expert's rows rounded up to a multiple of ROW_MULTIPLE.
# oneDNN's bf16 matmul (brgemm, avx512_core_bf16 here) runs some row counts that are no multiple
# of 4 much slower: each of the four GEMMs whose rows are the routed rows (FC1, FC2, dA, dX), at
# the standard expert shape over every count 1024-1087, ran 1.4-2.3 % faster padded than exact
# summed over the counts, and 1.25-1.34x at 1073 rows (benchmarks/test_bench_kernels.py -k
# row_multiple, two runs). fp32 (MKL) shows no such effect, and the weight-gradient GEMMs, whose
# routed rows are the summed dimension, neither (an exploratory scan, not a benchmark).
# A row of a GEMM's output depends on that row of its input only, so the extra rows cost at
# most 7 rows' FLOPs and change no real row (bitwise, in the tests): they are the next expert's
# rows, which its own GEMM overwrites after, or spare rows past the last: those the buffer's
# storage holds anyway (the workspace rounds sizes up to a size class), so no buffer grows;
# where there are none, the last expert's GEMMs run unpadded.
ROW_MULTIPLE = 8


def row_multiple(t: torch.Tensor) -> int:
    """The row multiple of ``t``'s row GEMMs: ROW_MULTIPLE for bf16 on the CPU, else 1."""
    return ROW_MULTIPLE if t.dtype == torch.bfloat16 and t.device.type == "cpu" else 1


def with_spare_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([R, C], rows contiguous) viewed over every further whole row its storage holds:
    the rows a row GEMM may read or write past R as padding. Write into them only for a buffer
    this op took from the workspace (the whole storage is its); another tensor's are only read."""
    if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        return t
    rows = (t.untyped_storage().nbytes() // t.itemsize - t.storage_offset()) // t.stride(0)
    return t.as_strided((rows, t.shape[1]), t.stride()) if rows > t.shape[0] else t


def padded_rows(multiple: int, n: int, *room: int) -> int:
    """How many rows a row GEMM over an expert's ``n`` rows runs: n rounded up to ``multiple``,
    but no more than any operand has ``room`` for from the expert's first row."""
    return min(-(-n // multiple) * multiple, *room)


def mm_rows(x_g: torch.Tensor, x0: int, w: torch.Tensor, out_g: torch.Tensor, o0: int, n: int,
            multiple: int) -> None:
    """``out_g[o0:o0+n] = x_g[x0:x0+n] @ w``, run over up to ``multiple`` - 1 more rows where
    both operands (views from ``with_spare_rows``) have them. Callers run the experts in order,
    so a later expert's GEMM overwrites what this one wrote of its rows."""
    # multiple 1: the expert's own n rows, which both operands hold (shape[0], not len(): a
    # Python-level Tensor.__len__ a call, two per GEMM)
    k = n if multiple == 1 else padded_rows(multiple, n, x_g.shape[0] - x0, out_g.shape[0] - o0)
    torch.mm(x_g[x0:x0 + k], w, out=out_g[o0:o0 + k])


def compute_dtype(x_SD: torch.Tensor) -> torch.dtype:
    """The GEMM dtype: autocast's for x_SD's device when autocast is on, else x_SD's own."""
    device = x_SD.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x_SD.dtype


def check_counts_and_probs(op: str, counts_L: torch.Tensor, num_experts: int, num_rows: int,
                           probs_S: torch.Tensor | None) -> list[int]:
    """One non-negative row count per local expert summing to S, and one weight per row;
    returns the counts as a list."""
    counts = counts_L.tolist()
    if len(counts) != num_experts:
        raise ValueError(f"{op}: counts_L has {len(counts)} entries but the weights hold "
                         f"{num_experts} experts. Fix: pass one count per local expert "
                         f"(Dispatched.counts_L)")
    if any(n < 0 for n in counts) or sum(counts) != num_rows:
        raise ValueError(f"{op}: counts_L = {counts} sums to {sum(counts)} but x_SD has "
                         f"S = {num_rows} rows. Fix: counts_L must be the rows per expert of x_SD "
                         f"(all >= 0), i.e. Dispatched.counts_L")
    if probs_S is not None and tuple(probs_S.shape) != (num_rows,):
        raise ValueError(f"{op}: probs_S must have shape ({num_rows},), got "
                         f"{tuple(probs_S.shape)}. Fix: pass one routing weight per row")
    return counts
