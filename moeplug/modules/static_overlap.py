"""Chunked overlap of the sync-free region (``runtime.sync_free`` with
``model.moe.overlap_chunks`` = N > 1), eager on the CPU.

Legend as in moeplug.modules.static_moe; T_c tokens of chunk c, C_c its budget rows.

The static region (moeplug.modules.static_arena) as a dispatcher of the chunked pipeline that
the dynamic layer runs (moeplug.modules.moe_overlap.overlapped_routed): per chunk of tokens,
stages 1-2 into its own packed slots, the EP exchange started and waited for later
(``PackedExchange.start``), stage 4 over the chunks that arrived, the way back started, and
stage 6. So chunk c+1's rows travel while chunk c's experts compute, exactly as on the dynamic
path, and every size is still static: chunk c has the budget
    C_c = ceil(T_c*K/E * runtime.token_budget)
of a micro-batch of T_c tokens. Each chunk's over-budget flag joins the step's (one rerun on the
dynamic path, as unchunked), and its demand is measured against its own balanced load T_c*K/E,
so the budget a rerun names is the one the chunks would have needed. Chunks hold fewer tokens
than the micro-batch, so they go over a given budget more often than the whole would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moeplug.modules import static_arena
from moeplug.modules.moe_overlap import overlapped_routed
from moeplug.modules.static_moe import PackedExchange, budget_rows
from moeplug.ops import workspace


@dataclass(frozen=True)
class _ChunkMeta:
    slot_TK: torch.Tensor   # each choice's slot (-1: none), for stage 6
    probs_TK: torch.Tensor  # the chunk's routing weights
    exchange: PackedExchange


@dataclass(frozen=True)
class _Arrived:
    x_ECD: torch.Tensor      # the chunks that arrived (P*W of them under ETP)
    counts_WL: torch.Tensor  # their kept rows per local expert
    meta: _ChunkMeta


class StaticChunks:
    """``overlapped_routed``'s dispatcher over the static region: one per layer call (it
    collects the chunks' flags, counts and demands, in call order)."""

    def __init__(self, *, num_experts: int, token_budget: float, weighted_input: bool,
                 ep_size: int, group: Any, etp_group: Any) -> None:
        self.num_experts, self.token_budget = num_experts, token_budget
        self.weighted_input, self.ep_size = weighted_input, ep_size
        self.group, self.etp_group = group, etp_group
        self.flags: list[torch.Tensor] = []   # each chunk's over-budget flag
        self.counts: list[torch.Tensor] = []  # its kept rows per expert
        self.demands: list[tuple[torch.Tensor, float]] = []  # (choices per expert, T_c*K/E)

    def kept_counts(self) -> torch.Tensor:
        """counts_E of the whole micro-batch: the chunks' summed (into the arena)."""
        total = workspace.empty(tuple(self.counts[0].shape), self.counts[0].dtype)
        total.copy_(self.counts[0])
        for counts_E in self.counts[1:]:
            total.add_(counts_E)
        return total

    def dispatch_start(self, x_TD: torch.Tensor, routing: Any) -> tuple:
        T, K = routing.ids_TK.shape
        E, W = self.num_experts, self.ep_size
        C = budget_rows(T, K, E, self.token_budget)
        x_ECD, counts_E, wanted_E, slot_TK, overflow = static_arena.region_front(
            x_TD, routing, num_experts=E, budget=C, weighted_input=self.weighted_input,
            ep_size=W)
        self.flags.append(overflow)
        self.counts.append(counts_E)
        self.demands.append((wanted_E, T * K / E))
        exchange = PackedExchange(E // W * C, W, self.group, self.etp_group)
        return exchange.start(x_ECD, counts_E.view(W, -1)), \
            _ChunkMeta(slot_TK, routing.probs_TK, exchange)

    def dispatch_wait(self, started: tuple) -> _Arrived:
        wait, meta = started
        return _Arrived(*wait(), meta)

    def combine_start(self, y_WSD: torch.Tensor, meta: _ChunkMeta) -> tuple:
        return meta.exchange.back_start(y_WSD.view(-1, y_WSD.shape[2])), meta

    def combine_wait(self, started: tuple) -> torch.Tensor:
        wait, meta = started
        return static_arena.region_back(wait(), meta.slot_TK, meta.probs_TK,
                                        self.weighted_input)


def overlapped_static(x_TD: torch.Tensor, routing: Any, num_chunks: int, w13_LXD: torch.Tensor,
                      w2_LDF: torch.Tensor, *, num_experts: int, token_budget: float,
                      activation: str, weighted_input: bool, ep_size: int, group: Any,
                      etp_group: Any, shared: Callable[[torch.Tensor], torch.Tensor] | None,
                      stash_scope: Callable[[], Any] | None, experts_call: Callable | None
                      ) -> tuple[torch.Tensor, StaticChunks]:
    """y_TD (+ ``shared(x_TD)``, computed during the first exchange) of the static region
    pipelined over ``num_chunks`` chunks, and the per-call :class:`StaticChunks` holding each
    chunk's overflow flag, kept counts per expert and demand. ``stash_scope()``: a fresh
    paged-stash scope for one chunk's stage 4, or None."""
    chunks = StaticChunks(num_experts=num_experts, token_budget=token_budget,
                          weighted_input=weighted_input, ep_size=ep_size, group=group,
                          etp_group=etp_group)

    def experts(arrived: _Arrived) -> torch.Tensor:
        return static_arena.region_experts(arrived.x_ECD, arrived.counts_WL, w13_LXD, w2_LDF,
                                           activation, experts_call)

    y_TD = overlapped_routed(x_TD, routing, num_chunks, chunks, experts, shared,
                             stash_scope or contextlib.nullcontext)
    return y_TD, chunks
