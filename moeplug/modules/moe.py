"""The MoE layer: a fixed sequence of named stages over pluggable components.

Legend: T tokens (leading dims flattened), D hidden, K top-k, E experts (global),
S routed rows held by the local experts, L local experts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from moeplug.delayed_wgrad import flush_at
from moeplug.interfaces import Dispatcher, Experts, Router
from moeplug.modules.moe_overlap import overlapped_routed
from moeplug.modules.static_moe import static_moe
from moeplug.modules.static_overlap import overlapped_static
from moeplug.observability.timing import stage
from moeplug.ops import workspace
from moeplug.ops.cast import cast
from moeplug.ops.cuda_ops import device_counts
from moeplug.ops.scale_rows import ones, scale_rows
from moeplug.parallel.expert_tp import expert_groups
from moeplug.parallel.tensor_parallel import average_over_token_group
from moeplug.quant import active_recipe
from moeplug.modules.shared_experts import add_shared
from moeplug.routing import expert_counts, kept, rows_as, token_rows


def _rows_for_experts(x_TD: torch.Tensor) -> torch.Tensor:
    """Under CPU autocast the experts' GEMMs run in the autocast dtype anyway: cast the T token
    rows once here instead of the T*K dispatched rows in the experts, which also halves what
    permute and its backward move in bf16. The router still sees the fp32 rows. Not under a
    low-precision recipe (its quantisers take the rows as they come)."""
    if (x_TD.device.type != "cpu" or x_TD.dtype != torch.float32
            or not torch.is_autocast_enabled("cpu")
            or torch.get_autocast_dtype("cpu") != torch.bfloat16 or active_recipe() is not None):
        return x_TD
    return cast(x_TD, torch.bfloat16)  # x_TD.to(bfloat16) into workspace buffers


class MoEOutput(tuple):
    """What ``MoELayer.forward`` returns: unpacks as the ``(y, aux_loss, counts_E)`` triple every
    caller expects, and also carries ``router_losses``, the router's detached, unscaled logging
    values (``RouterOutput.losses``) for moeplug.observability. A tuple subclass so that
    attribute is extra, not a fourth element that every ``y, aux, counts = layer(x)`` would
    have to change for."""

    router_losses: dict

    def __new__(cls, y: Any, aux_loss: Any, counts_E: Any, router_losses: dict) -> "MoEOutput":
        out = super().__new__(cls, (y, aux_loss, counts_E))
        out.router_losses = router_losses
        return out


class MoELayer(nn.Module):
    """Routed feed-forward block built from a router, a dispatcher and an experts backend.

    ``forward`` follows these stages line for line (see moeplug/interfaces.py for each contract):
        1. route      routing = router(x_TD[, num_sequences=B])   -> probs_TK, ids_TK, aux_loss
        2. dispatch   d = dispatcher.dispatch(x_TD, routing)      -> x_SD grouped by local expert
        3. experts    y_SD = experts(d.x_SD, d.probs_S, d.counts_L)  (weights applied inside;
                      with apply_probs_on_input: experts(p * x_SD, 1, counts_L), top-1 only)
        4. combine    y_TD = dispatcher.combine(y_SD, d.meta)     -> each token's K rows summed
        5. shared     s_TD = shared(x_TD)  when a SharedExperts module was given (all tokens)
        6. sum        y = y_TD (+ s_TD), reshaped to the input's shape
    With ``overlap_chunks`` N > 1 (``model.moe.overlap_chunks``), stages 2-6 run pipelined over
    N token chunks, each chunk's exchanges in the background while another chunk's experts (and,
    during the first dispatch, the shared experts) compute: moeplug.modules.moe_overlap.
    With ``runtime.sync_free`` (the layer's runtime handle says so), stages 2-4 are
    moeplug.modules.static_moe instead: static shapes from a token budget, no host sync, the
    experts' weights used directly, counts_E left on the device; an over-budget flag goes to
    the runtime, whose trainer reruns the step on the path above. Both: the static region
    pipelined over the chunks, each with its own budget (moeplug.modules.static_overlap).
    With ``model.moe.delay_wgrad_compute`` the experts' backward queues its weight GEMMs to run
    during the dispatch's backward exchange; the layer's input is marked so that whatever is
    still queued runs when the backward reaches it (moeplug.delayed_wgrad).
    Returns ``MoEOutput(y, aux_loss, counts_E)`` (a triple; ``.router_losses`` holds the
    router's logging values); nothing from the call is kept on ``self``, so several
    micro-batches may be in flight through one layer.
    """

    def __init__(self, router: Router, dispatcher: Dispatcher, experts: Experts,
                 shared: nn.Module | None = None, apply_probs_on_input: bool = False,
                 token_group: Any = None, runtime: Any = None, overlap_chunks: int = 1,
                 batch_group: Any = None) -> None:
        super().__init__()
        if not isinstance(overlap_chunks, int) or isinstance(overlap_chunks, bool) \
                or overlap_chunks < 1:
            raise ValueError(f"MoELayer: overlap_chunks = {overlap_chunks!r} must be an integer "
                             f">= 1. Fix: pass 1 (no overlap) or the number of token chunks")
        if apply_probs_on_input and router.top_k != 1:
            raise ValueError(
                f"MoELayer: apply_probs_on_input needs a top-1 router, got router.top_k = "
                f"{router.top_k}. Fix: set model.moe.top_k=1 or apply_probs_on_input=false")
        if dispatcher.num_local_experts != experts.num_local_experts:
            raise ValueError(
                f"MoELayer: dispatcher.num_local_experts = {dispatcher.num_local_experts} but "
                f"experts.num_local_experts = {experts.num_local_experts}. Fix: build the experts "
                f"with num_local_experts=dispatcher.num_local_experts")
        if router.num_experts != dispatcher.num_experts:
            raise ValueError(
                f"MoELayer: router.num_experts = {router.num_experts} but dispatcher.num_experts = "
                f"{dispatcher.num_experts}. Fix: build both from the same ModelConfig.moe")
        self.router = router
        self.experts = experts
        # The dispatcher is not an nn.Module (it owns no parameters); a plain attribute.
        self.dispatcher = dispatcher
        self.shared = shared  # registered only when given: no "shared" keys in checkpoints else
        self.apply_probs_on_input = apply_probs_on_input
        # The group whose ranks hold other chunks of the same sequences (TP; see
        # moeplug.parallel.tensor_parallel.moe_tokens_in). Routers that accept it count experts
        # over the whole group; the aux loss is then averaged over it, which equals the loss of
        # the unsplit batch, with each rank's grad that of its own tokens.
        self.token_group = token_group
        # The ranks training the step's other micro-batches of this stage (TP x DP x CP):
        # routers that accept it sum the global aux loss's counts over it (Megatron's n_i).
        self.batch_group = batch_group
        # The moeplug.stash.LayerHandle this layer got when the model registered with the
        # runtime (None: built outside build_model); its stash_scope wraps the experts stage.
        self.runtime = runtime
        self.overlap_chunks = overlap_chunks
        # Small buffers of this layer's ops, forward and backward (moeplug.ops.workspace.Arena):
        # the one its runtime registration gave it, else its own. Reused every step, so after
        # warm-up the layer's path allocates nothing (tests/test_moe_allocations.py).
        self.workspace = runtime.workspace if runtime is not None else workspace.Arena()

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with workspace.arena_scope(self.workspace):
            return self._forward(x_ND)

    def _forward(self, x_ND: torch.Tensor) -> MoEOutput:
        x_TD = token_rows(x_ND)  # a view, or (TP's s-major token chunk) an arena copy
        if self.experts.delay_wgrad_compute:
            x_TD = flush_at(x_TD)  # no expert weight gradient outlives this layer's backward
        with stage("router"):
            routing = self._route(x_TD, x_ND.shape[0] if x_ND.dim() == 3 else 1)  # 1. route
        sync_free = self._sync_free()
        if sync_free is not None and 1 < self.overlap_chunks <= x_TD.shape[0]:
            # 2.-6. static and pipelined over chunks (static_overlap)
            y_TD, counts_E = self._overlapped_static(x_TD, routing, sync_free)
        elif sync_free is not None:  # 2.-4. with static shapes, no host sync (static_moe)
            with stage("experts"):
                y_TD, counts_E = self._static_stages(x_TD, routing, sync_free)
            if self.shared is not None:
                y_TD = add_shared(y_TD, self.shared(x_TD))            # 5. shared, 6. sum
        # Fewer tokens than chunks (a decode step): unchunked. Every EP rank holds the same T,
        # so all of them take the same branch and issue the same collectives.
        elif 1 < self.overlap_chunks <= x_TD.shape[0]:                # 2.-6. pipelined
            y_TD = overlapped_routed(x_TD, routing, self.overlap_chunks, self.dispatcher,
                                     self._experts, self.shared, self._stash_scope)
            counts_E = self._counts(routing)
        else:
            with stage("dispatch"):
                d = self.dispatcher.dispatch(_rows_for_experts(x_TD), routing)  # 2. dispatch
            with stage("experts"), self._stash_scope():
                y_SD = self._experts(d)                               # 3. experts
            with stage("combine"):
                y_TD = self.dispatcher.combine(y_SD, d.meta)          # 4. combine
            counts_E = self._counts(routing)
            if self.shared is not None:
                y_TD = add_shared(y_TD, self.shared(x_TD))            # 5. shared, 6. sum
        y_ND = rows_as(y_TD, x_ND)                                    # 6. sum
        return MoEOutput(y_ND, average_over_token_group(routing.aux_loss, self.token_group),
                         counts_E, dict(routing.losses))

    def _counts(self, routing) -> torch.Tensor:
        # Logged, never differentiated: on the host on the CPU, on the device on a GPU.
        # Choices dropped by capacity reach no expert, so they are not counted.
        ids = routing.ids_TK.reshape(-1).detach()
        if ids.device.type == "cpu":
            # bincount's numbers, dropped choices left out, from the arena (no allocation).
            keep = None if routing.dropped_TK is None else kept(routing.dropped_TK)
            return expert_counts(ids, self.router.num_experts, keep)
        # Counted on the device (no boolean-mask gather, no bincount: each syncs) and left
        # there, as the sync-free path leaves them: the trainer reads them once the step's
        # backwards are queued, so the host never waits for the device here.
        keep = None if routing.dropped_TK is None else ~routing.dropped_TK.reshape(-1)
        return device_counts(ids, self.router.num_experts, keep)

    def _sync_free(self):
        # The runtime's SyncFreeState when runtime.sync_free is on and not paused for a rerun.
        # Training only: an over-budget step is rerun by the trainer, but evaluation and
        # generation have no rerun, so they take the dynamic path and never lose a token.
        state = None if self.runtime is None else self.runtime.runtime.sync_free
        return state if state is not None and state.active and self.training else None

    def _static_stages(self, x_TD: torch.Tensor, routing, state) -> tuple:
        # Stages 2-4 in static shapes (moeplug.modules.static_moe); counts_E stays on the
        # device (the trainer reads it after the step). The overflow flag goes to the runtime.
        ep_group, etp_group = expert_groups(self.dispatcher)
        y_TD, overflow, counts_E = static_moe(
            x_TD, routing, self.experts.gate_up_proj, self.experts.down_proj,
            num_experts=self.router.num_experts, token_budget=state.cfg.token_budget,
            activation=self.experts.activation, weighted_input=self.apply_probs_on_input,
            ep_size=self._ep_size(ep_group), group=ep_group, etp_group=etp_group,
            wrap=None if state.arena and not state.capture else functools.partial(
                state.wrap, owner=self),
            stash_scope=self._stash_scope() if self.runtime.runtime.stash_active else None,
            # model.offload's expert names: the experts module's scope (moeplug.modules.offload)
            experts_call=getattr(self.experts, "call_offloaded", None),
            quantized_wire=self.dispatcher.quantizes_dispatch)
        state.note_overflow(overflow)
        # What budget this call needed: the trainer names it when the step reruns.
        T, K = routing.ids_TK.shape
        state.note_demand(self._counts(routing), T * K / self.router.num_experts)
        return y_TD, counts_E.detach()

    def _overlapped_static(self, x_TD: torch.Tensor, routing, state) -> tuple:
        # The static region over overlap_chunks chunks, each exchange in flight while another
        # chunk's experts run; the chunks' flags and demands go to the runtime.
        if x_TD.device.type != "cpu" or state.capture or active_recipe() is not None:
            raise ValueError(  # RootConfig refuses these: a layer built without it
                "MoELayer: runtime.sync_free with overlap_chunks > 1 runs eagerly on the CPU in "
                "fp32 or bf16 only (no capture, no quantization recipe). Fix: overlap_chunks 1")
        ep_group, etp_group = expert_groups(self.dispatcher)
        y_TD, chunks = overlapped_static(
            x_TD, routing, self.overlap_chunks, self.experts.gate_up_proj,
            self.experts.down_proj, num_experts=self.router.num_experts,
            token_budget=state.cfg.token_budget, activation=self.experts.activation,
            weighted_input=self.apply_probs_on_input, ep_size=self._ep_size(ep_group),
            group=ep_group, etp_group=etp_group, shared=self.shared,
            stash_scope=self._stash_scope if self.runtime.runtime.stash_active else None,
            experts_call=getattr(self.experts, "call_offloaded", None))
        for flag, (wanted_E, balanced) in zip(chunks.flags, chunks.demands):
            state.note_overflow(flag)
            state.note_demand(wanted_E, balanced)
        return y_TD, chunks.kept_counts()

    def _ep_size(self, ep_group: Any) -> int:
        # From the expert split, not a dispatcher attribute: any dispatcher plugin works as long
        # as it exposes its EP process group as ``group`` when the experts are split.
        ep_size = self.router.num_experts // self.dispatcher.num_local_experts
        if ep_size > 1 and ep_group is None:
            raise ValueError(
                f"MoELayer: runtime.sync_free with {ep_size} EP ranks needs the dispatcher's "
                f"process group, but {type(self.dispatcher).__name__} has no .group. Fix: use "
                f"dispatcher alltoall or allgather, or runtime.sync_free: false")
        return ep_size

    def _stash_scope(self):
        # What the routed experts save for backward goes to the runtime's paged stash.
        if self.runtime is None:
            return contextlib.nullcontext()
        return self.runtime.stash_scope(self.experts.parameters())

    def _experts(self, d) -> torch.Tensor:
        if not self.apply_probs_on_input:
            return self.experts(d.x_SD, d.probs_S, d.counts_L)
        # Megatron moe_apply_probs_on_input: FC2(act(FC1(p * x))). The weight moves onto the
        # rows and the experts get p = 1, so any Experts backend supports it unchanged.
        # (x * p, ones) into the arena: moeplug.ops.scale_rows.
        return self.experts(scale_rows(d.x_SD, d.probs_S), ones(d.probs_S), d.counts_L)

    def _route(self, x_TD: torch.Tensor, num_sequences: int):
        # Sequence boundaries only go to routers that declare they take them (see Router), so
        # third-party routers with forward(x_TD) keep working. Tokens are b-major (t = b*S + s).
        kwargs = {}
        if self.token_group is not None and self.router.accepts_token_group:
            kwargs["token_group"] = self.token_group
        if self.batch_group is not None and self.router.accepts_batch_group:
            kwargs["batch_group"] = self.batch_group
        if self.router.accepts_num_sequences:
            return self.router(x_TD, num_sequences=num_sequences, **kwargs)
        return self.router(x_TD, **kwargs)
