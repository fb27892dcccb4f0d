"""Delayed weight-gradient computation for the routed experts (``model.moe.delay_wgrad_compute``,
Megatron-Core's ``delay_wgrad_compute``).

The backward of an MoE layer is a chain: combine's exchange -> experts -> dispatch's exchange.
Of the experts' backward only the data gradients (dX, dp) are on that chain; their weight
gradients (dW2 = dY^T a, dW1 = dh^T x: half the backward's GEMM flops) are needed only by the
optimizer. With the option on, the grouped expert FFN (moeplug.ops.grouped_ffn:
expert_mlp, grouped_mlp) compute dX and dp, hand them to autograd at once, and queue the weight
GEMMs here with :func:`defer`. The next exchange backward of moeplug.parallel.comm starts its
all-to-all / reduce-scatter asynchronously, runs the queue (:func:`run_pending`) while the
rows travel, and only then waits: the weight GEMMs hide the dispatch's backward exchange.

    experts backward:   dA, dh, dX, dp      -> autograd             defer(dW2, dW1)
    dispatch backward:  start exchange(dX)  -> run_pending()        -> wait
    layer input:        run_pending()  (flush: whatever no exchange ran, e.g. at one rank)

Gradients are bitwise those of the plain backward: each deferred GEMM is the same op on the
same tensors, and it is summed into ``param.grad`` exactly as autograd's AccumulateGrad would
(adopt it when ``.grad`` is None, else ``grad += dW``), once per use of the weights. The one
exception is a chunked layer (``overlap_chunks`` > 1): autograd first adds the chunks' dW and
then adds that to ``.grad``, the queue adds each chunk's dW to ``.grad`` - an fp32 reorder.

The queue is per thread: CPU autograd runs a backward on the thread that called it, so the
combined 1F1B helper thread (moeplug.parallel.ep_overlap) has its own, and a forward running
beside it on the main thread never sees it. Every MoE layer flushes its queue when the backward
reaches its input (:func:`flush_at`), so no weight gradient outlives its layer's backward; the
trainer's backward also calls :func:`run_pending` last, for graphs whose input needs no grad.

This module imports nothing of moeplug (the ops and the collectives both use it).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

_thread = threading.local()


def _queue() -> list[Callable[[], None]]:
    q = getattr(_thread, "queue", None)
    if q is None:
        q = _thread.queue = []
    return q


# Counts over all threads (the combined 1F1B helper threads end after each backward).
_counts_lock = threading.Lock()
_counts = {"deferred": 0, "in_flight": 0, "flushed": 0}


def _count(key: str, n: int = 1) -> None:
    with _counts_lock:
        _counts[key] += n


def defer(work: Callable[[], None]) -> None:
    """Queue ``work`` (weight-gradient GEMMs and their accumulation) on this thread."""
    _queue().append(work)
    _count("deferred")


def pending() -> int:
    """How many deferred pieces of work this thread holds."""
    return len(_queue())


def run_pending(in_flight: bool = False) -> int:
    """Run this thread's queue first-in first-out (the order autograd would have produced the
    gradients in); ``in_flight``: the caller has an exchange in flight (counted for stats)."""
    q = _queue()
    n = 0
    with torch.no_grad():  # as inside a backward (the trainer calls this after one)
        while q:
            q.pop(0)()
            n += 1
    if n:
        _count("in_flight" if in_flight else "flushed", n)
    return n


def stats(reset: bool = False) -> dict[str, int]:
    """Counts since the last reset, over all threads: ``deferred`` pieces queued, run with an
    exchange ``in_flight``, and ``flushed`` at a layer's input or the end of a backward
    (nothing to hide behind: no exchange, or a dispatcher whose exchange is not in
    moeplug.parallel.comm)."""
    with _counts_lock:
        out = dict(_counts)
        if reset:
            for k in _counts:
                _counts[k] = 0
    return out


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad`` += ``grad`` as AccumulateGrad does it: adopt when unset, add in place
    otherwise (same rounding as the plain backward)."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad.detach()
        else:
            param.grad += grad


def can_defer(*weights: torch.Tensor) -> bool:
    """Weights whose gradient can be summed in by hand: leaves (parameters) that want a grad.
    A weight reached through other ops (a cast outside the op, a view) keeps autograd's path."""
    return all(w.requires_grad and w.is_leaf for w in weights)


class _Flush(torch.autograd.Function):
    """Identity on the layer's input; its backward runs once every gradient of the input has
    arrived - after the layer's dispatch exchange - and empties the queue."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        run_pending()
        return grad


def flush_at(x: torch.Tensor) -> torch.Tensor:
    """``x`` (the MoE layer's input), marked so the backward runs the queue when it reaches it."""
    return _Flush.apply(x) if x.requires_grad else x
