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

The MoE layer calls them in this order (see ``moeplug.moe.MoELayer.forward``):
    1. route    ``router(x_TD) -> RouterOutput``
    2. dispatch ``dispatcher.dispatch(x_TD, routing) -> Dispatched``
    3. experts  ``experts(d.x_SD, d.probs_S, d.counts_L) -> y_SD``
    4. combine  ``dispatcher.combine(y_SD, d.meta) -> y_TD``
With ``runtime.sync_free`` the dispatcher of steps 2 and 4 is the core's budgeted one
(moeplug.moe.budgeted), wrapping the chosen plugin; step 3 is then the experts backend on
budget rows (``Experts.budget_rows``, ``Experts.forward_packed``).
No per-call state is kept on ``self``: everything ``combine`` needs travels in ``meta``, so two
micro-batches can be in flight at once. With ``model.moe.overlap_chunks`` > 1 steps 2 and 4 run
split in two (``Dispatcher.dispatch_start`` / ``dispatch_wait``, ``combine_start`` /
``combine_wait``; optional, see :class:`Dispatcher`) so exchanges overlap compute.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager

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

    Optional (defaults mean: the layer counts from the routing, rows as above):
    counts_E: the choices this dispatcher kept per global expert, when it counts them itself
              (runtime.sync_free's budgeted dispatcher: on the device, no host read); the
              layer logs these instead of counting the routing.
    packed:   runtime.sync_free's packed budget rows (``Experts.packed_rows``): x_SD holds G
              equal chunks, ``counts_L`` is [G, L], ``probs_S`` is None; the layer calls
              ``Experts.forward_packed`` instead of ``forward``.
    """

    x_SD: torch.Tensor
    probs_S: torch.Tensor | None
    counts_L: torch.Tensor
    meta: Any
    counts_E: torch.Tensor | None = None
    packed: bool = False


class Router(nn.Module, abc.ABC):
    """Chooses K experts per token. Owns the gate weight (``[E, D]``, fp32).

    Declared capabilities (class attributes, all optional with these defaults; the MoE layer
    reads these and nothing else off a router):
    """

    num_experts: int
    top_k: int
    #: The router needs sequence boundaries (per-sequence losses): it takes
    #: ``forward(x_TD, num_sequences=1)`` and the MoE layer passes the batch size B of its
    #: [B, S, D] input (tokens are b-major: t = b * S + s). False: ``forward(x_TD)``.
    accepts_num_sequences: bool = False
    #: It takes ``token_group=`` (tensor parallelism: the ranks holding other chunks of the same
    #: sequences) and counts experts over the whole group; the layer then averages the aux loss
    #: over it (moeplug.parallel.tensor_parallel.average_over_token_group).
    accepts_token_group: bool = False
    #: It takes ``batch_group=`` (the ranks training the step's other micro-batches, TP x DP x
    #: CP) and sums a global aux loss's counts over it each micro-batch (Megatron's n_i).
    accepts_batch_group: bool = False

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

    Declared capabilities (class attributes, optional with these defaults; the core reads these
    and nothing else off a dispatcher):
    """

    num_experts: int
    num_local_experts: int
    #: Under a low-precision recipe with ``quantize_dispatch`` the rows travel in the recipe's
    #: row format and are dequantized on receipt (moeplug.quant.wire), so the experts see
    #: quantized inputs; runtime.sync_free's budgeted exchange then sends its rows the same way,
    #: to compute what this dispatcher's layer computes.
    quantizes_dispatch: bool = False
    #: The split start/wait pairs below really run the exchange in the background (see there);
    #: False: the defaults, which exchange inside ``*_start``.
    overlaps_comm: bool = False

    @abc.abstractmethod
    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        ...

    @abc.abstractmethod
    def combine(self, y_SD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_TD: each token's rows summed back (rows already carry their routing weight)."""

    # ---- optional: split start/wait, for overlap (model.moe.overlap_chunks) ----
    # ``dispatch_wait(dispatch_start(x, r))`` must equal ``dispatch(x, r)``, and likewise for
    # combine. Between a start and its wait the MoE layer runs other work (the shared experts,
    # another chunk's experts) and other starts/waits, in the same order on every rank. The
    # pending object is per call (never kept on ``self``). The defaults below run the whole
    # exchange in ``*_start``, so every dispatcher works with overlap on, just without hiding
    # anything; a dispatcher whose exchange really runs in the background overrides all four
    # and sets ``overlaps_comm = True`` (the built-in ``alltoall`` does, over async collectives).

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
    MoE layer passes rows already scaled by p and p = 1. The core reaches the experts only
    through ``forward`` (and ``forward_packed``, below): it never reads their parameters itself.

    Declared capabilities (class attributes, optional with these defaults; the core reads these
    and nothing else off a backend). A mode that needs one the chosen backend lacks is refused
    before any rank starts, naming the backend, the capability and the fix:
    """

    num_local_experts: int
    #: The backend can keep FC1's output and rebuild the activation in backward
    #: (``model.recompute.modules: [moe_act]``), and its ops pass FC1's input and output to
    #: ``moeplug.ops.offload_marks.note`` (the ``expert_fc1`` / ``moe_act`` offload names).
    can_recompute_activation: bool = False
    #: Set to True by the core when moe_act recompute is on (only on a backend that can).
    recompute_activation: bool = False
    #: The backward queues its weight-gradient GEMMs (``model.moe.delay_wgrad_compute``,
    #: moeplug.ops.delayed_wgrad); the MoE layer then flushes the queue by its input's backward.
    delay_wgrad_compute: bool = False
    #: ``runtime.sync_free``: ``forward`` also takes budgeted rows, the static shapes of a
    #: token budget: x_SD [L*B, D] with every local expert's B rows x_SD[e*B:(e+1)*B]
    #: (``counts_L`` is [B] * L, the same CPU tensor every call) and probs_S [L*B] holding each
    #: row's routing weight, 0 on the rows no choice filled (zero rows: computing them changes
    #: nothing). Such a call must read no device tensor on the host (the mode never waits for
    #: the device; a constant like ``counts_L`` may be read).
    budget_rows: bool = False
    #: ``runtime.capture``: the budgeted call (``forward`` on budget rows, ``forward_packed``)
    #: is compiled (``torch.compile(fullgraph=True)`` on the CPU) or recorded as a CUDA graph
    #: with the rest of the layer's static region: no graph break, the same ops every call.
    capturable: bool = False
    #: The backend implements :meth:`forward_packed`, which runtime.sync_free on the CPU then
    #: calls instead of ``forward`` on budget rows: no FLOPs on padding rows.
    packed_rows: bool = False
    #: Under a low-precision recipe (a Precision declaring ``quantizes_gemms``: the emulated
    #: FP8/FP4 recipes) ``forward`` runs its GEMMs through ``moeplug.quant.active_recipe()``
    #: (``moeplug.quant.quant_expert_mlp``, or ``F.linear``, which the recipe intercepts while
    #: it is active). A backend without it is refused under such a recipe (the precision
    #: mode's rule, moeplug.config.modes.precision): its GEMMs would silently stay in full
    #: precision.
    runs_recipe: bool = False

    @abc.abstractmethod
    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        ...

    @classmethod
    def missing_capability(cls, *, sync_free: bool, capture: bool) -> str | None:
        """What this backend lacks for runtime.sync_free / runtime.capture: its name, the
        capability and the fix in one line, or None."""
        # The messages are the modes' own (moeplug.config.modes sync_free, capture), which
        # the plugin host runs before any rank starts; this is for a layer built by hand.
        from moeplug.config.modes import capture as capture_mode, sync_free as sync_free_mode
        missing = sync_free_mode.missing_budget_rows(cls) if sync_free else None
        if missing is None and sync_free and capture:
            missing = capture_mode.missing_capturable(cls)
        return missing

    def forward_packed(self, x_GSD: torch.Tensor, counts_GL: torch.Tensor) -> torch.Tensor:
        """Budgeted rows packed (``packed_rows``): y_GSD for G chunks of S rows each (one per
        source EP rank, P*W under expert tensor parallelism). Chunk g's first
        ``counts_GL[g].sum()`` rows are its routed rows, expert-contiguous in expert order
        (``counts_GL[g, e]`` rows of local expert e); its other rows are padding whose outputs
        are never read (they may be left unwritten). No routing weight: the budgeted
        dispatcher's combine applies it (FC2 is linear). ``counts_GL`` is an int64 CPU tensor
        the mode's kernels wrote: read it only inside a registered op (torch.library), never
        from Python, so the call stays host-sync-free and capturable."""
        raise NotImplementedError(
            f"{type(self).__name__}.forward_packed: not implemented; a backend that declares "
            f"packed_rows = True implements it")


class Precision(abc.ABC):
    """A numeric recipe: which dtype computes, and how the forward/backward is wrapped.

    Parameters and optimizer state stay fp32 (master weights); ``autocast`` wraps the forward.
    Experts backends read ``torch.is_autocast_enabled(device)`` / ``torch.get_autocast_dtype``
    to pick their GEMM dtype. A low-precision recipe also enters
    ``moeplug.quant.recipe_plan(recipe, ...)`` in ``autocast``: the model then runs each
    transformer block's GEMMs through the recipe (``moeplug.quant.active_recipe()``).

    Declared attributes (the core reads these and the methods below, nothing else):
    """

    name: str
    #: The dtype the model computes in (fp32, or bf16 under autocast); the trainer's MFU uses it.
    compute_dtype: torch.dtype = torch.float32
    #: Rows per expert must be a multiple of it for the recipe's grouped GEMMs (16 FP8, 32
    #: MXFP8/NVFP4); the ``topk`` router pads to it.
    row_alignment: int = 1
    #: Its ``autocast`` runs each transformer block's GEMMs through a ``moeplug.quant`` recipe
    #: (``moeplug.quant.active_recipe()`` is set there): the experts backend must then declare
    #: ``Experts.runs_recipe``, or the run is refused before any rank starts.
    quantizes_gemms: bool = False

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


class PluginOptions:
    """What the host reads off a plugin's ``options_cls`` (a dataclass), besides its fields.
    Subclassing this is optional: a plain dataclass with the same names works alike.

    ``execution_only``: names of options that change how the plugin runs, not what it computes
    (a resume may change them; ``PluginHost.defining_options`` leaves them out).
    ``training_only``: names of options that only weight or steer training (loss coefficients,
    update rates): the trained model computes the same, so a resume may change them too.
    ``check_parallel(parallel)``: rules needing the parallel layout (``cfg.parallel``), run
    before any process group exists; raise ValueError/ConfigError with the field and a Fix.
    """

    execution_only: ClassVar[tuple[str, ...]] = ()
    training_only: ClassVar[tuple[str, ...]] = ()

    def check_parallel(self, parallel: Any) -> None:
        """Nothing to check (the default)."""

    @staticmethod
    def execution_only_of(options_cls: type) -> tuple[str, ...]:
        """``options_cls.execution_only``, () for a dataclass that declares none."""
        return tuple(getattr(options_cls, "execution_only", ()))

    @staticmethod
    def training_only_of(options_cls: type) -> tuple[str, ...]:
        """``options_cls.training_only``, () for a dataclass that declares none."""
        return tuple(getattr(options_cls, "training_only", ()))

    @staticmethod
    def parallel_check_of(options: Any) -> Callable[[Any], None] | None:
        """``options.check_parallel``, None for a dataclass that declares none."""
        return getattr(options, "check_parallel", None)


# --------------------------------------------------------------------------------------------
# Factories: what a plugin registers. The registry validates ``options`` with the plugin's
# ``options_cls`` (a dataclass) before calling the factory.
# --------------------------------------------------------------------------------------------
#   router:     factory(model: ModelConfig, options) -> Router
#   dispatcher: factory(model: ModelConfig, options, group: ProcessGroup | None) -> Dispatcher
#   experts:    factory(model: ModelConfig, options, num_local_experts: int) -> Experts
#   precision:  factory(options) -> Precision

KINDS = ("router", "dispatcher", "experts", "precision")

__all__ = ["RouterOutput", "Dispatched", "Router", "Dispatcher", "Experts", "Precision",
           "PluginOptions", "KINDS", "ModelConfig"]
