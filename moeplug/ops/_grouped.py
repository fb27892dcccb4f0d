"""Pieces shared by the two grouped expert-MLP ops (:mod:`moeplug.ops.expert_mlp`, fused SwiGLU,
and :mod:`moeplug.ops.grouped_mlp`, any activation): both take rows grouped by expert with one
count per local expert, and both run their GEMMs in the autocast dtype when autocast is on.

Shape legend: S routed rows (grouped by expert), L local experts.
"""

from __future__ import annotations

import torch

from moeplug.ops import workspace
from moeplug.ops.workspace import Empty


def expert_slices(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start, end) for every expert that received rows; empty experts get no GEMM."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


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
    grad = empty(tuple(w.shape), w.dtype)
    used = {e for e, _, _ in slices}
    for e in range(w.shape[0]):
        if e not in used:
            grad[e].zero_()
    return grad


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
