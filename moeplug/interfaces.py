"""Plugin interfaces: what a router, dispatcher, experts backend and precision recipe must be.

These four classes, the frozen data objects that pass between them, and the hookspecs in
:mod:`moeplug.hookspecs` are moeplug's public plugin API. ``moeplug.testing`` holds the contract
tests every implementation must pass; third-party authors run the same tests on theirs.

Shape-suffix legend (torchtitan style), used throughout moeplug:
    T  tokens in the local micro-batch (batch * sequence, flattened)
    D  hidden size             K  top-k (experts per token)
    E  experts (global)        L  experts local to this rank
    S  routed rows after dispatch (sum of rows received by local experts)
    F  expert FFN hidden size
    e.g. ``x_TD`` is a [T, D] tensor, ``ids_TK`` a [T, K] tensor, ``counts_L`` an [L] tensor.

The MoE layer calls them in this order (see ``moeplug.modules.moe.MoELayer.forward``):
    1. route    ``router(x_TD) -> RouterOutput``
    2. dispatch ``dispatcher.dispatch(x_TD, routing) -> Dispatched``
    3. experts  ``experts(d.x_SD, d.probs_S, d.counts_L) -> y_SD``
    4. combine  ``dispatcher.combine(y_SD, d.meta) -> y_TD``
No per-call state is kept on ``self``: everything ``combine`` needs travels in ``meta``, so two
micro-batches can be in flight at once. With ``model.moe.overlap_chunks`` > 1 steps 2 and 4 run
split in two (``Dispatcher.dispatch_start`` / ``dispatch_wait``, ``combine_start`` /
``combine_wait``; optional, see :class:`Dispatcher`) so exchanges overlap compute.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from torch import nn

from moeplug.config import ModelConfig


@dataclass(frozen=True)
class RouterOutput:
    """Routing decision for T tokens.

    probs_TK: float32 weights of the chosen experts (already renormalised/scaled by the router).
    ids_TK:   int64 expert ids in [0, E); a token's K ids are distinct.
    aux_loss: scalar tensor, the load-balancing loss *times its coefficient*; it is added to the
              training loss by the model. ``torch.zeros(())`` when the router has none.
    logits_TE: float32 router logits (for logging / z-loss); may be None.

    Optional (defaults mean: nothing dropped, no padding, nothing to log):
    losses:       detached, *unscaled* per-layer values for logging, e.g. ``aux_loss``,
                  ``seq_aux_loss``, ``global_aux_loss``, ``z_loss``, ``dropped_fraction``.
    dropped_TK:   bool [T, K], True where capacity dropped the choice. A dropped choice keeps a
                  valid, distinct id and has prob 0, so a dispatcher that ignores this field still
                  computes the right output (it just also computes the dropped rows); dispatchers
                  that honour it send no row for it (see ``moeplug.routing.rows``).
    capacity:     when set, every local expert must receive exactly ``capacity * ep_size`` rows:
                  the dispatcher pads with prob-0 rows (static shapes, Megatron pad-to-capacity).
    pad_multiple: the dispatcher pads each local expert's rows to a multiple of this with prob-0
                  rows (quantised grouped GEMMs want 16/32-row tiles); outputs do not change.
    pooled_aux:   a loss over *all* MoE layers together (moeplug.routing.pooled.PooledAuxStats:
                  transformers' load_balancing_loss_func): this layer's statistics of it, which
                  the model combines once per forward and adds to the aux loss.
    """

    probs_TK: torch.Tensor
    ids_TK: torch.Tensor
    aux_loss: torch.Tensor
    logits_TE: torch.Tensor | None = None
    losses: dict = field(default_factory=dict)
    dropped_TK: torch.Tensor | None = None
    capacity: int | None = None
    pad_multiple: int = 1
    pooled_aux: Any = None


@dataclass(frozen=True)
class Dispatched:
    """Tokens laid out for the local experts.

    x_SD:     rows grouped by local expert, expert 0's rows first (expert-contiguous).
    probs_S:  float32 routing weight of each row (experts apply it after the activation).
    counts_L: int64 CPU tensor, rows per local expert; ``counts_L.sum() == S``.
    meta:     opaque, frozen object that only this dispatcher's ``combine`` understands.
    """

    x_SD: torch.Tensor
    probs_S: torch.Tensor
    counts_L: torch.Tensor
    meta: Any


class Router(nn.Module, abc.ABC):
    """Chooses K experts per token. Owns the gate weight (``[E, D]``, fp32).

    A router that needs sequence boundaries (per-sequence losses) sets
    ``accepts_num_sequences = True`` and takes ``forward(x_TD, num_sequences=1)``; the MoE layer
    then passes the batch size B of its [B, S, D] input (tokens are b-major: t = b * S + s).
    Routers that leave it False keep the one-argument ``forward(x_TD)``.
    """

    num_experts: int
    top_k: int
    accepts_num_sequences: bool = False

    @abc.abstractmethod
    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        ...

    def finalize_step(self, group=None) -> None:
        """Called once per optimizer step, after ``optimizer.step()``, by
        ``MoETransformer.finalize_step``. Routers with per-step state (e.g. an expert-bias
        update from the step's token counts, or counts accumulated for a global-batch aux loss)
        update and reset it here; ``group`` is the process group whose ranks saw different tokens
        (data/context parallel), over which counts are summed. Default: nothing to do."""


class Dispatcher(abc.ABC):
    """Moves routed tokens to the ranks/rows of their experts and back.

    Constructed with the expert-parallel process group (``None`` = single process). A dispatcher
    is stateless between calls: ``dispatch`` returns everything ``combine`` needs in ``meta``.
    Both methods are differentiable w.r.t. their tensor inputs.
    """

    num_experts: int
    num_local_experts: int
    # True when, under a low-precision recipe with ``quantize_dispatch``, the rows travel in
    # the recipe's row format and are dequantized on receipt (moeplug.quant.wire), so the
    # experts see quantized inputs; the sync-free region (runtime.sync_free) then sends its
    # rows the same way, to compute what this dispatcher's layer computes.
    quantizes_dispatch: bool = False

    @abc.abstractmethod
    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        ...

    @abc.abstractmethod
    def combine(self, y_SD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_TD: each token's rows summed back (rows already carry their routing weight)."""

    # ---- optional capability: split start/wait, for overlap (model.moe.overlap_chunks) ----
    # ``dispatch_wait(dispatch_start(x, r))`` must equal ``dispatch(x, r)``, and likewise for
    # combine. Between a start and its wait the MoE layer runs other work (the shared experts,
    # another chunk's experts) and other starts/waits, in the same order on every rank. The
    # pending object is per call (never kept on ``self``). The defaults below run the whole
    # exchange in ``*_start``, so every dispatcher works with overlap on, just without hiding
    # anything; a dispatcher whose exchange really runs in the background overrides all four
    # and sets ``overlaps_comm = True`` (the built-in ``alltoall`` does, over async collectives).
    overlaps_comm: bool = False

    def dispatch_start(self, x_TD: torch.Tensor, routing: RouterOutput) -> Any:
        """Begin dispatching; returns an opaque pending object for :meth:`dispatch_wait`."""
        return self.dispatch(x_TD, routing)

    def dispatch_wait(self, pending: Any) -> Dispatched:
        """Finish what :meth:`dispatch_start` began (blocks until the rows have arrived)."""
        return pending

    def combine_start(self, y_SD: torch.Tensor, meta: Any) -> Any:
        """Begin combining; returns an opaque pending object for :meth:`combine_wait`."""
        return self.combine(y_SD, meta)

    def combine_wait(self, pending: Any) -> torch.Tensor:
        """Finish what :meth:`combine_start` began: y_TD, as :meth:`combine` returns it."""
        return pending


class Experts(nn.Module, abc.ABC):
    """The routed expert FFNs of one layer (the local ones).

    Parameters, shared by every backend so checkpoints are interchangeable (Hugging Face
    Mixtral layout), by ``model.moe.activation`` (see ``moeplug.ops.activations``):
        swiglu, geglu (gated)      ``gate_up_proj`` [L, 2F, D] (gate rows first, then up rows)
        gelu, squared_relu         ``gate_up_proj`` [L, F, D]
        every activation           ``down_proj``    [L, D, F]
    For expert e and rows x: y = down(act(gate_up x) * p), e.g. swiglu:
    y = down(silu(gate x) * (up x) * p). The routing weight p scales the activation, not the
    input rows, so dispatchers never keep weighted copies; with ``moe.apply_probs_on_input`` the
    MoE layer passes rows already scaled by p and p = 1.

    ``recompute_activation`` (optional class attribute, default absent): a backend that defines
    it accepts ``model.recompute.modules: [moe_act]`` (the trainer sets it True: keep FC1's
    output, rebuild the activation in backward) and the ``expert_fc1`` / ``moe_act`` offload
    names (its op passes those tensors to ``moeplug.ops.offload_marks.note``). A backend
    without it is refused for those settings before training starts.
    """

    num_local_experts: int

    @abc.abstractmethod
    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        ...


class Precision(abc.ABC):
    """A numeric recipe: which dtype computes, and how the forward/backward is wrapped.

    Parameters and optimizer state stay fp32 (master weights); ``autocast`` wraps the forward.
    Experts backends read ``torch.is_autocast_enabled(device)`` / ``torch.get_autocast_dtype``
    to pick their GEMM dtype. A low-precision recipe also enters
    ``moeplug.quant.recipe_plan(recipe, ...)`` in ``autocast``: the model then runs each
    transformer block's GEMMs through the recipe (``moeplug.quant.active_recipe()``).

    ``row_alignment`` (optional, default 1): rows per expert must be a multiple of it for the
    recipe's grouped GEMMs (16 FP8, 32 MXFP8/NVFP4); the ``topk`` router pads to it.
    """

    name: str
    compute_dtype: torch.dtype
    row_alignment: int = 1

    def autocast(self, device_type: str) -> ContextManager:
        return contextlib.nullcontext()

    def state_dict(self, model: Any, groups: Any = None) -> Any:
        """JSON-ready state the recipe carries from step to step (e.g. delayed scaling's amax
        histories), saved in checkpoints; None when it has none (the default). Each rank's is
        saved. ``groups`` as in :meth:`end_step`."""
        return None

    def load_state_dict(self, state: Any, model: Any, groups: Any = None) -> None:
        """Restore a :meth:`state_dict` on resume (``model``: the model now running, ``groups``
        its layout). On the layout that saved it each rank gets its own rank's state; on
        another layout (resharding) every saved rank's state in turn, in rank order, so a
        state keyed by what it describes (one-process parameter names, global expert ids)
        lets each rank take the entries it now holds, and a later call adds to, not replaces,
        what an earlier one restored. Ignoring a state starts afresh (the default)."""

    def end_step(self, model: Any, groups: Any = None, train: bool = True) -> None:
        """Called by the trainer on every rank once a training step's forward and backward are
        done (``train``), before the optimizer, and after each evaluation (``train=False``).
        A stateful recipe folds what the step's GEMMs recorded into its state here (delayed
        scaling: the step's amaxes, reduced over the stage's ranks, into the histories) or, after
        an evaluation, drops it: evaluating must not change the training. ``groups``: the run's
        ``moeplug.parallel.ParallelGroups`` (None in one process); with groups and ``train`` this
        is a collective over ``groups.tp_dp_cp``. Stateless recipes do nothing (the default)."""


# --------------------------------------------------------------------------------------------
# Factories: what a plugin registers. The registry validates ``options`` with the plugin's
# ``options_cls`` (a dataclass) before calling the factory.
# --------------------------------------------------------------------------------------------
#   router:     factory(model: ModelConfig, options) -> Router
#   dispatcher: factory(model: ModelConfig, options, group: ProcessGroup | None) -> Dispatcher
#   experts:    factory(model: ModelConfig, options, num_local_experts: int) -> Experts
#   precision:  factory(options) -> Precision

KINDS = ("router", "dispatcher", "experts", "precision")

__all__ = ["RouterOutput", "Dispatched", "Router", "Dispatcher", "Experts", "Precision", "KINDS",
           "ModelConfig"]
