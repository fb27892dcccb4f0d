"""Where every row goes in the direct-write dispatcher, computed on every rank from the row counts
all ranks published in the heap (no count exchange over the network).

Legend: W ranks, E experts, L local experts (E = W * L), T tokens, K top-k, N rows this rank
sends (its kept choices), P rows a rank's experts hold (with padding).

Receiver r lays its rows out exactly as the alltoall dispatcher returns them: local-expert-major,
then source rank, then the source's (token, k) order, then the padding rows of that expert:

    [ l0: s0 rows | s1 rows | ... | pad ][ l1: s0 rows | ... | pad ] ...

so a sender writes its rows for (r, l) at ``off_SRL[s, r, l]`` on, and receiver r's data region
is x_SD as it stands. Combine sends back, per (source s, local expert l), one contiguous run to
s's rows in s's expert-major order, where s sums its K rows per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeplug.api import expert_counts, get_runtime, padded_counts, sink_dropped, workspace


@dataclass(frozen=True)
class DirectWritePlan:
    dest_rank_TK: torch.Tensor  # receiver of (t, k); -1: dropped
    dest_row_TK: torch.Tensor   # its row there
    row_map_TK: torch.Tensor    # row of (t, k) in this rank's expert-major order; -1: dropped
    recv_rows_W: list[int]      # P of every rank (dispatch direction)
    send_rows_W: list[int]      # N of every rank (combine direction)
    chunks_C4: torch.Tensor     # combine runs from this rank: (src_row, source, dest_row, rows)
    counts_L: torch.Tensor      # rows per local expert here, padding included (int64 CPU)
    counts_WL: torch.Tensor     # real rows received from rank w for local expert l (as alltoall)
    pad_index_S: torch.Tensor | None  # positions of the real rows among P (None: no padding)
    pad_rows: torch.Tensor | None     # positions of the padding rows (zeroed on receipt)


def local_counts(ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, E: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with dropped choices sent to sink E, rows per expert kept) of this rank, in the
    running layer's workspace (bincount's min, max and zeros each allocated)."""
    ids = sink_dropped(ids_TK, dropped_TK, E)
    return ids, expert_counts(ids, E + 1)[:E]  # the sink's count cut


def _empty(shape: tuple[int, ...], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return workspace.empty(shape, dtype)


def build_plan(counts_WE: torch.Tensor, ids_TK: torch.Tensor, rank: int,
               capacity: int | None, capacity_W: list[int] | None, pad_multiple: int
               ) -> DirectWritePlan:
    """``counts_WE``: rows every rank keeps per expert; ``ids_TK``: this rank's ids, dropped
    choices already at the sink E. ``capacity_W``: every rank's capacity (pad-to-capacity).
    Without padding every tensor is an out= result in the running layer's workspace (the
    plan's few [W, W, L] sums allocated ~20 small tensors a call)."""
    W, E = counts_WE.shape
    L = E // W
    T, K = ids_TK.shape
    c_SRL = counts_WE.view(W, W, L)
    real_RL = torch.sum(c_SRL, 0, out=_empty((W, L)))
    # Every rank computes every receiver's padding (the same numbers alltoall computes there),
    # so an over-capacity error is raised on all ranks alike rather than leaving peers waiting.
    target_RL = torch.stack([padded_counts(real_RL[r], capacity, pad_multiple, W, capacity_W)
                             for r in range(W)], out=_empty((W, L)))
    estart_RL = torch.cumsum(target_RL, 1, out=_empty((W, L))).sub_(target_RL)
    off_SRL = torch.cumsum(c_SRL, 0, out=_empty((W, W, L))).sub_(c_SRL).add_(estart_RL)
    prefix_WE = torch.cumsum(counts_WE, 1, out=_empty((W, E))).sub_(counts_WE)

    # This rank's rows: a stable counting sort by expert gives each (t, k) its place in its
    # expert's run (the runtime's place_rows; place_rows_reference is the same in torch).
    flat = ids_TK.reshape(-1).contiguous()
    row_map, dest_rank, dest_row = (_empty((flat.numel(),)) for _ in range(3))
    base_E = off_SRL[rank].reshape(E)  # a row of a contiguous tensor: contiguous
    scratch = _empty((2 * E + 1,))
    get_runtime().place_rows(ids=flat.data_ptr(), num_choices=flat.numel(), num_experts=E,
                             local_experts=L, base=base_E.data_ptr(), scratch=scratch.data_ptr(),
                             row_map=row_map.data_ptr(), dest_rank=dest_rank.data_ptr(),
                             dest_row=dest_row.data_ptr())

    # Combine runs from this rank's rows back to each source s, per local expert l (runs of 0
    # rows copy nothing: kept, so the table's size is W * L whatever the routing).
    rows_SL = c_SRL[:, rank, :]
    src_SL = off_SRL[:, rank, :]
    dst_SL = prefix_WE[:, rank * L:(rank + 1) * L]
    s_SL = torch.arange(W, out=_empty((W,))).unsqueeze(1).expand(W, L)
    chunks = torch.stack([src_SL, s_SL, dst_SL, rows_SL], dim=-1,
                         out=_empty((W, L, 4))).view(W * L, 4)

    target_L, real_L = target_RL[rank], real_RL[rank]
    pad_index = pad_rows = None
    if not torch.equal(target_L, real_L):
        P = int(target_L.sum())
        real = torch.zeros(P, dtype=torch.bool)
        start_L = estart_RL[rank]
        for l in range(L):
            real[int(start_L[l]):int(start_L[l] + real_L[l])] = True
        pad_index, pad_rows = real.nonzero().reshape(-1), (~real).nonzero().reshape(-1)
    # The row sums in Python: torch's would each allocate a result.
    return DirectWritePlan(
        dest_rank_TK=dest_rank.view(T, K), dest_row_TK=dest_row.view(T, K),
        row_map_TK=row_map.view(T, K), recv_rows_W=[sum(r) for r in target_RL.tolist()],
        send_rows_W=[sum(r) for r in counts_WE.tolist()], chunks_C4=chunks, counts_L=target_L,
        counts_WL=_empty((W, L)).copy_(rows_SL),
        pad_index_S=pad_index, pad_rows=pad_rows)


def place_rows_reference(ids_N: torch.Tensor, E: int, L: int, base_E: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_map, dest_rank, dest_row) of the runtime's place_rows in plain torch: a stable sort
    by expert, -1 for the dropped choices (id E). The tests' reference."""
    order = torch.sort(ids_N, stable=True).indices
    pos = torch.empty_like(order)
    pos[order] = torch.arange(ids_N.numel(), dtype=order.dtype)
    keep = ids_N < E
    e = ids_N.clamp(max=E - 1)
    counts_E = torch.bincount(ids_N, minlength=E + 1)[:E]
    first_E = torch.cumsum(counts_E, 0) - counts_E
    dest_row = base_E[e] + pos - first_E[e]
    return (torch.where(keep, pos, -1), torch.where(keep, e // L, -1),
            torch.where(keep, dest_row, -1))
