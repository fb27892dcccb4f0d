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
Overlap (``dispatch_start``/``dispatch_wait``, ``combine_start``/``combine_wait``; see
moeplug.interfaces.Dispatcher): steps 1-2 and the start of 3 run in ``dispatch_start``, the rows
travel on gloo's (or NCCL's) own threads (``comm.all_to_all_start``), ``dispatch_wait`` finishes
3 and runs 4-5; combine splits after its all-to-all back is started. Same rows, same order, so
the same numbers as ``dispatch``/``combine``. A recipe that quantizes the dispatch exchanges
synchronously inside ``dispatch_start`` (its FP8 round trip has no split form yet).
Choices dropped by capacity (``routing.dropped_TK``) are permuted to a sink expert E whose rows
sort last and are cut off before step 2; combine puts zero rows back in their place.
At one rank, steps 2-4 are the identity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeplug.api import (active_recipe, append_sink_rows, comm, Dispatched, Dispatcher, first_rows,
                         ModelConfig, pad_rows, padded_counts, permute, permute_probs,
                         quantized_exchange, RouterOutput, sink_dropped, unpad_rows, unpermute)
from moeplug_plugins.dispatchers import _ep_comm
from moeplug_plugins.dispatchers._group import ep_layout


@dataclass(frozen=True)
class AlltoAllMeta:
    row_map_TK: torch.Tensor  # row of the permuted buffer holding (token t, choice k)
    counts_E: torch.Tensor    # rows this rank sent per global expert (for the way back)
    plan: _ep_comm.A2APlan    # row counts of the EP exchange, both directions
    num_sink_rows: int = 0    # dropped choices' rows, cut after permute (zeros on the way back)
    pad_index_S: torch.Tensor | None = None  # padded-buffer position of each real row


@dataclass(frozen=True)
class _PendingDispatch:
    """Between dispatch_start and dispatch_wait: the rows in flight and what comes after."""
    x: comm.PendingAllToAll | torch.Tensor      # a tensor when exchanged synchronously
    probs: comm.PendingAllToAll
    meta: AlltoAllMeta
    capacity: int | None
    pad_multiple: int


class AlltoAllDispatcher(Dispatcher):
    quantizes_dispatch = True  # moeplug.quant.wire under a quantize_dispatch recipe
    overlaps_comm = True  # dispatch_start / combine_start return with the exchange in flight

    def __init__(self, model: ModelConfig, group=None):
        self.group = group
        self.ep_size, self.ep_rank, self.num_local_experts = ep_layout(model, group)
        self.num_experts = model.moe.num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        x_SD, probs_S, row_map_TK, counts_E, num_sink = self._permute(x_TD, routing)
        # 2. counts  3. all-to-all  4. sort by local expert
        plan = self._exchange_counts(counts_E, x_SD.shape[0])
        x_SD, probs_S = self._send_rows(x_SD, plan), self._all_to_all(probs_S, plan)
        meta = AlltoAllMeta(row_map_TK=row_map_TK, counts_E=counts_E, plan=plan,
                            num_sink_rows=num_sink)
        return self._sort_and_pad(x_SD, probs_S, meta, routing.capacity, routing.pad_multiple)

    def dispatch_start(self, x_TD: torch.Tensor, routing: RouterOutput) -> _PendingDispatch:
        x_SD, probs_S, row_map_TK, counts_E, num_sink = self._permute(x_TD, routing)
        # small and blocking: the splits are needed now
        plan = self._exchange_counts(counts_E, x_SD.shape[0])
        recipe = active_recipe()
        x = (self._start(x_SD, plan) if recipe is None or not recipe.quantize_dispatch else
             self._send_rows(x_SD, plan))
        meta = AlltoAllMeta(row_map_TK=row_map_TK, counts_E=counts_E, plan=plan,
                            num_sink_rows=num_sink)
        return _PendingDispatch(x, self._start(probs_S, plan), meta, routing.capacity,
                                routing.pad_multiple)

    def dispatch_wait(self, pending: _PendingDispatch) -> Dispatched:
        x_SD = pending.x if isinstance(pending.x, torch.Tensor) else pending.x.wait()
        return self._sort_and_pad(x_SD, pending.probs.wait(), pending.meta, pending.capacity,
                                  pending.pad_multiple)

    def combine_start(self, y_SD: torch.Tensor, meta: AlltoAllMeta):
        y_SD = self._unsort(unpad_rows(y_SD, meta.pad_index_S), meta.plan)
        pending = comm.all_to_all_start(y_SD, meta.plan.send_W, meta.plan.recv_W, self.group)
        return pending, meta

    def combine_wait(self, pending) -> torch.Tensor:
        rows, meta = pending
        return unpermute(append_sink_rows(rows.wait(), meta.num_sink_rows), meta.row_map_TK)

    def _permute(self, x_TD: torch.Tensor, routing: RouterOutput):
        E = self.num_experts
        # 1. permute (dropped choices -> sink expert E, whose rows come last and are cut off)
        has_sink = routing.dropped_TK is not None
        ids_TK = sink_dropped(routing.ids_TK, routing.dropped_TK, E)
        x_RD, row_map_TK, counts = permute(x_TD, ids_TK, E + 1 if has_sink else E)
        probs_R = permute_probs(routing.probs_TK, row_map_TK)
        num_sink = int(counts[E]) if has_sink else 0
        S = x_RD.shape[0] - num_sink
        x_SD, probs_S = x_RD, probs_R
        if num_sink:  # a slice's backward zero-fills and copies the whole buffer: only if needed
            x_SD, probs_S = first_rows(x_RD, S), first_rows(probs_R, S)
        return x_SD, probs_S, row_map_TK, counts[:E], num_sink

    def _sort_and_pad(self, x_SD: torch.Tensor, probs_S: torch.Tensor, meta: AlltoAllMeta,
                      capacity: int | None, pad_multiple: int) -> Dispatched:
        plan = meta.plan
        x_SD = self._sort_by_local_expert(x_SD, plan)                  # 4. sort
        probs_S = self._sort_by_local_expert(probs_S, plan)
        target_L = padded_counts(plan.counts_L, capacity, pad_multiple,  # 5. pad
                                 self.ep_size, self._capacities(capacity))
        x_SD, probs_S, pad_index_S = pad_rows(x_SD, probs_S, plan.counts_L, target_L)
        return Dispatched(x_SD, probs_S, target_L,
                          dataclasses.replace(meta, pad_index_S=pad_index_S))

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

    def _exchange_counts(self, counts_E: torch.Tensor, num_rows: int) -> _ep_comm.A2APlan:
        if self.ep_size == 1:
            return _ep_comm.local_plan(counts_E, num_rows)
        return _ep_comm.exchange_counts(counts_E, self.group)

    def _start(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> comm.PendingAllToAll:
        return comm.all_to_all_start(rows, plan.recv_W, plan.send_W, self.group)

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
