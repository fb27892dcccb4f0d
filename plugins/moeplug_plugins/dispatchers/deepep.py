"""``deepep`` dispatcher: DeepEP's normal (high-throughput) kernels on NVIDIA GPUs, called the way
Megatron-Core's flex dispatcher calls them (``deep_ep.Buffer``: get_dispatch_layout -> dispatch
-> combine; the backward of each is the other). Listed unavailable, with the reason, where the
``deep_ep`` module does not import; CPU tokens are refused naming the CPU dispatchers.

Legend: T local tokens, K top-k, D hidden, E experts (global), L local experts, R token rows
this rank receives (DeepEP sends a token once to every rank holding one of its experts), S rows
for the local experts.

dispatch:
    1. exchange   Buffer.dispatch of x_TD with its top-k ids (-1: dropped by capacity) and probs:
                  R token rows arrive, each with its K choices as local expert ids (-1: another
                  rank's expert, or dropped) and their probs
    2. permute    the arrived rows' local choices grouped by local expert, stable (arrival is
                  source-rank-major, token order inside: alltoall's (expert, source, token)
                  order); the other choices go to a sink expert L whose rows are cut off
    3. pad        as alltoall (capacity * ep_size or pad_multiple, moeplug.routing.rows)
combine: unpad -> unpermute (plain sum of a token's local rows: they carry p) -> Buffer.combine
(each token's partial rows from every rank summed at its source).

Not here: DeepEP's low-latency kernels and V2's ElasticBuffer (static shapes for graphs), and
the async (event) overlap; dispatch is synchronous, as Megatron's default. The exchange is
isolated in ``_Exchange``/``_Combine`` over a ``buffer`` object with DeepEP's three methods, so
the layout code around it runs in tests at one rank on the CPU (tests/test_deepep_dispatch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moeplug.api import (append_sink_rows, Dispatched, Dispatcher, first_rows, ModelConfig,
                         pad_rows, padded_counts, permute, permute_probs, RouterOutput, unpad_rows,
                         unpermute)
from moeplug_plugins.dispatchers import _ep_comm
from moeplug_plugins.dispatchers._group import ep_layout


def deepep_buffer(group: Any, hidden_bytes: int) -> Any:
    """A ``deep_ep.Buffer`` on ``group`` with room for rows of ``hidden_bytes`` (DeepEP's own
    size hints for its dispatch and combine configs), cached per group and grown on demand."""
    from deep_ep import Buffer

    n = group.size()
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(n), Buffer.get_combine_config(n)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, n))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, n))
    held = _buffers.get(id(group))
    if held is None or held.num_nvl_bytes < nvl or held.num_rdma_bytes < rdma:
        held = _buffers[id(group)] = Buffer(group, nvl, rdma)
    return held


_buffers: dict[int, Any] = {}


@dataclass(frozen=True)
class DeepEPMeta:
    buffer: Any                # the buffer that dispatched (combine and the backwards use it)
    handle: Any                # DeepEP's handle of the exchange (layout for combine)
    row_map_RK: torch.Tensor   # row of (arrived token r, choice k) after the local permute
    num_sink_rows: int         # other ranks' / dropped choices' rows, cut after permute
    pad_index_S: torch.Tensor | None = None


class DeepEPDispatcher(Dispatcher):
    def __init__(self, model: ModelConfig, group=None,
                 buffer_for: Callable[[Any, int], Any] = deepep_buffer):
        self.group = group
        self.ep_size, self.ep_rank, self.num_local_experts = ep_layout(model, group)
        self.num_experts = model.moe.num_experts
        self.buffer_for = buffer_for  # (group, hidden bytes) -> Buffer; tests pass a stand-in

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        if x_TD.device.type != "cuda" and self.buffer_for is deepep_buffer:
            raise ValueError(f"dispatcher deepep moves CUDA tensors (DeepEP's NVLink/RDMA "
                             f"kernels); got tokens on {x_TD.device}. Fix: use dispatcher "
                             f"direct_write or hierarchical on the CPU")
        L = self.num_local_experts
        ids_TK = routing.ids_TK
        if routing.dropped_TK is not None:  # DeepEP skips choices whose id is -1
            ids_TK = ids_TK.masked_fill(routing.dropped_TK, -1)
        # DeepEP takes fp32 weights; its hidden bytes count at least 2 per element
        buffer = self.buffer_for(self.group, x_TD.shape[1] * max(x_TD.element_size(), 2))
        x_RD, ids_RK, probs_RK, handle = _Exchange.apply(
            buffer, x_TD.contiguous(), ids_TK.to(_topk_idx_dtype()), routing.probs_TK.float(),
            self.num_experts)
        # 2. permute: local choices by local expert, the rest to sink L (cut off)
        local_RK = torch.where(ids_RK < 0, L, ids_RK).to(torch.int64)
        x_all, row_map_RK, counts = permute(x_RD, local_RK, L + 1)
        probs_all = permute_probs(probs_RK, row_map_RK)
        num_sink = int(counts[L])
        S = x_all.shape[0] - num_sink
        x_SD, probs_S = ((first_rows(x_all, S), first_rows(probs_all, S)) if num_sink
                         else (x_all, probs_all))
        counts_L = counts[:L]
        # 3. pad
        target_L = padded_counts(counts_L, routing.capacity, routing.pad_multiple, self.ep_size,
                                 self._capacities(routing.capacity))
        x_SD, probs_S, pad_index_S = pad_rows(x_SD, probs_S.to(routing.probs_TK.dtype),
                                              counts_L, target_L)
        meta = DeepEPMeta(buffer=buffer, handle=handle, row_map_RK=row_map_RK,
                          num_sink_rows=num_sink, pad_index_S=pad_index_S)
        return Dispatched(x_SD, probs_S, target_L, meta)

    def combine(self, y_SD: torch.Tensor, meta: DeepEPMeta) -> torch.Tensor:
        y_SD = unpad_rows(y_SD, meta.pad_index_S)
        y_RD = unpermute(append_sink_rows(y_SD, meta.num_sink_rows), meta.row_map_RK)
        return _Combine.apply(meta.buffer, meta.handle, y_RD.contiguous())

    def _capacities(self, capacity: int | None) -> list[int] | None:
        if capacity is None or self.ep_size == 1:
            return None
        return _ep_comm.gather_capacities(capacity, self.group)


def _topk_idx_dtype() -> torch.dtype:
    """DeepEP's id dtype (``deep_ep.topk_idx_t`` where a build makes it int32), else int64."""
    try:
        import deep_ep
    except ImportError:
        return torch.int64
    return getattr(deep_ep, "topk_idx_t", torch.int64)


class _Exchange(torch.autograd.Function):
    """Buffer.dispatch; backward: Buffer.combine of the row gradients (and the probs')."""

    @staticmethod
    def forward(ctx, buffer, x_TD, ids_TK, probs_TK, num_experts):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids_TK, num_experts)
        # the CPU waits for DeepEP's receive count here (its normal mode is not graphable)
        x_RD, ids_RK, probs_RK, _, handle, _ = buffer.dispatch(
            x_TD, topk_idx=ids_TK, topk_weights=probs_TK, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        ctx.buffer, ctx.handle, ctx.top_k = buffer, handle, ids_TK.shape[1]
        ctx.mark_non_differentiable(ids_RK)
        return x_RD, ids_RK, probs_RK, handle

    @staticmethod
    def backward(ctx, g_x_RD, _g_ids, g_probs_RK, _g_handle):
        if g_probs_RK is None:  # the probs' gradient did not reach the arrived rows
            g_probs_RK = torch.zeros(g_x_RD.shape[0], ctx.top_k, device=g_x_RD.device)
        g_x_TD, g_probs_TK, _ = ctx.buffer.combine(g_x_RD.contiguous(), ctx.handle,
                                                   topk_weights=g_probs_RK.float())
        return None, g_x_TD, None, g_probs_TK, None


class _Combine(torch.autograd.Function):
    """Buffer.combine (sums each token's partial rows at its source); backward: Buffer.dispatch
    of the gradient with the same handle."""

    @staticmethod
    def forward(ctx, buffer, handle, y_RD):
        ctx.buffer, ctx.handle = buffer, handle
        y_TD, _, _ = buffer.combine(y_RD, handle=handle)
        return y_TD

    @staticmethod
    def backward(ctx, g_TD):
        g_RD, *_ = ctx.buffer.dispatch(g_TD.contiguous(), handle=ctx.handle)
        return None, None, g_RD


__all__ = ["DeepEPDispatcher", "DeepEPMeta", "deepep_buffer"]
