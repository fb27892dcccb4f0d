"""Faults during training: non-finite steps, failed ranks, and a test-only fault injector.

Non-finite steps (``train.nonfinite``): :func:`train_step` never applies an update whose loss
or global grad norm is NaN/Inf (one NaN update poisons every weight for good); the trainer
then stops (``stop``) or counts the step as skipped and goes on (``skip``), at most
``train.max_skipped_steps`` in a row. The decision uses values every rank shares (the DP-mean
loss, the all-reduced grad norm), so all ranks skip or stop together. :class:`NonFiniteWatch`
names where it started: the first block whose output was non-finite in this rank's forward,
else the deepest parameter whose grad is (backward runs from the output, so that one is where
the NaN entered).

Failed ranks: a rank that dies makes torchrun stop the others; a rank that hangs makes its
peers' next collective time out after ``parallel.timeout_s``. Either way every rank that sees
the failure prints one line ``moeplug: rank R failed (...); this rank (r) stops`` and exits
non-zero (:func:`rank_failure_line`). Each rank records its progress in the rendezvous store
(:class:`Heartbeat`), so a timed-out rank can name the peer that is behind; a rank stuck inside
a step (all ranks started it) is named only if the error text names it ("a peer rank" else).
A rank that torchrun SIGTERMs before its own collective failed names it too
(:func:`exit_on_stop_signals`).

``MOEPLUG_TEST_FAULT`` (tests only, :class:`TestFault`) injects a fault at optimizer step N
(1-based, as logged): ``kill:rank=R:step=N`` (SIGKILL itself), ``hang:rank=R:step=N`` (sleep
forever), ``nan:layer=L:step=N`` or ``step=N-M`` (block L's output becomes NaN, every rank),
``nan_grad:layer=L:step=N`` (the gradient into block L's output becomes NaN).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import textwrap
import threading
import time
from datetime import timedelta
from typing import Any, Iterator

import torch

TEST_FAULT_ENV = "MOEPLUG_TEST_FAULT"
EXIT_FAULT = 3  # training stopped by a fault (config errors exit 2)


class TrainingFault(RuntimeError):
    """Training cannot go on; the message is one line for the user (the CLI prints it)."""


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


class NonFiniteWatch:
    """Forward hooks on the model's transformer blocks recording, per step, whether each
    block's output was finite (one reduction per block, kept as a tensor: no device sync)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.flags: list[tuple[str, torch.Tensor]] = []
        for name, module in model.named_modules():
            if re.search(r"(^|\.)(blocks|mtp)\.\d+$", name):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def record(_module, _inputs, out):
            x = out[0] if isinstance(out, tuple) else out
            self.flags.append((name, torch.isfinite(x.detach()).all()))
        return record

    def reset(self) -> None:
        self.flags = []

    def locate(self) -> str:
        """Where this step's non-finite values started on this rank ('' if unknown)."""
        for name, ok in self.flags:
            if not bool(ok):
                return f"output of {name}"
        bad = [n for n, p in self.model.named_parameters()
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        return f"grad of {bad[-1]}" if bad else ""


def nonfinite_message(step: int, loss: float, grad_norm: float, where: str) -> str:
    return (f"non-finite step {step}: loss {loss}, grad norm {grad_norm}"
            + (f", first at the {where}" if where else ""))


class Heartbeat:
    """Each rank's progress in the rendezvous store: 2N-1 once it starts optimizer step N, 2N
    once it finished it. When a collective fails, the ranks behind the others are the ones that
    did not arrive (one TCP store write per beat, two beats a step)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world

    def beat(self, progress: int) -> None:
        self.store.set(f"moeplug/progress/{self.rank}", str(progress))

    def laggards(self) -> list[int]:
        """Ranks behind the most advanced one ([] when all are level or the store is gone)."""
        try:
            self.store.set_timeout(timedelta(seconds=5))
            keys = [f"moeplug/progress/{r}" for r in range(self.world)]
            progress = [int(self.store.get(k)) if self.store.check([k]) else 0 for k in keys]
        except Exception:  # the store lives in torchrun's agent; if it is gone we cannot tell
            return []
        return [r for r, p in enumerate(progress) if p < max(progress)]


_COMM_ERROR = re.compile(r"gloo|nccl|timed out|timeout|connection (reset|closed|refused)|"
                         r"broken pipe|socket", re.IGNORECASE)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing on a lost peer, not a bug of this rank (gloo
    raises plain RuntimeErrors, so the text decides)."""
    return isinstance(error, torch.distributed.DistError) or bool(_COMM_ERROR.search(str(error)))


_PEER_IN_ERROR = re.compile(r"\brank[ :=]+(\d+)", re.IGNORECASE)


def rank_failure_line(error: BaseException, rank: int, heartbeat: Heartbeat | None) -> str:
    """The one line a rank prints when a collective failed because a peer died or hung."""
    text = " ".join(str(error).split())
    peers = heartbeat.laggards() if heartbeat is not None else []
    if not peers:  # every rank reached the same point: trust the error text, if it names one
        peers = sorted({int(m) for m in _PEER_IN_ERROR.findall(text)} - {rank})[:1]
    who = _who(peers)
    reason = "timed out" if "timeout" in text.lower() or "timed out" in text.lower() \
        else "connection lost"
    # at most 160 characters, cut between words
    text = textwrap.shorten(text, 160, placeholder=" ...")
    return (f"moeplug: {who} failed (collective {reason}: {text}); this rank ({rank}) "
            f"stops. Fix: find why that rank died or stalled (its output, the launcher's line); "
            "parallel.timeout_s bounds the wait for a stalled one")


def _who(peers: list[int]) -> str:
    return (f"rank {peers[0]}" if len(peers) == 1 else
            f"ranks {', '.join(map(str, peers))}" if peers else "a peer rank")


def exit_on_stop_signals(heartbeat: Heartbeat, rank: int) -> None:
    """When one rank fails torchrun SIGTERMs the others, possibly before their own collective
    noticed: such a rank still names the rank behind (if the heartbeats tell) and exits. The
    agent passes on the signal that stopped the launch itself, so SIGINT (Ctrl-C at the
    launch) is handled the same way: an exit status, not a KeyboardInterrupt traceback."""
    def stop(signum: int, _frame: Any) -> None:
        peers = [r for r in heartbeat.laggards() if r != rank]
        if peers:
            print(f"moeplug: {_who(peers)} failed (the launcher stopped this rank); this rank "
                  f"({rank}) stops", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


class Stopped(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM reached a single-process run (:func:`stop_on_signals`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """A single-process run: SIGTERM (a scheduler's stop) raises :class:`Stopped` as Ctrl-C
    does, so both end the run the same way, with :func:`stopped_line` and status 128 + signal,
    not a traceback or a silent death. The handlers are restored after; off the main thread
    (an in-process caller's worker) Python allows no handler, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise Stopped(signum)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def stopped_line(signum: int, latest: str | None) -> str:
    """What a stopped single-process run prints: the signal, what is kept (``latest``, the
    newest checkpoint, or None), how to go on (the words of the launch's own line,
    moeplug.training.launch)."""
    name = signal.Signals(signum).name
    if latest is None:
        return (f"moeplug: stopped by {name} before the first checkpoint; nothing to resume. "
                f"Fix: run again with --overwrite (or another --out)")
    return (f"moeplug: stopped by {name}; the newest checkpoint is {latest} (the steps after "
            f"it are lost). Fix: continue with the same command and --resume auto")


class TestFault:
    """The parsed ``MOEPLUG_TEST_FAULT`` (see the module docstring); None when unset."""

    def __init__(self, spec: str) -> None:
        kind, *fields = spec.split(":")
        try:
            if kind not in ("kill", "hang", "nan", "nan_grad"):
                raise ValueError(kind)
            kv = dict(f.split("=", 1) for f in fields)
            first, _, last = kv["step"].partition("-")
            self.kind, self.steps = kind, range(int(first), int(last or first) + 1)
            self.rank, self.layer = int(kv.get("rank", -1)), int(kv.get("layer", 0))
        except (ValueError, KeyError):
            raise TrainingFault(f"${TEST_FAULT_ENV} = {spec!r}: expected kill|hang:rank=R:step=N "
                                f"or nan|nan_grad:layer=L:step=N. Fix: unset it (tests only)") \
                from None
        self.current = 0

    @classmethod
    def from_env(cls) -> "TestFault | None":
        spec = os.environ.get(TEST_FAULT_ENV, "")
        return cls(spec) if spec else None

    def install(self, model: torch.nn.Module) -> None:
        if self.kind not in ("nan", "nan_grad"):
            return
        # By name: a pipeline rank holds only some blocks, under the full model's names.
        blocks = [m for n, m in model.named_modules()
                  if re.search(rf"(^|\.)blocks\.{self.layer}$", n)]

        def poison(_module, _inputs, out):
            x = out[0] if isinstance(out, tuple) else out
            if self.current not in self.steps or not torch.is_grad_enabled():
                return
            if self.kind == "nan":  # in place: keeps the block's output type
                x.mul_(float("nan"))
            else:  # the forward stays finite, the gradient into this block's output is NaN
                x.register_hook(lambda g: g * float("nan"))
        for block in blocks:
            block.register_forward_hook(poison)

    def before_step(self, step: int, rank: int) -> None:
        """Called at the start of optimizer step ``step`` (1-based)."""
        self.current = step
        if step not in self.steps or rank != self.rank:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
