"""Activation recompute (Megatron ``--recompute-granularity`` / ``--recompute-modules``).

``apply_recompute(model, cfg)`` marks modules of a built model; nothing else changes (parameter
names, checkpoints and outputs stay the same; gradients are identical because the recomputed
forward is the same code on the same inputs). Selective names -> what the backward recomputes:

    core_attn       softmax(q k^T) v (CoreAttention; not CP's ring/all-gather attention)
    mla_up_proj     MLA's latent norms, up projections and RoPE (MLAttention.up_projections)
                    run without autograd; the q, k, v they make are dropped once attention
                    has run and made again before its backward (Megatron's output discarding)
    layernorm       the blocks' attn_norm and ffn_norm: their outputs, which the next
                    projection keeps, are dropped once it has run and made again from the
                    norm's input when the backward reaches it (moeplug.ops.discard,
                    Megatron's output discarding); a norm keeps only its input anyway
    moe_act         the expert activation: only FC1's output is kept, act(h) * p is rebuilt
                    per expert in backward (output discarding, as Megatron; grouped experts)
    mlp             the dense SwiGLU MLPs
    moe             the whole MoE layer (router, dispatch, experts, combine, shared)
    shared_experts  the shared expert MLP

A checkpointed module keeps only its inputs; its internals are rebuilt in backward by
``torch.utils.checkpoint`` (non-reentrant). ``layernorm`` and ``moe_act`` discard *outputs*, as
Megatron does: the tensor the next op keeps is freed and rebuilt before that op's backward.
Side effects must happen once: a router counts tokens for the expert-bias update and global aux
loss only when :func:`recomputing` is False, so recomputing ``moe`` or a full block does not
count a micro-batch twice. Routing is deterministic, so the recomputed routing is the same.
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from moeplug.config import RecomputeConfig
from moeplug.interfaces import Experts
from moeplug.modules import marks
from moeplug.ops import discard
from moeplug.quant.linear import active_recipe, recipe_scope

_RECOMPUTING: ContextVar[bool] = ContextVar("moeplug_recomputing", default=False)
_CHECKPOINTED: ContextVar[bool] = ContextVar("moeplug_checkpointed", default=False)
# Bytes of checkpoint inputs held for backward (moeplug.training.memory counts them: torch's
# checkpoint keeps them by reference, out of saved_tensors_hooks' sight).
_HELD_INPUTS: ContextVar[Callable[[Iterable[Any]], None] | None] = ContextVar(
    "moeplug_recompute_held", default=None)


def recomputing() -> bool:
    """True while a checkpointed forward is being re-run in backward (skip side effects)."""
    return _RECOMPUTING.get()


def will_recompute() -> bool:
    """True in a checkpointed forward's first run: whatever a side effect fed into the graph
    must be kept for the re-run in backward (which sees the state after the side effect)."""
    return _CHECKPOINTED.get()


@contextlib.contextmanager
def _flag(var: ContextVar[bool]):
    token = var.set(True)
    try:
        with discard.suspended():  # a checkpointed region keeps nothing to discard
            yield
    finally:
        var.reset(token)


def _contexts():
    return _flag(_CHECKPOINTED), _flag(_RECOMPUTING)


# torch.get_rng_state / set_rng_state hold the generator's mutex while they build or read a
# Python object; a garbage collection there can run a finalizer that hands the GIL to another
# thread, and if that thread calls them too it blocks on the mutex holding the GIL: both hang.
# Combined 1F1B hit it (a fresh-clone CI run, PP2 x EP2): the forward's checkpoint saving the
# RNG state on one thread, the overlapped backward's recompute forking it on the other. So a
# checkpoint's RNG save and replay are ours and go through this lock, and a thread waiting for
# it waits with the GIL released (tests/test_recompute.py reproduces the hang without it).
_RNG_LOCK = threading.Lock()


def _rng_state(args: tuple) -> tuple:
    """The CPU generator's state and those of the devices ``args`` live on."""
    with _RNG_LOCK:
        return (torch.get_rng_state(), *get_device_states(*args))


def _set_rng_state(state: tuple, args: tuple) -> None:
    cpu, devices, states = state
    with _RNG_LOCK:
        torch.set_rng_state(cpu)
        if devices:  # get_device_states found them on these args' non-CPU tensors
            kind = next(a.device.type for a in args if isinstance(a, torch.Tensor)
                        and a.device.type not in ("cpu", "meta"))
            set_device_states(devices, states, device_type=kind)


def _replaying_rng(fn: Callable, args: tuple) -> Callable:
    """``fn`` that, when recomputed, draws what its first run drew (torch.utils.checkpoint's
    preserve_rng_state, saved and restored under _RNG_LOCK) and leaves the RNG as it found it."""
    saved = _rng_state(args)

    def run(*a):
        if not recomputing():
            return fn(*a)
        now = _rng_state(a)
        _set_rng_state(saved, a)
        try:
            return fn(*a)
        finally:
            _set_rng_state(now, a)
    return run


def checkpointed(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` keeping only ``args`` for backward; a plain call when no grad is recorded
    or inside another checkpoint (which keeps only its own inputs anyway)."""
    if not torch.is_grad_enabled() or recomputing() or will_recompute():
        return fn(*args)
    recipe = active_recipe()
    if recipe is not None:  # the recomputation runs in backward, outside the forward's scope
        forward_fn = fn

        def fn(*a):
            with recipe_scope(recipe):
                return forward_fn(*a)
    note = _HELD_INPUTS.get()
    if note is not None:
        handles, inner = note(args), fn

        def fn(*a):  # the checkpoint keeps fn until its backward, and so the handles
            assert handles is not None
            return inner(*a)
    return checkpoint(_replaying_rng(fn, args), *args, use_reentrant=False,
                      preserve_rng_state=False, context_fn=_contexts)


class _RegionState:
    """What a discarded region's backward needs: how to run it again, with the forward's
    autocast and precision recipe, and the recomputation once made."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.recipe = active_recipe()
        kind = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        self.autocast = (dict(device_type=kind, dtype=torch.get_autocast_dtype(kind))
                         if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind)
                         else None)
        self.recomputed: tuple | None = None

    def make(self) -> tuple:
        """The region again, with autograd: its outputs (kept for the backward)."""
        inputs = tuple(a.detach().requires_grad_(a.requires_grad)
                       if isinstance(a, torch.Tensor) else a for a in self.args)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            if self.autocast is not None:
                stack.enter_context(torch.autocast(**self.autocast))
            if self.recipe is not None:
                stack.enter_context(recipe_scope(self.recipe))
            outs = self.fn(*inputs)
        self.recomputed = (inputs, outs)
        return outs


class _DiscardedRegion(torch.autograd.Function):
    """A region's outputs computed without autograd (its internals kept by nobody); the
    backward runs autograd over the recomputation that refilled them (Megatron's
    CheckpointWithoutOutputFunction)."""

    @staticmethod
    def forward(ctx, state: _RegionState, *args):
        ctx.state = state
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))  # counted
        with torch.no_grad():
            return tuple(state.fn(*args))

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        if state.recomputed is None:  # never released: nothing was freed
            state.make()
        inputs, outs = state.recomputed
        state.recomputed = None
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None
                        for a in inputs))


def discarded_region(fn: Callable, *args: Any) -> tuple:
    """``fn(*args)`` (a tuple of tensors) kept by nobody but its readers, and those only until
    the caller's :func:`moeplug.ops.discard.release`: the outputs are freed once their reader
    has run and made again, with autograd, just before the reader's backward."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    if not torch.is_grad_enabled() or not discard.may_note(first):
        return fn(*args)
    state = _RegionState(fn, args)
    outs = _DiscardedRegion.apply(state, *args)
    discard.note(outs, state.make)
    return outs


# A recomputed module's forward keeps only its inputs (moeplug.modules.marks).
RECOMPUTE = marks.MarkKind("Recomputed", lambda module, fn, *args: checkpointed(fn, *args))
# mla_up_proj: a method of the attention (MLAttention.up_projections), its q, k, v discarded.
RECOMPUTE_UP = marks.MarkKind("RecomputedUp", lambda module, fn, *args:
                              discarded_region(fn, *args), methods=("up_projections",))
# layernorm: the norm's output is noted, and freed by the block once its reader has run.
DISCARD = marks.MarkKind("Discarded", lambda module, fn, *args: discard.discarding(fn, *args))


def mark(module: nn.Module) -> None:
    marks.mark(module, RECOMPUTE)


def _selective_targets(block: nn.Module, name: str) -> list[nn.Module]:
    from moeplug.modules.attention import CoreAttention
    from moeplug.modules.mla import MLAttention
    from moeplug.modules.mlp import SwiGLUMLP
    from moeplug.moe import MoELayer
    from moeplug.modules.norm import RMSNorm
    from moeplug.moe.shared_experts import SharedExperts
    ffn = block.ffn
    if name == "core_attn":
        return [m for m in block.modules() if isinstance(m, CoreAttention)]
    if name == "mla_up_proj":  # MLAttention.up_projections, under RECOMPUTE_UP
        return [block.attn] if isinstance(block.attn, MLAttention) else []
    if name == "layernorm":  # the block's two: their outputs discarded (DISCARD)
        return [m for m in (block.attn_norm, block.ffn_norm) if isinstance(m, RMSNorm)]
    if name == "mlp":
        return [ffn] if isinstance(ffn, SwiGLUMLP) else []
    if name == "moe":
        return [ffn] if isinstance(ffn, MoELayer) else []
    if name == "shared_experts":
        return [m for m in block.modules() if isinstance(m, SharedExperts)]
    return []  # moe_act: a flag on the experts, see apply_recompute


def apply_recompute(model: nn.Module, cfg: RecomputeConfig) -> None:
    """Mark the blocks of ``model`` (a MoETransformer or a pipeline chunk) for ``cfg``."""
    from moeplug.moe import MoELayer
    blocks = list(model.blocks) + [layer.block for layer in getattr(model, "mtp", [])]
    if cfg.granularity != "selective":
        return  # full: ModelStages.run_blocks reads cfg.recompute itself (pipeline chunks too)
    for block in blocks:
        for name in cfg.modules:
            if name == "moe_act" and isinstance(block.ffn, MoELayer):
                # the backend declares it can (the recompute mode's rule, which build_model
                # and the plugin host run: moeplug.config.modes.recompute)
                block.ffn.experts.recompute_activation = True
            kind = _kind(name)
            for m in _selective_targets(block, name):
                marks.mark(m, kind)


def _kind(name: str) -> marks.MarkKind:
    """The mark a selective name puts on its targets."""
    return {"layernorm": DISCARD, "mla_up_proj": RECOMPUTE_UP}.get(name, RECOMPUTE)


def remove_recompute(model: nn.Module) -> None:
    """Undo apply_recompute's selective marks (benchmarks switch levers on one model)."""
    for m in model.modules():
        for kind in (RECOMPUTE, RECOMPUTE_UP, DISCARD):
            marks.unmark(m, kind)
        if isinstance(m, Experts) and m.recompute_activation:
            m.recompute_activation = False


def block_chunks(blocks: list[nn.Module], cfg: RecomputeConfig | None) -> list[list[nn.Module]]:
    """The stage's blocks in run order, grouped into the chunks run_chunk runs (full uniform:
    ``num_layers`` blocks per chunk; otherwise one block each)."""
    if cfg is None or cfg.granularity != "full":
        return [[b] for b in blocks]
    if cfg.method == "uniform":
        return [blocks[i:i + cfg.num_layers] for i in range(0, len(blocks), cfg.num_layers)]
    return [[b] for b in blocks]


def run_chunk(chunk: list[nn.Module], x_BSD: torch.Tensor, checkpoint_it: bool,
              scopes: list | None = None, positions_BS: torch.Tensor | None = None) -> list:
    """The chunk's block outputs in order (the last one's x is the chunk's output). ``scopes``:
    per block, a factory of the context to run it in (e.g. its precision recipe), entered again
    when a checkpointed chunk is recomputed. ``positions_BS``: document positions for every
    block's attention (packed documents), or None."""
    scopes = scopes or [contextlib.nullcontext] * len(chunk)
    extra = () if positions_BS is None else (positions_BS,)

    def run(x):
        outs = []
        for block, scope in zip(chunk, scopes):
            with scope():
                out = block(x, *extra)
            outs.append(out)
            x = out[0]
        return outs
    return checkpointed(run, x_BSD) if checkpoint_it else run(x_BSD)


def chunk_is_checkpointed(index: int, cfg: RecomputeConfig | None) -> bool:
    """Full recompute: uniform checkpoints every chunk, block only the first num_layers."""
    if cfg is None or cfg.granularity != "full":
        return False
    return cfg.method == "uniform" or index < cfg.num_layers
