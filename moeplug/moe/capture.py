"""runtime.capture: a schedule of the MoE layer's stages 2-4 under the budgeted dispatcher, as
pieces compiled once (the CPU: torch.compile fullgraph, moeplug.runtime.syncfree.captured) or recorded
as runtime CUDA graphs (moeplug.runtime.cuda_graph.GraphedPieces) and replayed every step.

Legend: T tokens, K top-k, D hidden, E experts, L local experts, C budget rows, W EP ranks.

A process-group call cannot be captured, so the exchanges sit between pieces:
    one EP rank, no ETP, no stash     one piece: stages 1-2, the experts, stage 6 (``one_rank``)
    else                              front (stages 1-2) | exchange | experts | exchange | back
The pieces are the budgeted dispatcher's pure stages (moeplug.moe.budgeted.slots) and the
layer's own experts call (``MoELayer.experts_call``: the experts backend on budget rows, which
must declare ``Experts.capturable``); their parameters go in as inputs, so a recording updates
with the optimizer's steps. With the paged stash (runtime.stash) the experts run eagerly
between captured pieces: what they save goes to the stash's pages, which a graph cannot reach.
Every shape follows from (T, K, D, E, W, C): a piece compiles or records once per shape.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from moeplug.interfaces import Dispatcher, RouterOutput
from moeplug.moe.budgeted import slots
from moeplug.moe.budgeted.dispatcher import budget_counts


def captured(layer: Any, dispatcher: Dispatcher, x_TD: torch.Tensor,
             routing: RouterOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_TD + the shared experts, the kept counts per expert) of one layer call."""
    wrap = functools.partial(dispatcher.state.wrap, owner=layer)
    T, K = routing.ids_TK.shape
    C, packed, kernels = dispatcher.budget(T, K), dispatcher.packs(x_TD), dispatcher.kernels(x_TD)
    params = tuple(layer.experts.parameters())
    args = (routing.ids_TK, routing.dropped_TK, routing.probs_TK)
    stashed = layer.runtime is not None and layer.runtime.runtime.stash_active
    if dispatcher.exchange.is_identity and not stashed:
        counts_L = None if packed else budget_counts(dispatcher.num_local_experts, C)
        y_TD, overflow, counts_E = wrap(one_rank)(x_TD, *args, dispatcher, layer.experts_call,
                                                  C, packed, kernels, counts_L, *params)
    else:
        y_TD, overflow, counts_E = _pieces(layer, dispatcher, wrap, x_TD, routing, C, packed,
                                           kernels, params, stashed)
    dispatcher.report(overflow, dispatcher.wanted(routing), routing)
    return layer.shared_experts_add(x_TD, y_TD), counts_E


def one_rank(x_TD: torch.Tensor, ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
             probs_TK: torch.Tensor, dispatcher: Any, experts_call: Callable, budget: int,
             packed: bool, kernels: bool, counts_L: torch.Tensor | None, *params: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1-6 at one EP rank (the exchanges are views): (y_TD, overflow, counts_E).
    ``params``: the experts' parameters, the inputs a recording differentiates (the call
    reads them off the module). Packed (the CPU): the experts compute only the routed rows;
    budget rows (a GPU: the runtime's CUDA slot kernels with ``kernels``): every slot."""
    E = dispatcher.num_experts
    if packed:
        x_SD, slot_N, overflow, counts_E = slots.front(x_TD, ids_TK, dropped_TK, probs_TK, E,
                                                       budget, dispatcher.weighted_input, True)
        y_SD = experts_call(x_SD, None, counts_E.view(1, -1), True)
        return (slots.back(y_SD, slot_N, probs_TK, dispatcher.weighted_input), overflow,
                counts_E)
    x_SD, p_S, slot_N, overflow, counts_E = slots.fixed_front(x_TD, ids_TK, dropped_TK,
                                                              probs_TK, E, budget, kernels)
    y_SD = experts_call(x_SD, p_S, counts_L, False)
    return slots.fixed_back(y_SD, slot_N, probs_TK, kernels), overflow, counts_E


def experts_piece(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts_L: torch.Tensor,
                  packed: bool, experts_call: Callable, *params: torch.Tensor) -> torch.Tensor:
    """Stage 4 as a piece of its own (between the exchanges); ``params`` as in one_rank."""
    return experts_call(x_SD, probs_S, counts_L, packed)


def _pieces(layer: Any, dispatcher: Any, wrap: Callable, x_TD: torch.Tensor,
            routing: RouterOutput, C: int, packed: bool, kernels: bool, params: tuple,
            stashed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """front | exchange | experts | exchange | back."""
    E, W, ex = dispatcher.num_experts, dispatcher.exchange.ep_size, dispatcher.exchange
    args = (x_TD, routing.ids_TK, routing.dropped_TK, routing.probs_TK, E, C)

    def experts(x_SD, probs_S, counts_L):
        if not stashed:
            return wrap(experts_piece)(x_SD, probs_S, counts_L, packed, layer.experts_call,
                                       *params)
        with layer.stash_scope():  # eager: the stash's saved-tensor hooks see the experts
            return layer.experts_call(x_SD, probs_S, counts_L, packed)

    if packed:
        x_ECD, slot_N, overflow, counts_E = wrap(slots.front)(*args, dispatcher.weighted_input,
                                                              True, W)
        x_ECD, counts_GL = ex.packed(x_ECD, counts_E.view(W, -1))
        y_ECD = ex.packed_back(experts(x_ECD, None, counts_GL))
        return (wrap(slots.back)(y_ECD, slot_N, routing.probs_TK, dispatcher.weighted_input),
                overflow, counts_E)
    x_ECD, p_S, slot_N, overflow, counts_E = wrap(slots.fixed_front)(*args, kernels)
    d = dispatcher.rows_dispatched(x_ECD, p_S, slot_N, counts_E, routing.probs_TK, C, kernels)
    y_SD = experts(d.x_SD, d.probs_S, d.counts_L)
    y_ECD = ex.rows_back(y_SD.view(dispatcher.num_local_experts, -1, y_SD.shape[1]), C)
    return wrap(slots.fixed_back)(y_ECD, slot_N, routing.probs_TK, kernels), overflow, counts_E
