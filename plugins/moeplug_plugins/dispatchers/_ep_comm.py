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

from moeplug.parallel import comm


@dataclass(frozen=True)
class A2APlan:
    """Row counts of one dispatch all-to-all, for both directions.

    send_W:    rows this rank sends to each EP rank (the way there).
    recv_W:    rows this rank receives from each EP rank.
    counts_WL: rows received from rank w for local expert l (int64 CPU); arrival order is
               (source rank, local expert)-major, the experts want (local expert, source rank).
    order_S:   ``rows[order_S]`` sorts arrived rows expert-major (see :func:`chunk_order`);
               None in a one-rank plan (:func:`local_plan`), where that sort is never run.
    """

    send_W: list[int]
    recv_W: list[int]
    counts_WL: torch.Tensor
    order_S: torch.Tensor | None

    @property
    def counts_L(self) -> torch.Tensor:
        if self.counts_WL.shape[0] == 1:  # one rank: its row, no reduction (no allocation)
            return self.counts_WL[0]
        return self.counts_WL.sum(dim=0)


def local_plan(counts_E: torch.Tensor, num_rows: int) -> A2APlan:
    """The plan of a one-rank EP group, where rows go nowhere: :func:`exchange_counts`'s
    numbers, built from views and ``num_rows`` (= counts_E.sum()) without a collective or an
    allocation. ``order_S`` is None: the one-rank sort is the identity and is never run."""
    return A2APlan(send_W=[num_rows], recv_W=[num_rows], counts_WL=counts_E.view(1, -1),
                   order_S=None)


def exchange_counts(counts_E: torch.Tensor, group: Any) -> A2APlan:
    """All-to-all of per-expert row counts: rank r sends ``counts_E[r*L:(r+1)*L]`` to rank r."""
    W = comm.group_size(group)
    counts_E = counts_E.to(torch.int64).cpu()
    if counts_E.numel() % W:
        raise ValueError(f"counts_E has {counts_E.numel()} experts, not divisible by the EP size "
                         f"{W}. Fix: choose num_experts a multiple of the expert-parallel size")
    L = counts_E.numel() // W
    send_WL = counts_E.view(W, L)
    with torch.no_grad():
        counts_WL = comm.all_to_all(send_WL, [1] * W, [1] * W, group)
    return A2APlan(send_W=send_WL.sum(dim=1).tolist(), recv_W=counts_WL.sum(dim=1).tolist(),
                   counts_WL=counts_WL, order_S=chunk_order(counts_WL))


def all_to_all_there(rows_N: torch.Tensor, plan: A2APlan, group: Any) -> torch.Tensor:
    """Each rank's rows to the ranks owning their experts; arrives (source rank, expert)-major."""
    return comm.all_to_all(rows_N, plan.recv_W, plan.send_W, group)


def all_to_all_back(rows_S: torch.Tensor, plan: A2APlan, group: Any) -> torch.Tensor:
    """The inverse of :func:`all_to_all_there` (rows must be back in arrival order)."""
    return comm.all_to_all(rows_S, plan.send_W, plan.recv_W, group)


def chunk_order(counts_WL: torch.Tensor) -> torch.Tensor:
    """idx_S such that ``rows[idx_S]`` turns (w, l)-major chunks into (l, w)-major ones.

    Stable inside each chunk, so rows of one expert stay in (source rank, token, k) order -
    the same order a single process would give the concatenation of every rank's tokens.
    """
    W, L = counts_WL.shape
    flat = counts_WL.reshape(-1)
    start_WL = (torch.cumsum(flat, 0) - flat).view(W, L)   # where each chunk starts on arrival
    sizes_LW = counts_WL.t().reshape(-1)
    starts_LW = start_WL.t().reshape(-1)
    S = int(flat.sum())
    # For output row i in chunk c: arrival row = start of c on arrival + (i - start of c in output).
    out_start_LW = torch.cumsum(sizes_LW, 0) - sizes_LW
    offset_S = torch.arange(S, dtype=torch.int64) - torch.repeat_interleave(out_start_LW, sizes_LW)
    return torch.repeat_interleave(starts_LW, sizes_LW) + offset_S


def sort_by_local_expert(rows_S: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    return rows_S.index_select(0, plan.order_S.to(rows_S.device))


def unsort_by_local_expert(rows_S: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """Inverse of :func:`sort_by_local_expert`: expert-major rows back to arrival order."""
    idx_S = plan.order_S.to(rows_S.device)
    inverse_S = torch.empty_like(idx_S)
    inverse_S[idx_S] = torch.arange(idx_S.numel(), dtype=idx_S.dtype, device=idx_S.device)
    return rows_S.index_select(0, inverse_S)


# --- allgather dispatcher ----------------------------------------------------------------------

def gather_sizes(num_tokens: int, group: Any) -> list[int]:
    """Tokens on every EP rank (ranks may hold different T)."""
    W = comm.group_size(group)
    with torch.no_grad():
        sizes_W = comm.all_gather(torch.tensor([num_tokens], dtype=torch.int64), group, [1] * W)
    return sizes_W.tolist()


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
