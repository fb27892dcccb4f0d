"""``tally`` experts and ``tally`` dispatcher: a third-party plugin package written only from
docs/plugins.md (moeplug.api and the ``moeplug_register_*`` hooks), as an
outside author would. Tests install it with pip into a private directory
(tests/test_thirdparty_modes.py) and train with it in every mode.

Legend: T tokens, D hidden, K top-k, E experts, L local experts, W EP ranks, S rows after
dispatch, F expert FFN hidden; n one expert's rows.

TallyExperts: the SwiGLU expert FFN as a plain loop over the local experts, Mixtral parameter
layout, and nothing else (no ``activation`` attribute, say: what the core needs it must get
by calling forward). Its loop takes a token budget's fixed rows as they come, so it declares
``budget_rows`` (docs/plugins.md, "Declared capabilities") and runtime.sync_free calls it on
them; it declares no ``capturable`` (``counts_L.tolist()`` breaks a compiled graph), so
runtime.capture refuses it. Under a low-precision recipe its GEMMs go through
``moeplug.api.quant_linear`` with the active recipe, so it declares ``runs_recipe``.
``tally_plain`` is the same loop declaring nothing (its GEMMs plain ``@``), as a plugin
written before the capabilities were documented: runtime.sync_free and the FP8/FP4 recipes
refuse it. With
``$MOEPLUG_TALLY_LOG`` set, each eager forward appends one line to that file: the process,
the rows and how many carry a nonzero weight, so a test can see that it, not something else,
computed the experts; each eager dispatch of the tally dispatcher appends ``pid dispatch S
tokens T`` (the rows it sent to this rank's experts, this rank's tokens).

TallyDispatcher: all-gather over the EP group, pick the rows of this rank's experts (padded as
RouterOutput asks), and on the way back scatter-add and all-reduce. One process: no
collective. Differentiable through torch.distributed.nn's collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moeplug.api import (Dispatched, Dispatcher, Experts, RouterOutput, active_recipe, hookimpl,
                         quant_linear)


class PlainTallyExperts(Experts):
    """y = down(silu(gate x) * (up x) * p) per local expert, with autograd."""

    def __init__(self, model, num_local_experts: int) -> None:
        super().__init__()
        if model.moe.activation != "swiglu":
            raise ValueError(f"model.moe.activation = {model.moe.activation!r}: the tally "
                             "experts compute SwiGLU only. Fix: set model.moe.activation: "
                             "swiglu or use plugins.experts: grouped")
        L, Fh, D = num_local_experts, model.moe.ffn_hidden_size, model.hidden_size
        self.num_local_experts = L
        self.gate_up_proj = torch.nn.Parameter(torch.empty(L, 2 * Fh, D))
        self.down_proj = torch.nn.Parameter(torch.empty(L, D, Fh))
        for w in (self.gate_up_proj, self.down_proj):
            torch.nn.init.normal_(w, std=model.init_std)

    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor,
                counts_L: torch.Tensor) -> torch.Tensor:
        log = os.environ.get("MOEPLUG_TALLY_LOG")
        if log and not torch.compiler.is_compiling():
            with open(log, "a") as f:
                f.write(f"{os.getpid()} rows {x_SD.shape[0]} weighted "
                        f"{int((probs_S > 0).sum())}\n")
        ys, start = [], 0
        for e, n in enumerate(counts_L.tolist()):
            x_nD, p_n = x_SD[start:start + n], probs_S[start:start + n]
            start += n
            gate_nF, up_nF = self._gemm(x_nD, self.gate_up_proj, e).chunk(2, dim=-1)
            a_nF = F.silu(gate_nF) * up_nF * p_n.unsqueeze(-1).to(up_nF.dtype)
            ys.append(self._gemm(a_nF, self.down_proj, e))
        return torch.cat(ys, dim=0)

    def _gemm(self, x_nK: torch.Tensor, w_LNK: torch.Tensor, e: int) -> torch.Tensor:
        return x_nK @ w_LNK[e].t()


class TallyExperts(PlainTallyExperts):
    """The same loop, declaring that its forward takes budget rows (B per local expert, zero
    rows of weight 0 where no choice landed): it reads only ``counts_L``, a host constant; and
    that its GEMMs run through a low-precision recipe when one is active."""

    budget_rows = True
    runs_recipe = True

    def _gemm(self, x_nK: torch.Tensor, w_LNK: torch.Tensor, e: int) -> torch.Tensor:
        """Through the low-precision recipe when one is active (docs/plugins.md: declared
        ``runs_recipe``), keyed (weight, expert) so a stateful recipe keeps one scale per
        expert GEMM."""
        recipe = active_recipe()
        if recipe is None:
            return x_nK @ w_LNK[e].t()
        return quant_linear(x_nK, w_LNK[e], None, recipe, (id(w_LNK), e))


@dataclass(frozen=True)
class _Meta:
    token_S: torch.Tensor   # the gathered token each row came from (-1: a padding row)
    num_tokens: int         # this rank's T


class TallyDispatcher(Dispatcher):
    """All-gather dispatch, all-reduce combine."""

    def __init__(self, model, group: Any) -> None:
        self.group = group
        self.world = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)
        self.num_experts = model.moe.num_experts
        if self.num_experts % self.world:
            raise ValueError(f"model.moe.num_experts = {self.num_experts} does not split over "
                             f"{self.world} EP ranks. Fix: a multiple of {self.world}")
        self.num_local_experts = self.num_experts // self.world

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return t
        from torch.distributed.nn.functional import all_gather
        return torch.cat(all_gather(t.contiguous(), group=self.group), dim=0)

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        T, K = routing.ids_TK.shape
        log = os.environ.get("MOEPLUG_TALLY_LOG")
        x_all, probs_all = self._gather(x_TD), self._gather(routing.probs_TK.float())
        with torch.no_grad():
            ids_all = self._gather(routing.ids_TK)
            local_N = ids_all.reshape(-1) - self.rank * self.num_local_experts
            mine_N = (local_N >= 0) & (local_N < self.num_local_experts)
            if routing.dropped_TK is not None:
                mine_N &= ~self._gather(routing.dropped_TK).reshape(-1)
            choice_R = torch.nonzero(mine_N).squeeze(1)
            expert_R = local_N[choice_R]
            order = torch.argsort(expert_R, stable=True)
            choice_R, expert_R = choice_R[order], expert_R[order]
            counts_L = torch.bincount(expert_R, minlength=self.num_local_experts).cpu()
            want_L = counts_L.clone()
            if routing.capacity is not None:
                want_L.fill_(routing.capacity * self.world)
            m = routing.pad_multiple
            want_L = (want_L + m - 1) // m * m
            # rows [start_e, start_e + counts_e) of expert e hold its choices; the rest pad
            start_L = torch.cumsum(want_L, 0) - want_L
            slot_R = (start_L[expert_R.cpu()] + torch.arange(len(choice_R))
                      - (torch.cumsum(counts_L, 0) - counts_L)[expert_R.cpu()]).to(x_TD.device)
            S = int(want_L.sum())
            token_S = torch.full((S,), -1, dtype=torch.int64, device=x_TD.device)
            token_S[slot_R] = choice_R // K
            choice_S = torch.full((S,), -1, dtype=torch.int64, device=x_TD.device)
            choice_S[slot_R] = choice_R
        real_S = (token_S >= 0).unsqueeze(1)
        x_SD = torch.where(real_S, x_all[token_S.clamp(min=0)], 0)
        probs_S = torch.where(real_S.squeeze(1),
                              probs_all.reshape(-1)[choice_S.clamp(min=0)], 0)
        if log and not torch.compiler.is_compiling():
            with open(log, "a") as f:
                f.write(f"{os.getpid()} dispatch {S} tokens {T}\n")
        return Dispatched(x_SD, probs_S, want_L, _Meta(token_S, T))

    def combine(self, y_SD: torch.Tensor, meta: _Meta) -> torch.Tensor:
        real = meta.token_S >= 0
        out = y_SD.new_zeros(meta.num_tokens * self.world, y_SD.shape[1])
        out = out.index_add(0, meta.token_S[real], y_SD[real])
        if self.group is None:
            return out
        from torch.distributed.nn.functional import all_reduce
        T = meta.num_tokens  # every rank's sum of all rows, then this rank's own T of them
        return all_reduce(out, group=self.group)[self.rank * T:(self.rank + 1) * T]


def make_experts(model, options, num_local_experts):
    return TallyExperts(model, num_local_experts)


def make_plain_experts(model, options, num_local_experts):
    return PlainTallyExperts(model, num_local_experts)


def make_dispatcher(model, options, group):
    return TallyDispatcher(model, group)


@hookimpl
def moeplug_register_experts(registry) -> None:
    registry.add("tally", make_experts,
                 description="SwiGLU experts as a plain loop that tallies the rows it computed")
    registry.add("tally_plain", make_plain_experts,
                 description="the tally loop declaring no capability (test package)")


@hookimpl
def moeplug_register_dispatchers(registry) -> None:
    registry.add("tally", make_dispatcher,
                 description="all-gather dispatch, all-reduce combine (test package)")
