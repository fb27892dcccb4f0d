"""Where a train step's time goes: wall-clock seconds per named stage, cheap enough to stay on.

Stages (``STAGES``), marked in the code that runs them with ``with stage(NAME):``
    attention  the attention sub-layer's forward (TransformerBlock; GQA or MLA, TP/CP comms in it)
    router     the MoE router's forward                       (MoELayer stage 1)
    dispatch   dispatcher.dispatch, its all-to-all included   (MoELayer stage 2)
    experts    the experts' forward                           (MoELayer stage 3)
    combine    dispatcher.combine, its all-to-all included    (MoELayer stage 4)
    backward   autograd backward of the whole step (every stage's backward is in here)
    comm_wait  collectives outside the model: gradient all-reduce / reduce-scatter, the logging
               all-reduces, pipeline receives and send completions
    optimizer  gradient clipping (its norm all-reduce included) and the optimizer step
:func:`measure_stages` adds ``step`` (wall time of its block) and ``other`` (step minus the
stages: embedding, norms, dense MLPs, shared experts, loss, router state updates, Python).

Only the outermost open stage counts, so the stages never overlap and never sum past ``step``.
Nothing is kept on a module: the seconds go to the clock that :func:`measure_stages` set in a
ContextVar for the duration of its block (per call, per thread; autograd's device threads see
none). Without an active clock a stage costs a compile check and a ContextVar lookup (well
under a microsecond); under ``torch.compile`` tracing it is a ``nullcontext``, so compiled graphs
stay whole (their time then falls in the enclosing stage, or ``other``).

Wall clock is right on CPU, where every op has finished when it returns. On CUDA, kernels run
asynchronously and the clock would measure launches, so the trainer measures only CPU runs
(a CUDA version would record ``torch.cuda.Event`` pairs instead).
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Iterator

import torch

STAGES = ("attention", "router", "dispatch", "experts", "combine", "backward", "comm_wait",
          "optimizer")


class _Clock:
    """The seconds of one :func:`measure_stages` block, and whether a stage is open in it."""

    __slots__ = ("seconds", "open")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.open = False


_ACTIVE: ContextVar[_Clock | None] = ContextVar("moeplug_stage_clock", default=None)
_NOTHING = contextlib.nullcontext()


class _Timed:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, clock: _Clock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.clock.open = True
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.clock.seconds[self.name] += time.perf_counter() - self.t0
        self.clock.open = False


def stage(name: str) -> contextlib.AbstractContextManager:
    """``with stage("router"): ...`` adds the block's wall time to ``name`` of the active clock;
    a no-op when none is active, when another stage is already open, or under compile tracing."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace a ContextVar read
        return _NOTHING
    clock = _ACTIVE.get()
    if clock is None or clock.open:
        return _NOTHING
    return _Timed(clock, name)


@contextlib.contextmanager
def measure_stages(enabled: bool = True) -> Iterator[dict[str, float]]:
    """Time the stages run inside the block. The yielded dict is filled when the block exits:
    seconds per name in ``STAGES``, plus ``step`` and ``other``; it stays empty when
    ``enabled`` is False (then nothing is measured at all)."""
    times: dict[str, float] = {}
    if not enabled:
        yield times
        return
    clock = _Clock()
    token = _ACTIVE.set(clock)
    t0 = time.perf_counter()
    try:
        yield times
    finally:
        step = time.perf_counter() - t0
        _ACTIVE.reset(token)
        times.update(clock.seconds, step=step, other=step - sum(clock.seconds.values()))


def add_times(total: dict[str, float], times: dict[str, float]) -> dict[str, float]:
    """``total + times`` per key (a new dict): sums steps' breakdowns over a logging window."""
    return {k: total.get(k, 0.0) + times.get(k, 0.0) for k in {**total, **times}}
