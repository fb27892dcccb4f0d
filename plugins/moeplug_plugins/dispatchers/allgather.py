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

from moeplug.config import ModelConfig
from moeplug.interfaces import Dispatched, Dispatcher, RouterOutput
from moeplug.ops import permute, unpermute
from moeplug.routing import append_sink_rows, pad_rows, padded_counts, sink_dropped, unpad_rows
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

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        L = self.num_local_experts
        # 1. gather
        sizes_W = self._gather_sizes(x_TD)
        x_GD, probs_GK, ids_GK = (self._all_gather(t, sizes_W)
                                  for t in (x_TD, routing.probs_TK, routing.ids_TK))
        dropped_GK = (None if routing.dropped_TK is None else
                      self._all_gather(routing.dropped_TK.to(torch.uint8), sizes_W).bool())
        # 2. select local experts (others and dropped choices -> sink expert L)
        local_GK = ids_GK - self.ep_rank * L
        is_local_GK = (local_GK >= 0) & (local_GK < L)
        local_GK = sink_dropped(torch.where(is_local_GK, local_GK, torch.full_like(local_GK, L)),
                                dropped_GK, L)
        # 3. permute over L + 1 experts; the sink's rows are last
        x_RD, row_map_GK, counts = permute(x_GD, local_GK, L + 1)
        probs_R = probs_GK.new_zeros(x_RD.shape[0]).index_put(
            (row_map_GK.reshape(-1),), probs_GK.reshape(-1))
        num_sink = int(counts[L])
        S = x_RD.shape[0] - num_sink
        counts_L = counts[:L].to(torch.int64).cpu()
        # 4. pad
        target_L = padded_counts(counts_L, routing.capacity, routing.pad_multiple, self.ep_size,
                                 self._capacities(routing.capacity))
        x_SD, probs_S, pad_index_S = pad_rows(x_RD[:S], probs_R[:S], counts_L, target_L)
        return Dispatched(x_SD, probs_S, target_L,
                          AllGatherMeta(row_map_GK=row_map_GK, num_sink_rows=num_sink,
                                        sizes_W=sizes_W, pad_index_S=pad_index_S))

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
