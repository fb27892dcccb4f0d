"""Chunked overlap inside one MoE layer (``model.moe.overlap_chunks`` = N > 1): a schedule
over the layer's stages 2-6.

Legend: T tokens, D hidden, K top-k, S routed rows of a chunk, N chunks; ``x_TD[c]`` is the
c-th of N contiguous token ranges, tokens [c*T//N, (c+1)*T//N).

The router has already run on all T tokens (so its aux loss, capacity and drops are those of
the whole micro-batch); stages 2-5 of ``MoELayer.forward`` then run as a pipeline over the
chunks, each exchange on the backend's own threads (``Dispatcher.dispatch_start`` /
``combine_start``; see moeplug.interfaces) while this thread computes:

    start dispatch 0;  shared experts (all tokens)          <- hides dispatch 0
    for c in 0..N-1:
        wait dispatch c;  start dispatch c+1
        experts c                                           <- hides dispatch c+1, combine c-1
        start combine c;  wait combine c-1
    wait combine N-1

Exposed: dispatch 0 beyond the shared experts, the last combine, and per chunk the blocking
count exchange. The backward pipelines the same way without scheduling of ours: each
exchange's gradient is started by its wait's backward and waited for by its start's backward
(``moeplug.parallel.comm.all_to_all_start``), and autograd runs the ready node created last
first, which is the other chunk's experts.

The same schedule runs the budgeted dispatcher (``runtime.sync_free``, eager on the CPU): each
chunk's stages 1-2 into its own packed slots with the budget of a micro-batch of its T_c tokens
    C_c = ceil(T_c*K/E * runtime.token_budget),
its exchange started and waited for later, so chunk c+1's rows travel while chunk c's experts
compute and every size is still static. Each chunk's over-budget flag joins the step's (one
rerun on the dynamic path, as unchunked), and its demand is measured against its own balanced
load T_c*K/E, so the budget a rerun names is the one the chunks would have needed. Chunks hold
fewer tokens than the micro-batch, so they go over a given budget more often than the whole
would.

Numerics: every token's K rows meet the same expert weights and are summed in the same k
order, so outputs, the router's and the input's gradients equal the unchunked layer's; the
routed experts' weight gradients are sums over rows, which now add chunk by chunk (fp32
rounding of a differently ordered sum, ~1e-7 relative; tests/test_overlap.py states the bound).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moeplug.config.modes.overlap import chunked_region_blocker
from moeplug.interfaces import Dispatcher, RouterOutput
from moeplug.moe.shared_experts import add_shared
from moeplug.observability.timing import stage
from moeplug.runtime import workspace
from moeplug.quant import active_recipe
from moeplug.routing import cat_rows, row_range


def chunk_routing(routing: RouterOutput, t0: int, t1: int) -> RouterOutput:
    """The routing of tokens [t0, t1). Capacity padding is not repeated per chunk (each chunk
    would pad every expert to the whole batch's capacity); ``pad_multiple`` is kept, so
    quantized GEMMs still get aligned groups. Padding rows carry prob 0: outputs do not change.
    The weights' slice backward writes into the workspace (routing.row_range)."""
    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[t0:t1]
    return dataclasses.replace(routing, probs_TK=row_range(routing.probs_TK, t0, t1),
                               ids_TK=routing.ids_TK[t0:t1], logits_TE=cut(routing.logits_TE),
                               dropped_TK=cut(routing.dropped_TK), capacity=None)


def overlapped(layer: Any, dispatcher: Dispatcher, x_TD: torch.Tensor,
               routing: RouterOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y_TD (+ shared(x_TD)), the kept counts per expert or None) of stages 2-6 pipelined over
    ``layer.overlap_chunks`` chunks, through ``layer``'s stage methods."""
    if dispatcher is layer.budgeted:
        _check_budgeted(x_TD, dispatcher)
    N, T = layer.overlap_chunks, x_TD.shape[0]
    spans = [(c * T // N, (c + 1) * T // N) for c in range(N)]

    def start(c: int) -> Any:
        t0, t1 = spans[c]
        with stage("dispatch"):
            return dispatcher.dispatch_start(row_range(x_TD, t0, t1),
                                             chunk_routing(routing, t0, t1))

    dispatching = start(0)
    s_TD = layer.shared(x_TD) if layer.shared is not None else None   # during dispatch 0
    combining: list[Any] = []
    y_parts: list[torch.Tensor] = []
    kept: list[torch.Tensor | None] = []
    for c in range(N):
        with stage("dispatch"):
            d = dispatcher.dispatch_wait(dispatching)
        kept.append(d.counts_E)
        if c + 1 < N:
            dispatching = start(c + 1)
        y_SD = layer.routed_experts_compute(d)
        with stage("combine"):
            combining.append(dispatcher.combine_start(y_SD, d.meta))
            if c > 0:
                y_parts.append(dispatcher.combine_wait(combining[c - 1]))
    with stage("combine"):
        y_parts.append(dispatcher.combine_wait(combining[-1]))
    y_TD = cat_rows(y_parts)  # torch.cat and the sum, into the workspace
    y_TD = y_TD if s_TD is None else add_shared(y_TD, s_TD)
    return y_TD, None if kept[0] is None else _summed(kept)


def _summed(counts: list[torch.Tensor]) -> torch.Tensor:
    """counts_E of the whole micro-batch: the chunks' summed (into the arena)."""
    total = workspace.empty(tuple(counts[0].shape), counts[0].dtype)
    total.copy_(counts[0])
    for counts_E in counts[1:]:
        total.add_(counts_E)
    return total


def _check_budgeted(x_TD: torch.Tensor, dispatcher: Any) -> None:
    # The config's rule (moeplug.config.modes.overlap), asked again for a layer built without
    # a config: refused, not silently unchunked or a crash in the CPU kernels.
    recipe = active_recipe()
    if chunked_region_blocker(device=x_TD.device.type, capture=dispatcher.state.capture,
                              recipe=None if recipe is None else type(recipe).__name__):
        raise ValueError(
            "MoELayer: runtime.sync_free with overlap_chunks > 1 runs eagerly on the CPU in "
            "fp32 or bf16 only (no capture, no quantization recipe). Fix: overlap_chunks 1")
