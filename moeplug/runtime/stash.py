"""The model's registration with the runtime and the paged stash of the routed experts.

At build the model registers each MoE layer once (:class:`ModelRuntime`); each layer keeps the
:class:`LayerHandle` it got back and uses it every step. With ``runtime.stash`` on, the
experts stage runs under :meth:`LayerHandle.stash_scope`: every per-row activation autograd
saves there (expert inputs, FC1 outputs, activations, routing weights) is copied into a
contiguous run of pages of the runtime's :class:`PagePool` and viewed back, zero-copy, in
backward; the pages return to the pool when autograd releases the saved tensor. Weights (and
anything sharing a parameter's storage) stay with autograd.

A tensor that does not fit is kept by autograd as usual (nothing is lost) and the pool counts an
overflow; the trainer then applies ``runtime.stash_overflow`` (rerun | fail | keep).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from moeplug.runtime.workspace import Arena, Workspace
from moeplug.runtime import get_runtime
from moeplug.runtime.syncfree import SyncFreeState


class StashOverflowError(RuntimeError):
    """The stash pool could not hold a step's activations and the policy is ``fail``: a fault
    that stops training, printed as one line by the CLI (exit 3) as a TrainingFault is, since
    every rank decides it from the same all-reduced count. (Not a TrainingFault subclass: the
    training package imports this module, so this one does not import it.)"""


@dataclass(frozen=True)
class LayerHandle:
    """What one MoE layer got from the runtime at registration."""

    handle: int
    index: int
    stash_pages: int
    streams: tuple[str, ...]
    runtime: "ModelRuntime"
    # The layer's small-buffer arena (moeplug.runtime.workspace.Arena) over the runtime's
    # Workspace, owned by the runtime for the model's life and reused every step;
    # ModelRuntime.workspace_bytes() sums them.
    workspace: Arena = field(default_factory=Arena)

    def stash_scope(self, params: Any) -> contextlib.AbstractContextManager:
        """Saved tensors of the enclosed ops go to the stash (no-op when the stash is off)."""
        if not self.runtime.stash_active:
            return contextlib.nullcontext()
        skip = {p.untyped_storage().data_ptr() for p in params}
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self.runtime.pack(t, skip), _unpack)


class _Stashed:
    """A saved tensor living in pages of the pool; frees them when autograd drops it."""

    __slots__ = ("pool", "first", "count", "view")

    def __init__(self, pool: Any, first: int, count: int, view: torch.Tensor):
        self.pool, self.first, self.count, self.view = pool, first, count, view

    def __del__(self) -> None:
        self.pool.free(self.first, self.count)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.view if isinstance(saved, _Stashed) else saved


def layer_stash_bytes(rows: int, hidden: int, fc1: int, ffn: int, itemsize: int,
                      page_bytes: int) -> int:
    """Bytes one MoE layer stashes per micro-batch at ``rows`` routed rows, page-rounded per
    tensor: expert input [S, D], FC1 output [S, X], activation [S, F], fp32 weights [S]."""
    def pages(n: int) -> int:
        return -(-n // page_bytes) * page_bytes
    return (pages(rows * hidden * itemsize) + pages(rows * fc1 * itemsize)
            + pages(rows * ffn * itemsize) + pages(rows * 4))


class ModelRuntime:
    """The model's registry and (with ``runtime.stash``) its stash pool.

    ``cfg``: the ``runtime:`` config section. The pool is sized after every layer registered:
    ``runtime.stash_pages``, or (0) the sum of the layers' reservations; its memory is made once,
    on the device of the first tensor stashed (the host pool for CPU, one torch buffer on a GPU).
    """

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.registry = get_runtime().Registry(cfg.stash_page_bytes)
        # The model's cache of large CPU buffers (moeplug.runtime.workspace): its MoE layers'
        # arenas take theirs from it, forward and backward; it goes with the model.
        self.workspace = Workspace()
        self.layers: list[dict] = []
        self.handles: list[LayerHandle] = []
        self.pool: Any = None
        self._bytes: torch.Tensor | None = None
        self.stash_active = bool(cfg.stash)
        # Pages the tensors that did not fit would have taken, run total: the trainer's rerun
        # message turns it into the runtime.stash_pages that would have held the step.
        self.overflow_pages = 0
        self.sync_free = SyncFreeState(cfg)  # runtime.sync_free / capture (moeplug.runtime.syncfree)
        # model.offload: the moeplug.modules.offload.Offloader over the second tier (None: off).
        self.offloader: Any = None
        self.offload_modules: list[str] = []

    def register_layer(self, *, index: int, num_experts: int, top_k: int, hidden: int,
                       ffn_hidden: int, num_local_experts: int, dtype: str, activation: str,
                       stash_bytes: int, streams: tuple[str, ...] = ()) -> LayerHandle:
        spec = dict(index=index, num_experts=num_experts, top_k=top_k, hidden=hidden,
                    ffn_hidden=ffn_hidden, num_local_experts=num_local_experts, dtype=dtype,
                    activation=activation, stash_bytes=stash_bytes if self.cfg.stash else 0,
                    streams=list(streams))
        handle, pages = self.registry.register_layer(**spec)
        self.layers.append({**spec, "handle": handle, "stash_pages": pages})
        layer = LayerHandle(handle, index, pages, tuple(streams), self, Arena(self.workspace))
        self.handles.append(layer)
        return layer

    def workspace_bytes(self) -> int:
        """Bytes the registered layers' workspace arenas hold (small buffers, kept resident
        after the first steps; the large ones live in ``self.workspace``)."""
        return sum(h.workspace.nbytes for h in self.handles)

    def finalize(self) -> None:
        """Called once after every layer registered: creates the pool's page table."""
        if self.cfg.stash:
            pages = self.cfg.stash_pages or max(1, self.registry.reserved_pages)
            self.pool = get_runtime().PagePool(self.cfg.stash_page_bytes, pages,
                                               own_memory=False)

    def grow(self, num_pages: int) -> None:
        """A pool of ``num_pages`` from now on (``runtime.stash_pages: 0`` after an overflow).
        Called between steps, when no page is in use; the old pool's memory goes with its last
        reference, and the new one is made on the next tensor stashed."""
        if self.pool.stats()["pages_in_use"]:
            raise RuntimeError("stash: grow() while pages are in use; call it between steps")
        self.pool = get_runtime().PagePool(self.pool.page_bytes, num_pages, own_memory=False)
        self._bytes = None

    def _memory(self, device: torch.device) -> torch.Tensor:
        if self._bytes is None:
            if device.type == "cpu":  # the C++ pool's own aligned host allocation, zero-copy
                self.pool = get_runtime().PagePool(self.pool.page_bytes, self.pool.num_pages)
                self._bytes = torch.frombuffer(self.pool, dtype=torch.uint8)
            else:
                self._bytes = torch.empty(self.pool.size_bytes, dtype=torch.uint8,
                                          device=device)
        return self._bytes

    def pack(self, t: torch.Tensor, skip: set[int]) -> Any:
        # Weights and odd layouts stay with autograd; any contiguous activation is bytes in
        # pages (a GPU's budget rows save [L, B, .] blocks for their batched GEMMs).
        if (t.dim() == 0 or t.numel() == 0 or not t.is_contiguous()
                or t.untyped_storage().data_ptr() in skip):
            return t
        memory = self._memory(t.device)
        if memory.device != t.device:
            return t
        n = t.numel() * t.element_size()
        first, count = self.pool.alloc(n)
        if first < 0:  # overflow: counted by the pool, the tensor is kept (nothing lost)
            self.overflow_pages += -(-n // self.pool.page_bytes)
            return t
        off = first * self.pool.page_bytes
        view = memory[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        return _Stashed(self.pool, first, count, view)

    @contextlib.contextmanager
    def stash_disabled(self) -> Iterator[None]:
        """Runs the enclosed steps without the stash (the overflow rerun)."""
        was, self.stash_active = self.stash_active, False
        try:
            yield
        finally:
            self.stash_active = was

    def stats(self) -> dict | None:
        """Pool statistics for train records (None when the stash is off)."""
        return None if self.pool is None else dict(self.pool.stats())

    def record(self) -> dict:
        """What the run record lists: the stash settings and every registered layer."""
        pool = None if self.pool is None else {"page_bytes": self.pool.page_bytes,
                                               "num_pages": self.pool.num_pages}
        offload = None if self.offloader is None else {
            # by device: a CPU tensor's to the file, a GPU's to pinned host memory
            "modules": self.offload_modules, "tier": dict(self.offloader.TIERS),
            "dir": self.offloader.directory,
            "page_bytes": self.offloader.page_bytes}
        return {"stash": bool(self.cfg.stash), "stash_overflow": self.cfg.stash_overflow,
                "pool": pool, "layers": self.layers, "offload": offload,
                **self.sync_free.record()}
