"""``alltoall`` dispatcher, structured like Megatron's MoEAlltoAllTokenDispatcher.

Legend: T local tokens, K top-k, D hidden, E experts (global), L local experts, S rows.

dispatch:
    1. permute      group this rank's T*K token copies by global expert   (moeplug.ops.permute)
    2. counts       exchange per-expert row counts with every EP rank
    3. all-to-all   send each expert's rows to the rank that owns it (in FP8 + scales when a
                    low-precision recipe with quantize_dispatch is active: moeplug.quant.wire)
    4. sort         received chunks are (source rank, local expert)-major: reorder expert-major
    5. pad          prob-0 rows so each local expert holds capacity*ep_size rows or a multiple
                    of pad_multiple, when the routing asks for it          (moeplug.routing.rows)
                    (capacity*ep_size is the sum of the EP ranks' capacities: each rank's C
                    comes from its own token count, so they differ when those do)
combine runs the inverse: unpad -> unsort -> all-to-all back -> unpermute (plain sum: rows carry p).
Choices dropped by capacity (``routing.dropped_TK``) are permuted to a sink expert E whose rows
sort last and are cut off before step 2; combine puts zero rows back in their place.
At one rank, steps 2-4 are the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeplug.config import ModelConfig
from moeplug.interfaces import Dispatched, Dispatcher, RouterOutput
from moeplug.ops import permute, unpermute
from moeplug.quant import active_recipe
from moeplug.quant.wire import quantized_exchange
from moeplug.routing import append_sink_rows, pad_rows, padded_counts, sink_dropped, unpad_rows
from moeplug_plugins.dispatchers import _ep_comm
from moeplug_plugins.dispatchers._group import ep_layout


@dataclass(frozen=True)
class AlltoAllMeta:
    row_map_TK: torch.Tensor  # row of the permuted buffer holding (token t, choice k)
    counts_E: torch.Tensor    # rows this rank sent per global expert (for the way back)
    plan: _ep_comm.A2APlan    # row counts of the EP exchange, both directions
    num_sink_rows: int = 0    # dropped choices' rows, cut after permute (zeros on the way back)
    pad_index_S: torch.Tensor | None = None  # padded-buffer position of each real row


class AlltoAllDispatcher(Dispatcher):
    def __init__(self, model: ModelConfig, group=None):
        self.group = group
        self.ep_size, self.ep_rank, self.num_local_experts = ep_layout(model, group)
        self.num_experts = model.moe.num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        E = self.num_experts
        # 1. permute (dropped choices -> sink expert E, whose rows come last and are cut off)
        has_sink = routing.dropped_TK is not None
        ids_TK = sink_dropped(routing.ids_TK, routing.dropped_TK, E)
        x_RD, row_map_TK, counts = permute(x_TD, ids_TK, E + 1 if has_sink else E)
        probs_R = routing.probs_TK.new_zeros(x_RD.shape[0]).index_put(
            (row_map_TK.reshape(-1),), routing.probs_TK.reshape(-1))
        num_sink = int(counts[E]) if has_sink else 0
        S = x_RD.shape[0] - num_sink
        x_SD, probs_S, counts_E = x_RD, probs_R, counts[:E]
        if num_sink:  # a slice's backward zero-fills and copies the whole buffer: only if needed
            x_SD, probs_S = x_RD[:S], probs_R[:S]
        # 2. counts  3. all-to-all  4. sort by local expert
        plan = self._exchange_counts(counts_E)
        x_SD, probs_S = self._send_rows(x_SD, plan), self._all_to_all(probs_S, plan)
        x_SD = self._sort_by_local_expert(x_SD, plan)
        probs_S = self._sort_by_local_expert(probs_S, plan)
        # 5. pad
        target_L = padded_counts(plan.counts_L, routing.capacity, routing.pad_multiple,
                                 self.ep_size, self._capacities(routing.capacity))
        x_SD, probs_S, pad_index_S = pad_rows(x_SD, probs_S, plan.counts_L, target_L)
        return Dispatched(x_SD, probs_S, target_L,
                          AlltoAllMeta(row_map_TK=row_map_TK, counts_E=counts_E, plan=plan,
                                       num_sink_rows=num_sink, pad_index_S=pad_index_S))

    def combine(self, y_SD: torch.Tensor, meta: AlltoAllMeta) -> torch.Tensor:
        y_SD = unpad_rows(y_SD, meta.pad_index_S)
        y_SD = self._unsort(y_SD, meta.plan)
        y_SD = self._all_to_all_back(y_SD, meta.plan)
        return unpermute(append_sink_rows(y_SD, meta.num_sink_rows), meta.row_map_TK)

    # ---- collectives (identity at one rank; see _ep_comm) ----------------------------------
    def _capacities(self, capacity: int | None) -> list[int] | None:
        if capacity is None or self.ep_size == 1:
            return None
        return _ep_comm.gather_capacities(capacity, self.group)

    def _exchange_counts(self, counts_E: torch.Tensor) -> _ep_comm.A2APlan:
        return _ep_comm.exchange_counts(counts_E, self.group)

    def _send_rows(self, x_SD: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        recipe = active_recipe()
        if recipe is None or not recipe.quantize_dispatch:
            return self._all_to_all(x_SD, plan)
        # Quantized at one rank too, so a single process sees the same numerics.
        return quantized_exchange(x_SD, recipe, lambda t: self._all_to_all(t, plan),
                                  lambda g: self._all_to_all_back(g, plan))

    def _all_to_all(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.ep_size == 1 else _ep_comm.all_to_all_there(rows, plan, self.group)

    def _sort_by_local_expert(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.ep_size == 1 else _ep_comm.sort_by_local_expert(rows, plan)

    def _unsort(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.ep_size == 1 else _ep_comm.unsort_by_local_expert(rows, plan)

    def _all_to_all_back(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.ep_size == 1 else _ep_comm.all_to_all_back(rows, plan, self.group)
