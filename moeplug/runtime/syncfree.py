"""The runtime's sync-free mode (``runtime.sync_free``) and its capture/replay
(``runtime.capture``).

:class:`SyncFreeState` is owned by the model's :class:`moeplug.runtime.stash.ModelRuntime`; every MoE
layer reaches it through its registration handle. With it active the layers run
moeplug.moe.budgeted (static shapes, no host sync) and OR their device-side overflow flags
into it; the trainer reads the flag once per step, where the step syncs anyway (it reads the
loss on the host right after), and reruns an over-budget step once on the dynamic path.

Capture, CPU: each pure piece of the static region is compiled once by ``torch.compile``
(inductor, ``fullgraph=True``: a graph break is an error, so capture also proves the region
has no host sync) and that compiled code - forward and its AOTAutograd backward - is replayed
every step with no per-op Python dispatch. Why this and not a recorded kernel plan: see
docs/ARCHITECTURE.md "Sync-free MoE and capture/replay". CUDA: each piece of each layer is
recorded once as a runtime-owned forward graph and backward graph (moeplug.runtime.cuda_graph
.GraphedPieces) and replayed under autograd, one launch each.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

_compiled: dict[Callable, Callable] = {}


def captured(fn: Callable) -> Callable:
    """``fn`` compiled once (per process) for replay; recompiles only on new shapes/dtypes."""
    c = _compiled.get(fn)
    if c is None:
        c = _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    return c


class SyncFreeState:
    """``cfg``: the ``runtime:`` section. ``active``: layers take the static path now."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.active = bool(cfg.sync_free)
        self.capture = bool(cfg.capture)  # a benchmark may flip it to time eager beside replay
        # Eager on the CPU: the stages in the layers' workspace arenas (moeplug.moe.budgeted.arena); a
        # benchmark may flip it to time the pure pieces eagerly beside them.
        self.arena = True
        self._overflow: torch.Tensor | None = None
        self._flags: dict[torch.device, torch.Tensor] = {}  # the step's flag buffer per device
        # The step's largest demand in token_budget units: (a rank's most choices of one expert
        # - 1) over the balanced load T*K/E, max over layers and micro-batches (device fp64):
        # a budget fits a call iff ceil(T*K/E * budget) >= its most choices, i.e. iff the
        # budget is above that.
        self._demand: torch.Tensor | None = None
        self._demands: dict[torch.device, tuple] = {}
        self._graphs: Any = None  # moeplug.runtime.cuda_graph.GraphedPieces, made on first CUDA call

    def wrap(self, fn: Callable, owner: Any = None) -> Callable:
        """The piece ``owner`` (a layer) runs: with ``runtime.capture`` compiled (CPU) or
        recorded as CUDA graphs per owner (a GPU), else eager."""
        if not self.capture:
            return fn

        def run(*args: Any) -> Any:
            if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
                return self.graphs(owner, fn, *args)
            return captured(fn)(*args)
        return run

    @property
    def graphs(self) -> Any:
        """The CUDA recordings (moeplug.runtime.cuda_graph.GraphedPieces) of every layer."""
        if self._graphs is None:
            from moeplug.runtime.cuda_graph import GraphedPieces  # CUDA only: loads the CUDA runtime
            self._graphs = GraphedPieces()
        return self._graphs

    def note_overflow(self, flag: torch.Tensor) -> None:
        """OR a layer's device-side over-budget flag into the step's (no host sync), in place
        into one buffer per device: an `|` per layer and micro-batch allocated its result."""
        if self._overflow is None:
            buf = self._flags.get(flag.device)
            if buf is None:
                buf = self._flags[flag.device] = torch.zeros((), dtype=torch.bool,
                                                             device=flag.device)
            self._overflow = buf.copy_(flag.detach())
        else:
            self._overflow.logical_or_(flag.detach())

    def note_demand(self, wanted_E: torch.Tensor, balanced: float) -> None:
        """Fold one layer call's demand into the step's: ``wanted_E`` this rank's choices per
        expert (int64, the router's drops excluded), ``balanced`` T*K/E. On the device, in
        place into buffers kept per device (no host sync; on the CPU no allocation)."""
        dev = wanted_E.device
        bufs = self._demands.get(dev)
        if bufs is None:  # (step max, this call's peak count, its ratio, the balanced load, 1)
            bufs = self._demands[dev] = (
                torch.zeros((), dtype=torch.float64, device=dev),
                torch.zeros((), dtype=torch.int64, device=dev),
                torch.zeros((), dtype=torch.float64, device=dev),
                torch.zeros((), dtype=torch.float64, device=dev),
                torch.ones((), dtype=torch.float64, device=dev))
        step, count, ratio, bal, one = bufs
        torch.amax(wanted_E, 0, out=count)
        torch.sub(ratio.copy_(count), one, out=ratio)  # a Python 1 would be a fresh tensor
        torch.div(ratio, bal.fill_(balanced), out=ratio)
        if self._demand is None:
            self._demand = step.copy_(ratio)
        else:
            torch.maximum(step, ratio, out=step)

    def take_demand(self) -> torch.Tensor | None:
        """The step's demand so far (None: no static layer ran); resets it."""
        demand, self._demand = self._demand, None
        return demand

    def take_overflow(self) -> torch.Tensor | None:
        """The step's flag so far (None: no static layer ran); resets it. The buffer is
        overwritten by the next step's first layer: read it before that."""
        flag, self._overflow = self._overflow, None
        return flag

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The layers take the dynamic path (the over-budget rerun)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def record(self) -> dict:
        """What the run record lists about the mode."""
        how = "off"
        if self.capture:
            how = ("CPU: torch.compile(fullgraph=True, inductor), compiled once, replayed every "
                   "step; CUDA: runtime CUDA graphs, forward + backward per layer and piece")
        return {"sync_free": bool(self.cfg.sync_free), "token_budget": self.cfg.token_budget,
                "capture": how}
