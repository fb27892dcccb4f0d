"""The budgeted dispatcher (``runtime.sync_free``): another dispatch/combine pair for the same
layer, with static shapes from a token budget and no host synchronisation, as DeepEP's
low-latency dispatch/combine sits beside its normal pair on the same Buffer.

Legend: T tokens, K top-k, D hidden, E experts, W EP ranks, P ETP ranks, L local experts,
C budget rows per (source rank, expert), G chunks the experts get (P*W), B = G*C rows per expert.

    C = ceil(T*K/E * runtime.token_budget)      (rounded up to a recipe's row alignment)
    dispatch   1. slots  2. gather  3. exchange              -> Dispatched of static shape
    (the layer's experts stage: the experts backend, on these rows)
    combine    5. exchange back  6. combine                  -> y_TD
Stages 1, 2 and 6: moeplug.moe.budgeted.slots (pure) and .arena (the CPU's eager form);
stages 3 and 5: moeplug.moe.budgeted.exchange. Each call's over-budget flag and its demand go
to the runtime's SyncFreeState (device tensors, no host read); the trainer reruns an
over-budget step on the wrapped dispatcher: no token is lost.

What the experts get, by what their backend declares (moeplug.interfaces.Experts):
  * ``packed_rows``, on the CPU, no recipe: the packed layout (``Dispatched.packed``): G chunks,
    each chunk's routed rows first, no weight; combine weights the outputs (FC2 is linear, so
    the weight never crosses ranks). The experts compute only the routed rows.
  * ``budget_rows`` (and under a recipe, and on a GPU): budget rows, every expert B rows, each
    row's weight beside it (0 on the empty slots' zero rows); combine sums. Under a recipe with
    ``quantize_dispatch`` the rows cross in its row format when the wrapped dispatcher's do
    (``Dispatcher.quantizes_dispatch``), so both compute alike.
Which one runs is decided per call (the device and the recipe are the call's); everything the
call makes travels in ``meta``, nothing stays on ``self``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeplug.interfaces import Dispatched, Dispatcher, RouterOutput
from moeplug.moe.budgeted import arena, slots
from moeplug.moe.budgeted.exchange import BudgetExchange
from moeplug.ops import cuda_ops
from moeplug.ops._grouped import budget_counts
from moeplug.quant import active_recipe
from moeplug.routing import expert_counts, kept


@dataclass(frozen=True)
class PackedMeta:
    slot: torch.Tensor      # arena form: slot_TK (-1: none); pure form: slot_N (E*C: none)
    probs_TK: torch.Tensor  # the routing weights stage 6 applies
    arena: bool             # which form ran stages 1-2 (and runs 6)


@dataclass(frozen=True)
class RowsMeta:
    slot_N: torch.Tensor    # each choice's slot (E*C: none)
    probs_TK: torch.Tensor
    budget: int             # C
    kernels: bool           # the runtime's CUDA slot kernels ran stage 2 (and run 6)


class BudgetedDispatcher(Dispatcher):
    """``inner``'s layer in static shapes. ``state``: the runtime's SyncFreeState (token
    budget, capture, where flags and demands go); ``group`` / ``etp_group``: the EP and ETP
    process groups ``inner`` and the experts are split over (None at one rank / without
    ETP); ``packed``: the experts backend implements ``forward_packed``; ``weighted_input``:
    ``moe.apply_probs_on_input`` (the packed layout scales its rows in stage 2; budget rows
    leave it to the layer, as the dynamic path does)."""

    overlaps_comm = True  # the packed exchange's start/wait pairs run on the backend's threads

    def __init__(self, inner: Dispatcher, state: Any, *, group: Any = None,
                 etp_group: Any = None, packed: bool = False, weighted_input: bool = False):
        self.inner, self.state = inner, state
        self.num_experts, self.num_local_experts = inner.num_experts, inner.num_local_experts
        self.quantizes_dispatch = inner.quantizes_dispatch
        ep_size = inner.num_experts // inner.num_local_experts
        if ep_size > 1 and group is None:
            raise ValueError(f"BudgetedDispatcher: {ep_size} EP ranks need the EP process "
                             f"group. Fix: pass the group the layer's dispatcher was built with")
        self.exchange = BudgetExchange(ep_size, group, etp_group)
        self.packed, self.weighted_input = packed, weighted_input

    # ---- what a call runs ------------------------------------------------------------------

    def budget(self, num_tokens: int, top_k: int) -> int:
        """C for a call of ``num_tokens`` tokens (a recipe's quantization blocks: each expert's
        rows a whole number of them)."""
        C = slots.budget_rows(num_tokens, top_k, self.num_experts, self.state.cfg.token_budget)
        recipe = active_recipe()
        if recipe is not None:
            align = recipe.row_alignment
            C = -(-C // align) * align
        return C

    def packs(self, x_TD: torch.Tensor) -> bool:
        """Whether this call lays its rows out packed (the CPU, the backend can, no recipe)."""
        return self.packed and x_TD.device.type == "cpu" and active_recipe() is None

    def report(self, overflow: torch.Tensor, wanted_E: torch.Tensor, routing: RouterOutput
               ) -> None:
        """The call's over-budget flag and demand to the runtime (device tensors)."""
        T, K = routing.ids_TK.shape
        self.state.note_overflow(overflow)
        self.state.note_demand(wanted_E, T * K / self.num_experts)

    def wanted(self, routing: RouterOutput) -> torch.Tensor:
        """Each expert's choices before the budget cut (the router's drops excluded)."""
        ids = routing.ids_TK.reshape(-1).detach()
        if ids.device.type == "cpu":
            keep = None if routing.dropped_TK is None else kept(routing.dropped_TK)
            return expert_counts(ids, self.num_experts, keep)
        keep = None if routing.dropped_TK is None else ~routing.dropped_TK.reshape(-1)
        return cuda_ops.device_counts(ids, self.num_experts, keep)

    # ---- the pair ---------------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        if self.packs(x_TD):
            return self._packed(x_TD, routing, None)
        return self._rows(x_TD, routing)

    def combine(self, y_SD: torch.Tensor, meta: Any) -> torch.Tensor:
        if isinstance(meta, PackedMeta):
            return self._packed_back(self.exchange.packed_back(y_SD), meta)
        return self.rows_back(self.exchange.rows_back(
            y_SD.view(self.num_local_experts, -1, y_SD.shape[1]), meta.budget), meta)

    # Split for the chunked overlap (model.moe.overlap_chunks > 1): the packed exchange runs on
    # the backend's threads between start and wait (eager, on the CPU, no recipe: RootConfig
    # refuses the rest, moeplug.moe.overlap checks it for a layer built without it).

    # Budget rows exchange inside *_start (the base class's way).

    def dispatch_start(self, x_TD: torch.Tensor, routing: RouterOutput) -> Any:
        if not self.packs(x_TD):
            return None, self.dispatch(x_TD, routing)
        return self._packed(x_TD, routing, start=True)

    def dispatch_wait(self, pending: Any) -> Dispatched:
        wait, d = pending
        if wait is None:
            return d
        x_ECD, counts_GL = wait()
        return Dispatched(x_ECD, None, counts_GL, d.meta, counts_E=d.counts_E, packed=True)

    def combine_start(self, y_SD: torch.Tensor, meta: Any) -> Any:
        if not isinstance(meta, PackedMeta):
            return None, self.combine(y_SD, meta)
        return self.exchange.packed_back_start(y_SD), meta

    def combine_wait(self, pending: Any) -> torch.Tensor:
        wait, meta = pending
        return meta if wait is None else self._packed_back(wait(), meta)

    # ---- packed (the CPU) ---------------------------------------------------------------------

    def _packed(self, x_TD: torch.Tensor, routing: RouterOutput, start: Any) -> Any:
        T, K = routing.ids_TK.shape
        E, W, C = self.num_experts, self.exchange.ep_size, self.budget(T, K)
        if self.state.arena:  # the stages in the layer's workspace arena
            x_ECD, counts_E, wanted_E, slot, overflow = arena.region_front(
                x_TD, routing, num_experts=E, budget=C, weighted_input=self.weighted_input,
                ep_size=W)
        else:  # the pure pieces, eagerly (a benchmark times them beside the arena's)
            x_ECD, slot, overflow, counts_E = slots.front(
                x_TD, routing.ids_TK, routing.dropped_TK, routing.probs_TK, E, C,
                self.weighted_input, True, W)
            wanted_E = self.wanted(routing)
        self.report(overflow, wanted_E, routing)
        meta = PackedMeta(slot, routing.probs_TK, self.state.arena)
        counts_WL = counts_E.view(W, -1)
        if start:
            return (self.exchange.packed_start(x_ECD, counts_WL),
                    Dispatched(x_ECD, None, counts_WL, meta, counts_E=counts_E, packed=True))
        x_ECD, counts_GL = self.exchange.packed(x_ECD, counts_WL)
        return Dispatched(x_ECD, None, counts_GL, meta, counts_E=counts_E, packed=True)

    def _packed_back(self, y_ECD: torch.Tensor, meta: PackedMeta) -> torch.Tensor:
        if meta.arena:
            return arena.region_back(y_ECD, meta.slot, meta.probs_TK, self.weighted_input)
        return slots.back(y_ECD, meta.slot, meta.probs_TK, self.weighted_input)

    # ---- budget rows --------------------------------------------------------------------------

    def kernels(self, x_TD: torch.Tensor) -> bool:
        """The runtime's CUDA slot kernels for stages 2 and 6 (a GPU with the extension, no
        recipe: a recipe's region gathers with torch, as it always did)."""
        return cuda_ops.available(x_TD) and active_recipe() is None

    def _rows(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        T, K = routing.ids_TK.shape
        C, kernels = self.budget(T, K), self.kernels(x_TD)
        x_ECD, p_S, slot_N, overflow, counts_E = slots.fixed_front(
            x_TD, routing.ids_TK, routing.dropped_TK, routing.probs_TK, self.num_experts, C,
            kernels)
        self.report(overflow, self.wanted(routing), routing)
        return self.rows_dispatched(x_ECD, p_S, slot_N, counts_E, routing.probs_TK, C, kernels)

    def rows_dispatched(self, x_ECD: torch.Tensor, p_S: torch.Tensor, slot_N: torch.Tensor,
                        counts_E: torch.Tensor, probs_TK: torch.Tensor, budget: int,
                        kernels: bool) -> Dispatched:
        """Stage 3 of budget rows: the rows (and their weights) to the experts' ranks."""
        L = self.num_local_experts
        recipe = active_recipe()
        wire = recipe if (recipe is not None and recipe.quantize_dispatch
                          and self.quantizes_dispatch) else None
        x_LBD = self.exchange.rows(x_ECD, L, budget, wire)
        p_LB = self.exchange.rows(p_S.unsqueeze(1), L, budget).squeeze(2)
        B = x_LBD.shape[1]
        return Dispatched(x_LBD.reshape(L * B, -1), p_LB.reshape(L * B), budget_counts(L, B),
                          RowsMeta(slot_N, probs_TK, budget, kernels), counts_E=counts_E)

    def rows_back(self, y_ECD: torch.Tensor, meta: RowsMeta) -> torch.Tensor:
        """Stage 6 of budget rows."""
        return slots.fixed_back(y_ECD, meta.slot_N, meta.probs_TK, meta.kernels)
