"""The MoE layer: route -> dispatch -> experts -> combine -> shared experts -> sum, each stage a
method; chunked overlap and capture are schedules over those stages, not other layers.

Legend: T tokens (leading dims flattened), D hidden, K top-k, E experts (global),
S routed rows held by the local experts, L local experts, G chunks of packed budget rows.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from moeplug.ops.delayed_wgrad import flush_at
from moeplug.interfaces import Dispatched, Dispatcher, Experts, Router
from moeplug.moe.shared_experts import add_shared
from moeplug.observability.timing import stage
from moeplug.runtime import workspace
from moeplug.ops.cast import cast
from moeplug.ops.cuda_ops import device_counts
from moeplug.ops.scale_rows import ones, scale_rows
from moeplug.parallel.tensor_parallel import average_over_token_group
from moeplug.quant import active_recipe
from moeplug.routing import expert_counts, kept, rows_as, token_rows

# A schedule runs stages 2-6 of one call in another order: (layer, dispatcher, x_TD, routing)
# -> (y_TD, the kept counts per expert or None to count the routing).
Schedule = Callable[["MoELayer", Dispatcher, torch.Tensor, Any],
                    tuple[torch.Tensor, torch.Tensor | None]]


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
    pooled_aux: Any  # RouterOutput.pooled_aux: this layer's part of a loss over all layers

    def __new__(cls, y: Any, aux_loss: Any, counts_E: Any, router_losses: dict,
                pooled_aux: Any = None) -> "MoEOutput":
        out = super().__new__(cls, (y, aux_loss, counts_E))
        out.router_losses = router_losses
        out.pooled_aux = pooled_aux
        return out


class MoELayer(nn.Module):
    """Routed feed-forward block built from a router, a dispatcher and an experts backend.

    ``forward`` follows these stages line for line, each a method (Megatron's ``moe_layer.py``
    names the same stages, so that its overlap and CUDA-graph code reuse one layer); see
    moeplug/interfaces.py for each plugin's contract:
        1. route      routing = self.router_and_preprocess(x_TD, B)  -> probs_TK, ids_TK, aux_loss
        2. dispatch   d = self.dispatch(dispatcher, x_TD, routing)   -> rows grouped by expert
        3. experts    y_SD = self.routed_experts_compute(d)          (weights applied inside;
                      with apply_probs_on_input: experts(p * x_SD, 1, counts_L), top-1 only)
        4. combine    y_TD = self.combine(dispatcher, y_SD, d)       -> each token's K rows summed
        5. shared     s_TD = self.shared(x_TD)  when a SharedExperts module was given
        6. sum        y = y_TD (+ s_TD), reshaped to the input's shape
    The dispatcher of stages 2 and 4 (:meth:`dispatcher_now`) is the plugin the host built, or,
    while ``runtime.sync_free`` is active in training, the budgeted dispatcher that wraps it
    (moeplug.moe.budgeted: static shapes from a token budget, no host sync, the experts backend
    on budget rows, counts_E left on the device; an over-budget flag goes to the runtime,
    whose trainer reruns the step on the plugin's).
    Schedules over the same stages (:meth:`schedule_now`):
        ``model.moe.overlap_chunks`` N > 1   stages 2-6 pipelined over N token chunks, each
            chunk's exchanges in the background while another chunk's experts (and, during the
            first dispatch, the shared experts) compute: moeplug.moe.overlap
        ``runtime.capture`` (with sync_free)  stages 2-4 as compiled (CPU) or recorded (CUDA)
            pieces, the exchanges between them eager: moeplug.moe.capture
        combined 1F1B overlap  whole layer calls of two micro-batches side by side:
            moeplug.parallel.ep_overlap
    With ``model.moe.delay_wgrad_compute`` the experts' backward queues its weight GEMMs to run
    during the dispatch's backward exchange; the layer's input is marked so that whatever is
    still queued runs when the backward reaches it (moeplug.ops.delayed_wgrad).
    Returns ``MoEOutput(y, aux_loss, counts_E)`` (a triple; ``.router_losses`` holds the
    router's logging values); nothing from the call is kept on ``self``, so several
    micro-batches may be in flight through one layer.
    """

    def __init__(self, router: Router, dispatcher: Dispatcher, experts: Experts,
                 shared: nn.Module | None = None, apply_probs_on_input: bool = False,
                 token_group: Any = None, runtime: Any = None, overlap_chunks: int = 1,
                 batch_group: Any = None, budgeted: Dispatcher | None = None) -> None:
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
        # The dispatchers are not nn.Modules (they own no parameters); plain attributes. The
        # budgeted one (runtime.sync_free; moeplug.moe.budgeted.budgeted_dispatcher) wraps the
        # plugin's and takes over stages 2 and 4 while the mode is active in training.
        self.dispatcher = dispatcher
        self.budgeted = budgeted
        self.shared = shared  # registered only when given: no "shared" keys in checkpoints else
        self.apply_probs_on_input = apply_probs_on_input
        # The group whose ranks hold other chunks of the same sequences (TP x CP, set by
        # moeplug.parallelize.ep; see ParallelWiring.moe_tokens_in). Routers that accept it
        # count experts over the whole group; the aux loss is then averaged over it, which equals the loss of
        # the unsplit batch, with each rank's grad that of its own tokens.
        self.token_group = token_group
        # The ranks training the step's other micro-batches of this stage (TP x DP x CP):
        # routers that accept it sum the global aux loss's counts over it (Megatron's n_i).
        self.batch_group = batch_group
        # The moeplug.runtime.stash.LayerHandle this layer got when the model registered with the
        # runtime (None: built outside build_model); its stash_scope wraps the experts stage.
        self.runtime = runtime
        if budgeted is None and runtime is not None and runtime.runtime.cfg.sync_free:
            raise ValueError(
                "MoELayer: its runtime runs sync-free (runtime.sync_free) but no budgeted "
                "dispatcher was given, so every step would take the dynamic path. Fix: pass "
                "budgeted=moeplug.moe.budgeted.budgeted_dispatcher(dispatcher, experts, "
                "runtime.runtime.sync_free, group=the EP group), as build_model does")
        self.overlap_chunks = overlap_chunks
        # Small buffers of this layer's ops, forward and backward (moeplug.runtime.workspace.Arena):
        # the one its runtime registration gave it, else its own (over its own workspace of large
        # buffers). Reused every step, so after warm-up the layer's path allocates nothing
        # (tests/test_moe_allocations.py).
        self.workspace = (runtime.workspace if runtime is not None
                          else workspace.Arena(workspace.Workspace()))

    def forward(self, x_ND: torch.Tensor) -> MoEOutput:
        with workspace.arena_scope(self.workspace):
            x_TD = token_rows(x_ND)  # a view, or (TP's s-major token chunk) an arena copy
            if self.experts.delay_wgrad_compute:
                x_TD = flush_at(x_TD)  # no expert weight gradient outlives this layer's backward
            routing = self.router_and_preprocess(x_TD, x_ND.shape[0] if x_ND.dim() == 3 else 1)
            dispatcher = self.dispatcher_now()
            schedule = self.schedule_now(dispatcher, x_TD)
            if schedule is not None:  # 2.-6. the same stages, pipelined or captured
                y_TD, kept_E = schedule(self, dispatcher, x_TD, routing)
            else:
                d = self.dispatch(dispatcher, x_TD, routing)                  # 2. dispatch
                y_SD = self.routed_experts_compute(d)                         # 3. experts
                y_TD = self.combine(dispatcher, y_SD, d)                      # 4. combine
                y_TD = self.shared_experts_add(x_TD, y_TD)                    # 5. shared, 6. sum
                kept_E = d.counts_E
            y_ND = rows_as(y_TD, x_ND)                                        # 6. sum
            return MoEOutput(y_ND, average_over_token_group(routing.aux_loss, self.token_group),
                             self.expert_counts(routing, kept_E), dict(routing.losses),
                             routing.pooled_aux)

    # ---- the stages -----------------------------------------------------------------------------

    def router_and_preprocess(self, x_TD: torch.Tensor, num_sequences: int) -> Any:
        """Stage 1. Sequence boundaries and groups go only to routers that declare they take
        them (moeplug.interfaces.Router), so third-party routers with forward(x_TD) keep
        working. Tokens are b-major (t = b*S + s)."""
        kwargs = {}
        if self.token_group is not None and self.router.accepts_token_group:
            kwargs["token_group"] = self.token_group
        if self.batch_group is not None and self.router.accepts_batch_group:
            kwargs["batch_group"] = self.batch_group
        if self.router.accepts_num_sequences:
            kwargs["num_sequences"] = num_sequences
        with stage("router"):
            return self.router(x_TD, **kwargs)

    def dispatch(self, dispatcher: Dispatcher, x_TD: torch.Tensor, routing: Any) -> Dispatched:
        """Stage 2, in one piece (a schedule may split it: ``dispatch_start`` / ``_wait``). The
        plugin's dispatcher gets the rows cast once for the experts' GEMMs (_rows_for_experts);
        the budgeted one gathers the token rows as they are."""
        rows = x_TD if dispatcher is self.budgeted else _rows_for_experts(x_TD)
        with stage("dispatch"):
            return dispatcher.dispatch(rows, routing)

    def routed_experts_compute(self, d: Dispatched) -> torch.Tensor:
        """Stage 3: the experts backend on the dispatched rows, what they save for backward in
        the runtime's paged stash (runtime.stash)."""
        with stage("experts"), self.stash_scope():
            return self.experts_call(d.x_SD, d.probs_S, d.counts_L, d.packed)

    def experts_call(self, x_SD: torch.Tensor, probs_S: torch.Tensor | None,
                     counts_L: torch.Tensor, packed: bool) -> torch.Tensor:
        """Stage 3's call, also what a captured piece runs (moeplug.moe.capture). ``packed``:
        budget rows packed (``Experts.forward_packed``: G chunks, counts_L [G, L])."""
        if packed:
            G = counts_L.shape[0]
            y_GSD = self.experts.forward_packed(x_SD.view(G, -1, x_SD.shape[1]), counts_L)
            return y_GSD.view(-1, y_GSD.shape[2])
        if not self.apply_probs_on_input:
            return self.experts(x_SD, probs_S, counts_L)
        # Megatron moe_apply_probs_on_input: FC2(act(FC1(p * x))). The weight moves onto the
        # rows and the experts get p = 1, so any Experts backend supports it unchanged.
        # (x * p, ones) into the arena: moeplug.ops.scale_rows.
        return self.experts(scale_rows(x_SD, probs_S), ones(probs_S), counts_L)

    def combine(self, dispatcher: Dispatcher, y_SD: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """Stage 4, in one piece (``combine_start`` / ``_wait`` when a schedule splits it)."""
        with stage("combine"):
            return dispatcher.combine(y_SD, d.meta)

    def shared_experts_add(self, x_TD: torch.Tensor, y_TD: torch.Tensor) -> torch.Tensor:
        """Stages 5 and 6: ``y_TD + shared(x_TD)`` (all tokens) when the layer has shared
        experts, into the arena (moeplug.moe.shared_experts.add_shared)."""
        return y_TD if self.shared is None else add_shared(y_TD, self.shared(x_TD))

    # ---- which dispatcher and schedule a call takes ---------------------------------------------

    def dispatcher_now(self) -> Dispatcher:
        """The budgeted dispatcher while runtime.sync_free is active and the layer trains, else
        the plugin's. Training only: an over-budget step is rerun by the trainer, but evaluation
        and generation have no rerun, so they take the dynamic path and never lose a token."""
        if self.budgeted is not None and self.budgeted.state.active and self.training:
            return self.budgeted
        return self.dispatcher

    def schedule_now(self, dispatcher: Dispatcher, x_TD: torch.Tensor) -> Schedule | None:
        """The schedule of stages 2-6 for this call (None: in order, :meth:`forward`)."""
        # Fewer tokens than chunks (a decode step): unchunked. Every EP rank holds the same T,
        # so all of them take the same branch and issue the same collectives.
        if 1 < self.overlap_chunks <= x_TD.shape[0]:
            from moeplug.moe.overlap import overlapped
            return overlapped
        if dispatcher is self.budgeted and self.budgeted.state.capture:
            from moeplug.moe.capture import captured
            return captured
        return None

    # ---- what the stages share ------------------------------------------------------------------

    def expert_counts(self, routing: Any, kept_E: torch.Tensor | None) -> torch.Tensor:
        """counts_E, logged, never differentiated: the budgeted dispatcher's kept counts (on the
        device), else the routing's, on the host on the CPU, on the device on a GPU. Choices
        dropped by capacity reach no expert, so they are not counted."""
        if kept_E is not None:
            return kept_E.detach()
        ids = routing.ids_TK.reshape(-1).detach()
        if ids.device.type == "cpu":
            # bincount's numbers, dropped choices left out, from the arena (no allocation).
            keep = None if routing.dropped_TK is None else kept(routing.dropped_TK)
            return expert_counts(ids, self.router.num_experts, keep)
        # Counted on the device (no boolean-mask gather, no bincount: each syncs) and left
        # there, as the budgeted dispatcher leaves them: the trainer reads them once the step's
        # backwards are queued, so the host never waits for the device here.
        keep = None if routing.dropped_TK is None else ~routing.dropped_TK.reshape(-1)
        return device_counts(ids, self.router.num_experts, keep)

    def stash_scope(self) -> contextlib.AbstractContextManager:
        """What the routed experts save for backward goes to the runtime's paged stash."""
        if self.runtime is None:
            return contextlib.nullcontext()
        return self.runtime.stash_scope(self.experts.parameters())
