"""Output discarding (Megatron's CheckpointWithoutOutput): a module's output is freed once the
module that reads it has run, and computed again from the first module's inputs when the
backward reaches the reader.

A norm's output is what the next projection (or the router) keeps for backward; the norm keeps
its input (moeplug.modules.norm). Recompute ``layernorm`` (moeplug.modules.recompute) marks the
blocks' two norms (its ``DISCARD`` mark): their forward notes how to make the output again
(:func:`discarding`), and the block, once the reader has run, calls :func:`release` with the
reader's output; moe_act does the same for the activation FC2 keeps (moeplug.ops.cuda_ffn),
and mla_up_proj for attention's q, k, v (moeplug.modules.recompute.discarded_region). That
frees the output's storage (the tensors autograd saved still point at it) and hooks the
reader's output gradient, which arrives just before the reader's backward, to refill the same
storage, bitwise the first values: the norm's forward again, without autograd.
Where nothing was noted (no mark, no grad, a checkpointed region, which keeps nothing anyway:
the checkpoints enter :func:`suspended`; or a CUDA graph being captured, where no allocation may
happen; or a graph being compiled, whose backward AOTAutograd plans) :func:`release` does
nothing.

Memory meters (moeplug.training.memory, the dry run) see storages shrink and grow through
:func:`observing`; the callbacks active when an output is freed are the ones told of its refill
(which may run on autograd's device thread).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

# callback(storage, nbytes, freed): storage shrank by nbytes (freed) or grew back (not freed)
Observer = Callable[[torch.UntypedStorage, int, bool], None]
_OBSERVERS: ContextVar[tuple[Observer, ...]] = ContextVar("moeplug_discard_observers",
                                                         default=())
# output -> (make, i): make() returns the noted outputs again, this one at index i; an entry
# lives until release() or the output dies
_NOTED = WeakIdKeyDictionary()
_SUSPENDED: ContextVar[bool] = ContextVar("moeplug_discard_suspended", default=False)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Note nothing inside (a checkpoint's first run and its recomputation)."""
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


@contextlib.contextmanager
def observing(callback: Observer) -> Iterator[None]:
    token = _OBSERVERS.set(_OBSERVERS.get() + (callback,))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def may_note(t: torch.Tensor) -> bool:
    """Whether outputs on ``t``'s device may be noted now: no checkpoint is running (one keeps
    nothing to discard), no CUDA graph is being captured (no allocation may happen) and no
    graph is being compiled (AOTAutograd picks what a compiled backward keeps)."""
    return (not torch.compiler.is_compiling() and not _SUSPENDED.get()
            and not _capturing(t))


def note(outs: Sequence[torch.Tensor], make: Callable[[], Sequence[torch.Tensor]]) -> None:
    """Let :func:`release` free ``outs``: ``make()`` returns tensors of their values, in order,
    when the backward needs them again."""
    for i, out in enumerate(outs):
        _NOTED[out] = (make, i)


def discarding(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, noted so that :func:`release` may free it (made again by ``fn`` on the
    same inputs, without autograd)."""
    out = fn(*args)
    if torch.is_grad_enabled() and out.requires_grad and may_note(out):
        def make() -> tuple[torch.Tensor]:
            with torch.no_grad():
                return (fn(*args),)
        note([out], make)
    return out


def release(outs: torch.Tensor | Sequence[torch.Tensor], reader_out: torch.Tensor) -> None:
    """Free ``outs`` (those noted by :func:`note`) now that their reader has made
    ``reader_out``; refill them when ``reader_out``'s gradient is computed."""
    if torch.compiler.is_compiling():  # nothing was noted (may_note)
        return
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    # one make() per noted region: (make, [(storage, index, bytes), ...])
    makes: dict[int, tuple[Callable, list]] = {}
    for out in outs:
        noted = _NOTED.pop(out, None)
        if noted is not None:
            make, i = noted
            storage = out.untyped_storage()
            makes.setdefault(id(make), (make, []))[1].append((storage, i, storage.nbytes()))
    if not makes or not reader_out.requires_grad:
        return
    observers = _OBSERVERS.get()
    for _, storages in makes.values():
        for storage, _, nbytes in storages:
            storage.resize_(0)
            for tell in observers:
                tell(storage, nbytes, True)

    def refill(grad: torch.Tensor) -> None:
        for make, storages in makes.values():
            if all(storage.nbytes() for storage, _, _ in storages):
                continue  # a second backward over a retained graph
            again = make()
            for storage, i, nbytes in storages:
                storage.resize_(nbytes)
                # A storage copy: the saved tensors' version counters stay as autograd
                # recorded them.
                storage.copy_(again[i].untyped_storage())
                for tell in observers:
                    tell(storage, nbytes, False)
    reader_out.register_hook(refill)
