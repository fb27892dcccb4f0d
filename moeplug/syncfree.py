"""The runtime's sync-free mode (``runtime.sync_free``) and its capture/replay
(``runtime.capture``).

:class:`SyncFreeState` is owned by the model's :class:`moeplug.stash.ModelRuntime`; every MoE
layer reaches it through its registration handle. With it active the layers run
moeplug.modules.static_moe (static shapes, no host sync) and OR their device-side overflow flags
into it; the trainer reads the flag once per step, where the step syncs anyway (it reads the
loss on the host right after), and reruns an over-budget step once on the dynamic path.

Capture, CPU: each pure piece of the static region is compiled once by ``torch.compile``
(inductor, ``fullgraph=True``: a graph break is an error, so capture also proves the region
has no host sync) and that compiled code - forward and its AOTAutograd backward - is replayed
every step with no per-op Python dispatch. Why this and not a recorded kernel plan: see
docs/ARCHITECTURE.md "Sync-free MoE and capture/replay". CUDA: moeplug.cuda_graph
(runtime-owned CUDA graphs).
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
        self._overflow: torch.Tensor | None = None

    def wrap(self, fn: Callable) -> Callable:
        """The piece the layer runs: captured with ``runtime.capture``, else eager."""
        return captured(fn) if self.cfg.capture else fn

    def note_overflow(self, flag: torch.Tensor) -> None:
        """OR a layer's device-side over-budget flag into the step's (no host sync)."""
        flag = flag.detach()
        self._overflow = flag if self._overflow is None else self._overflow | flag

    def take_overflow(self) -> torch.Tensor | None:
        """The step's flag so far (None: no static layer ran); resets it."""
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
        if self.cfg.capture:
            how = "torch.compile(fullgraph=True, inductor), compiled once, replayed every step"
        return {"sync_free": bool(self.cfg.sync_free), "token_budget": self.cfg.token_budget,
                "capture": how}
