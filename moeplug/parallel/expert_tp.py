"""Expert tensor parallelism (ETP): every expert's FFN split over the ETP group by its hidden F.

Legend: W ranks in the ETP group, L local experts, D hidden, F expert FFN hidden (Fl = F / W on
one rank), S rows this rank's dispatcher produced, R rows after gathering over ETP (sum of the
group's S), ``...`` trailing dims.

ETP rank r holds columns [r*Fl, (r+1)*Fl) of each expert: the matching gate rows *and* up rows of
``gate_up_proj`` (so the SwiGLU product stays local) and the matching columns of ``down_proj``.
A row's output is then the sum over ETP ranks of their partial down projections.

Flow, as Megatron's alltoall dispatcher (A2A(EP) -> AG(ETP) -> experts -> RS(ETP) -> A2A(EP)):
    dispatch  inner dispatch over EP -> all-gather every ETP rank's rows (uneven counts) ->
              sort the (ETP rank, local expert)-major chunks expert-major
    combine   unsort -> reduce-scatter (sum the partials, keep this rank's rows) -> inner combine
:class:`ExpertTPDispatcher` wraps any :class:`~moeplug.interfaces.Dispatcher`, so every
dispatcher plugin gets ETP without knowing about it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from moeplug.config import ModelConfig
from moeplug.interfaces import Dispatched, Dispatcher, RouterOutput
from moeplug.parallel import comm


def expert_model_config(model: ModelConfig, etp_size: int) -> ModelConfig:
    """The ModelConfig an experts backend is built with on one ETP rank (ffn_hidden_size / W),
    so existing backends create [L, 2Fl, D] / [L, D, Fl] shards unchanged."""
    F = model.moe.ffn_hidden_size
    if F % etp_size:
        raise ValueError(f"MoEConfig.ffn_hidden_size = {F} is not divisible by the expert "
                         f"tensor-parallel size {etp_size}. Fix: choose etp dividing {F}")
    if etp_size == 1:
        return model
    moe = dataclasses.replace(model.moe, ffn_hidden_size=F // etp_size)
    return dataclasses.replace(model, moe=moe)


def etp_slice(name: str, experts_src: torch.Tensor, full_state: Mapping[str, torch.Tensor],
              etp_rank: int, etp_size: int) -> torch.Tensor:
    """ETP rank ``etp_rank``'s slice of one expert parameter (already cut to the local experts).

    ``...gate_up_proj`` [L, 2F, D] (gated: gate rows then up rows) -> [L, 2Fl, D] with the same
    Fl-slice of both halves; [L, F, D] (non-gated FC1) -> its Fl-slice. ``...down_proj``
    [L, D, F] -> [L, D, Fl]. Whether FC1 is gated is read off ``down_proj`` in ``full_state``.
    """
    if etp_size == 1:
        return experts_src
    prefix, _, leaf = name.rpartition(".")
    if leaf == "down_proj":
        return experts_src.chunk(etp_size, dim=2)[etp_rank]
    if leaf == "gate_up_proj":
        F = full_state[f"{prefix}.down_proj"].shape[2]
        halves = experts_src.split(F, dim=1)  # (gate, up) when gated, else (fc1,)
        return torch.cat([h.chunk(etp_size, dim=1)[etp_rank] for h in halves], dim=1)
    raise ValueError(f"etp_slice: expert parameter '{name}' is neither gate_up_proj nor "
                     "down_proj, so its ETP split is unknown. Fix: use an experts backend with "
                     "the shared Mixtral layout (moeplug/interfaces.py) or etp = 1")


@dataclass(frozen=True)
class ETPMeta:
    inner: Any                 # the wrapped dispatcher's meta
    sizes_W: tuple[int, ...]   # rows each ETP rank contributed (to reduce-scatter back)
    order_R: torch.Tensor      # rows[order_R] sorts the gathered rows expert-major


def _chunk_order(counts_WL: torch.Tensor) -> torch.Tensor:
    """idx_R such that ``rows[idx_R]`` turns (w, l)-major chunks into (l, w)-major ones."""
    W, L = counts_WL.shape
    flat_WL = counts_WL.reshape(-1)
    start_WL = (torch.cumsum(flat_WL, 0) - flat_WL).view(W, L)
    starts_LW, sizes_LW = start_WL.t().reshape(-1), counts_WL.t().reshape(-1)
    out_start_LW = torch.cumsum(sizes_LW, 0) - sizes_LW
    R = int(flat_WL.sum())
    offset_R = torch.arange(R, dtype=torch.int64) - torch.repeat_interleave(out_start_LW, sizes_LW)
    return torch.repeat_interleave(starts_LW, sizes_LW) + offset_R


class ExpertTPDispatcher(Dispatcher):
    """``inner`` (dispatching over EP) followed by an all-gather of its rows over the ETP group;
    combine reduce-scatters the experts' partial outputs before ``inner.combine``."""

    def __init__(self, inner: Dispatcher, etp_group: Any) -> None:
        self.inner = inner
        self.group = etp_group
        self.num_experts = inner.num_experts
        self.num_local_experts = inner.num_local_experts
        # The rows cross EP through ``inner``: in its row format if it quantizes them.
        self.quantizes_dispatch = inner.quantizes_dispatch

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        d = self.inner.dispatch(x_TD, routing)
        W, L = comm.group_size(self.group), self.num_local_experts
        with torch.no_grad():
            counts_WL = comm.all_gather(d.counts_L.to(torch.int64).cpu().view(1, L), self.group,
                                        [1] * W)
        sizes_W = tuple(counts_WL.sum(dim=1).tolist())
        order_R = _chunk_order(counts_WL)
        x_RD = comm.all_gather(d.x_SD, self.group, sizes_W)
        probs_R = comm.all_gather(d.probs_S, self.group, sizes_W)
        idx_R = order_R.to(x_RD.device)
        return Dispatched(x_RD.index_select(0, idx_R), probs_R.index_select(0, idx_R),
                          counts_WL.sum(dim=0), ETPMeta(d.meta, sizes_W, order_R))

    def combine(self, y_RD: torch.Tensor, meta: ETPMeta) -> torch.Tensor:
        idx_R = meta.order_R.to(y_RD.device)
        inverse_R = torch.empty_like(idx_R)
        inverse_R[idx_R] = torch.arange(idx_R.numel(), dtype=idx_R.dtype, device=idx_R.device)
        y_SD = comm.reduce_scatter(y_RD.index_select(0, inverse_R), self.group, meta.sizes_W)
        return self.inner.combine(y_SD, meta.inner)


# --- model wiring (what build_model calls; no-ops without ETP) ---------------------------------

def etp_dispatcher(dispatcher: Dispatcher, groups: Any) -> Dispatcher:
    """``dispatcher`` wrapped in :class:`ExpertTPDispatcher` when ``groups.etp`` is set."""
    etp = None if groups is None else groups.etp
    return dispatcher if etp is None else ExpertTPDispatcher(dispatcher, etp)


def etp_experts_config(model: ModelConfig, groups: Any) -> ModelConfig:
    """:func:`expert_model_config` for ``groups``' ETP size (``model`` itself without ETP)."""
    return expert_model_config(model, 1 if groups is None else groups.size("etp"))
