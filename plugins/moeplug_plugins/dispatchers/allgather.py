"""``allgather`` dispatcher, structured like Megatron's MoEAllGatherTokenDispatcher.

Legend: T local tokens, G gathered tokens (T * ep_size), K top-k, D hidden, L local experts,
S rows for the local experts.

dispatch:
    1. gather       all-gather tokens, probs and ids over the EP group       -> x_GD, ids_GK
    2. select       choices of experts this rank owns keep their local id; the others, and the
                    choices dropped by capacity (``routing.dropped_TK``), go to a sink expert L,
                    whose rows sort last and are cut off
    3. permute      group the kept rows by local expert                       (moeplug.ops.permute)
    4. pad          prob-0 rows so each local expert holds capacity*ep_size rows or a multiple
                    of pad_multiple, when the routing asks for it          (moeplug.routing.rows)
                    (capacity*ep_size is the sum of the EP ranks' capacities: each rank's C
                    comes from its own token count, so they differ when those do)
combine: unpad -> zero rows for the sink -> unpermute -> reduce-scatter back to this rank's T tokens.
At one rank, gather and reduce-scatter are the identity and no choice goes to the sink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeplug.api import (append_sink_rows, Dispatched, Dispatcher, first_rows, ModelConfig,
                         pad_rows, padded_counts, permute, permute_probs, RouterOutput,
                         sink_dropped, unpad_rows, unpermute, workspace)
from moeplug_plugins.dispatchers import _ep_comm
from moeplug_plugins.dispatchers._group import ep_layout


@dataclass(frozen=True)
class AllGatherMeta:
    row_map_GK: torch.Tensor  # row of the [S + sink rows] buffer holding (gathered token, choice)
    num_sink_rows: int        # rows routed to other ranks' experts or dropped (zeros on the way back)
    sizes_W: tuple[int, ...] = ()  # tokens on each EP rank (to reduce-scatter back)
    pad_index_S: torch.Tensor | None = None  # padded-buffer position of each real row


class AllGatherDispatcher(Dispatcher):
    def __init__(self, model: ModelConfig, group=None):
        self.group = group
        self.ep_size, self.ep_rank, self.num_local_experts = ep_layout(model, group)
        self.num_experts = model.moe.num_experts
        # global expert -> local id on this rank, L (the sink) for the other ranks' experts
        L = self.num_local_experts
        self._local_id_E = torch.full((self.num_experts,), L, dtype=torch.int64)
        self._local_id_E[self.ep_rank * L:(self.ep_rank + 1) * L] = torch.arange(L)

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        L = self.num_local_experts
        # 1. gather
        sizes_W = self._gather_sizes(x_TD)
        x_GD, probs_GK, ids_GK = (self._all_gather(t, sizes_W)
                                  for t in (x_TD, routing.probs_TK, routing.ids_TK))
        dropped_GK = (None if routing.dropped_TK is None else  # bool travels as its bytes
                      self._all_gather(routing.dropped_TK.view(torch.uint8), sizes_W)
                      .view(torch.bool))
        # 2. select local experts (others and dropped choices -> sink expert L)
        local_GK = sink_dropped(self._local_ids(ids_GK), dropped_GK, L)
        # 3. permute over L + 1 experts; the sink's rows are last
        x_RD, row_map_GK, counts = permute(x_GD, local_GK, L + 1)
        probs_R = permute_probs(probs_GK, row_map_GK)
        num_sink = int(counts[L])
        S = x_RD.shape[0] - num_sink
        if num_sink:  # a slice's backward zero-fills and copies the whole buffer: only if needed
            x_RD, probs_R = first_rows(x_RD, S), first_rows(probs_R, S)
        counts_L = counts[:L].to(torch.int64).cpu()
        # 4. pad
        target_L = padded_counts(counts_L, routing.capacity, routing.pad_multiple, self.ep_size,
                                 self._capacities(routing.capacity))
        x_SD, probs_S, pad_index_S = pad_rows(x_RD, probs_R, counts_L, target_L)
        return Dispatched(x_SD, probs_S, target_L,
                          AllGatherMeta(row_map_GK=row_map_GK, num_sink_rows=num_sink,
                                        sizes_W=sizes_W, pad_index_S=pad_index_S))

    def _local_ids(self, ids_GK: torch.Tensor) -> torch.Tensor:
        """Each choice's local expert id, or L (the sink) for another rank's expert. On the CPU
        a lookup in ``_local_id_E``, one gather into the workspace, instead of a subtraction,
        two comparisons, an and and a where that each allocate."""
        L = self.num_local_experts
        if ids_GK.device.type != "cpu":
            local_GK = ids_GK - self.ep_rank * L
            return torch.where((local_GK >= 0) & (local_GK < L), local_GK,
                               torch.full_like(local_GK, L))
        out = workspace.empty((ids_GK.numel(),), torch.int64)
        return torch.index_select(self._local_id_E, 0, ids_GK.reshape(-1), out=out)\
            .view(ids_GK.shape)

    def combine(self, y_SD: torch.Tensor, meta: AllGatherMeta) -> torch.Tensor:
        y_RD = append_sink_rows(unpad_rows(y_SD, meta.pad_index_S), meta.num_sink_rows)
        y_GD = unpermute(y_RD, meta.row_map_GK)
        return self._reduce_scatter(y_GD, meta.sizes_W)

    # ---- collectives (identity at one rank; see _ep_comm) ----------------------------------
    def _capacities(self, capacity: int | None) -> list[int] | None:
        if capacity is None or self.ep_size == 1:
            return None
        return _ep_comm.gather_capacities(capacity, self.group)

    def _gather_sizes(self, x_TD: torch.Tensor) -> tuple[int, ...]:
        if self.ep_size == 1:
            return (x_TD.shape[0],)
        return tuple(_ep_comm.gather_sizes(x_TD.shape[0], self.group))

    def _all_gather(self, t: torch.Tensor, sizes_W: tuple[int, ...]) -> torch.Tensor:
        return t if self.ep_size == 1 else _ep_comm.all_gather_tokens(t, list(sizes_W), self.group)

    def _reduce_scatter(self, y_GD: torch.Tensor, sizes_W: tuple[int, ...]) -> torch.Tensor:
        if self.ep_size == 1:
            return y_GD
        return _ep_comm.reduce_scatter_tokens(y_GD, list(sizes_W), self.group)
