"""The model runtime's buffers: a cache of large CPU activation buffers reused across steps
(:class:`Workspace`, one per ``moeplug.runtime.stash.ModelRuntime``, no process-wide cache), and
each MoE layer's :class:`Arena` of small ones, which reaches its model's workspace
(``Arena.cache``). Ops call :func:`empty`: the running layer's arena and workspace hand out the
buffer; outside any layer (no arena in scope) it is torch's.

Why: glibc returns every freed block over 32 MB to the kernel, so each fresh [S, 2F] activation
is page-faulted back in, 4 KB at a time. At the standard expert shape that is ~0.6 s of faults
per fwd+bwd next to ~2.5 s of GEMMs. Like a CUDA caching allocator, this keeps freed buffers
mapped and hands them out again.

A cached buffer is free when no tensor other than the cache shares its storage (the storage's
reference count says so), so a buffer still held by autograd, a caller or a view is never
reused. Only buffers of at least ``MIN_BYTES`` are cached; ``Workspace.clear()`` drops them all.
``MIN_BYTES`` is well below glibc's 32 MB threshold on purpose: every activation-sized buffer of
the MoE path (expert inputs, FC1 outputs and their grads, weight grads) then comes from the cache
after warm-up, so a steady-state step makes no activation allocations there
(benchmarks/test_bench_stash.py counts them); smaller ones come from the running layer's
arena (below).

The cache's footprint never exceeds 3/2 of the most bytes its buffers ever held live at once
(its high-water mark, like the reserve a CUDA caching allocator keeps). Keyed by exact size, it
used to keep every buffer a step had freed, of every size, until ``clear()``: with row counts
that change per layer and step (one expert's scratch, an EP rank's received rows) it held tens
of MB of free buffers next to the step's live tensors (+30 MB, +19 %, at the ``moeplug plan``
CPU matrix's full-recompute layout), and under EP it grew every step (107 -> 507 MB over six
steps of the matrix's EP2 run; only MAX_CACHED_BYTES stopped it). So (1) sizes are rounded up
to one of eight classes per power of two (at most 1/8 over), (2) a request takes the smallest
free buffer of its class or up to MAX_OVERSIZE larger, and (3) a miss drops free buffers,
oldest size class first, only as far as it must to stay within the high-water mark (plus SLACK,
1/2). (3) once dropped at least as many free bytes as every miss allocated: that also bounded
the footprint, but in a steady state it dropped buffers the same step needed later (a forward's
miss dropped the freed weight-gradient buffers, whose misses in backward dropped the
forward's), so every step reallocated ~600 MB and page-faulted it back in (the bf16 MoE layer
at the standard shape: 0.62 of the square matmul, 0.81 with the same pages kept, glibc's policy
aside).

``bypassed()`` turns the cache and the arenas off in its scope (the plan's calibration traces
every buffer's real lifetime through torch's allocator, moeplug.plan.calibrate_cpu).

Smaller buffers (row maps, counts, routing weights, router logits and their grads, aux-loss
scalars) come from the :class:`Arena` of the MoE layer that is running, when one is active
(:func:`arena_scope`; each MoELayer enters its own, the one its runtime registration gave it):
a per-layer set of power-of-two size classes, reused once free by the same reference-count rule.
Per layer, not global, so its resident bytes are attributable (``Arena.nbytes``) and bounded by
what one layer's step needs; outside any arena they go to torch as before. Autograd Functions
record the arena in ``ctx`` during forward and re-enter it in backward (:func:`ctx_arena`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

MIN_BYTES = 256 << 10
MAX_CACHED_BYTES = 8 << 30
SIZE_CLASSES_PER_DOUBLING = 8
MAX_OVERSIZE = 1.5
# The footprint may pass the high-water mark by a half: a buffer serves requests up to
# MAX_OVERSIZE smaller and of other shapes (a [S, 2F] bf16 activation and an [L, D, F] fp32
# weight gradient are the same bytes at the standard shape), so one step's pattern can need
# more than its live peak. Measured steady-state misses a step: with no slack the
# standard-shape layer 5 (each one page-faulted afresh), with 1/8 none there but 5 in the
# default config's bf16 run at micro-batch 4, with 1/4 none in either — until the one grouped
# expert FFN (moeplug.ops.grouped_ffn) allocated its forward's and its backward's buffers in
# other size classes, live at different times: at 1/4 that run again missed 5 a step (its
# y/h/a buffers, dX, dh and the zeroed weight grads, 2 MB reallocated every step), at 1/2 none
# (tests/test_kernels.py).
SLACK = 1.5

_arena: ContextVar["Arena | None"] = ContextVar("moeplug_workspace_arena", default=None)
_bypassed: ContextVar[int] = ContextVar("moeplug_workspace_bypassed", default=0)
# Every live Workspace, weakly: for the process-level reads below (clear, cached_bytes, misses),
# never for handing out buffers. A workspace lives as long as its model runtime.
_live: "weakref.WeakSet[Workspace]" = weakref.WeakSet()

# A buffer is free when the cache holds the only reference to its storage. Tensors, views and
# autograd's saved tensors share a storage through its C++ intrusive reference count, which torch
# exposes only privately: sys.getrefcount of the Python storage object counts Python references
# (one object per call), not them. So the private call stays, in this one place.
_storage_use_count = torch._C._storage_Use_Count


def _is_free(buf: torch.Tensor) -> bool:
    # Two references: the cache's own tensor and the temporary storage object made here.
    return _storage_use_count(buf.untyped_storage()._cdata) <= 2


@functools.lru_cache(maxsize=1024)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _prefix(buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf[:numel].view(shape)`` (``buf`` 1-D, contiguous, at offset 0) as one view op: the
    slice and the view took 4.6 us a call against 1.2 us (torch.empty: 2.5 us), and a MoE
    layer takes a few dozen small buffers a step."""
    return buf.as_strided(shape, _contiguous_strides(tuple(shape)))


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to the next of SIZE_CLASSES_PER_DOUBLING steps per power of two."""
    step = max(1, (1 << (max(nbytes, 1) - 1).bit_length()) // (2 * SIZE_CLASSES_PER_DOUBLING))
    return -(-nbytes // step) * step


class Workspace:
    """One model runtime's cache of large CPU buffers (``ModelRuntime.workspace``; the module
    docstring says how it is bounded). Its MoE layers reach it through their arenas
    (``Arena.cache``), forward and backward; code outside any arena gets torch's buffers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # size class in bytes -> buffers (uint8; handed out as a typed view of their first bytes)
        self._cache: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._high_water = 0  # the most bytes the cache's buffers held live at once (since clear)
        self._misses = 0  # requests that allocated (since clear)
        _live.add(self)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of at least MIN_BYTES (the caller checked), reused once free."""
        key = size_class(math.prod(shape) * dtype.itemsize)
        with self._lock:
            # The smallest free buffer that fits, up to MAX_OVERSIZE over (a row count that
            # changes per layer and step lands here instead of allocating).
            for size in sorted(k for k in self._cache if key <= k <= key * MAX_OVERSIZE):
                for buf in self._cache[size]:
                    if _is_free(buf):
                        return _prefix(buf.view(dtype), shape)
            self._drop_free(key)
            self._misses += 1
            buf = torch.empty(key, dtype=torch.uint8)
            if self._cached_bytes + key <= MAX_CACHED_BYTES:
                self._cache.setdefault(key, []).append(buf)
                self._cached_bytes += key
            return _prefix(buf.view(dtype), shape)

    def _drop_free(self, nbytes: int) -> None:
        """Forget free buffers, size class by size class in the order the classes were first
        cached, until ``nbytes`` more fit under the high-water mark plus SLACK (or none is left).
        Called with the lock held, on a miss, before allocating."""
        live = sum(key for key, bufs in self._cache.items() for buf in bufs if not _is_free(buf))
        self._high_water = max(self._high_water, live + nbytes)
        limit = self._high_water * SLACK
        for key in list(self._cache):
            if self._cached_bytes + nbytes <= limit:
                return
            keep = []
            for buf in self._cache[key]:
                if self._cached_bytes + nbytes > limit and _is_free(buf):
                    self._cached_bytes -= key
                else:
                    keep.append(buf)
            if keep:
                self._cache[key] = keep
            else:
                del self._cache[key]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the cache holds (free or not, whole, as bytes)."""
        with self._lock:
            return [buf for bufs in self._cache.values() for buf in bufs]

    def free_cached(self) -> list[torch.Tensor]:
        """The buffers ``empty`` would hand out now (whole, as bytes)."""
        return [buf for buf in self.buffers() if _is_free(buf)]

    def clear(self) -> None:
        """Forget every cached buffer (live tensors keep theirs)."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = self._high_water = self._misses = 0

    def cached_bytes(self) -> int:
        return self._cached_bytes

    def misses(self) -> int:
        """Requests that found no free buffer and allocated (since clear())."""
        return self._misses

    def scope(self) -> contextlib.AbstractContextManager:
        """The enclosed ops take their buffers here, small ones from a fresh arena (ops run
        outside any MoE layer: tests, benchmarks)."""
        return arena_scope(Arena(self))


def number(value: float, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 0-d :func:`empty` buffer of ``dtype``: where an op given a Python number
    would wrap it in a fresh tensor each call. IEEE operations on the same operands give the
    same results either way."""
    return empty((), dtype).fill_(value)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.empty(shape, dtype=dtype)`` on CPU (contents undefined): from the running
    layer's arena (small) or its model runtime's workspace (from MIN_BYTES), else torch's."""
    arena = _arena.get()
    if arena is None or _bypassed.get():
        return torch.empty(shape, dtype=dtype)
    if math.prod(shape) * dtype.itemsize < MIN_BYTES:
        return arena.empty(shape, dtype)
    if arena.cache is None:
        return torch.empty(shape, dtype=dtype)
    return arena.cache.empty(shape, dtype)


# What ops that take "an empty" call for a buffer: ``empty`` itself, or :func:`allocator`'s.
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def allocator(device: torch.device) -> Empty:
    """``empty`` for CPU tensors, torch's own allocator on ``device`` otherwise: for ops that
    run on every device and take their buffers from the workspace where there is one."""
    if device.type == "cpu":
        return empty
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """In this scope ``empty`` is plain ``torch.empty`` (no cache or arena is read or filled)."""
    token = _bypassed.set(_bypassed.get() + 1)
    try:
        yield
    finally:
        _bypassed.reset(token)


# Process-level reads over every live model runtime's workspace (the plan's measurements and
# the tests read them around whole runs; each workspace still belongs to one model runtime).
def clear() -> None:
    """Forget every cached buffer of every live workspace (live tensors keep theirs)."""
    for ws in list(_live):
        ws.clear()


def cached_bytes() -> int:
    return sum(ws.cached_bytes() for ws in list(_live))


def misses() -> int:
    """Requests of at least MIN_BYTES that found no free buffer and allocated (since clear())."""
    return sum(ws.misses() for ws in list(_live))


def cached_buffers() -> list[torch.Tensor]:
    """Every buffer every live workspace holds (free or not)."""
    return [buf for ws in list(_live) for buf in ws.buffers()]


def free_cached() -> list[torch.Tensor]:
    """The buffers the live workspaces would hand out now (whole, as bytes)."""
    return [buf for ws in list(_live) for buf in ws.free_cached()]


class Arena:
    """One MoE layer's small buffers: power-of-two size classes (at least 64 bytes), each a list
    of buffers handed out as prefix views once free (no tensor but the arena's shares the
    storage). Sizes that vary step to step (per-expert row counts) land in the same class, so
    after warm-up a step allocates nothing here. At most ``MAX_PER_CLASS`` buffers per class are
    kept (a caller that hoards results gets fresh, uncached tensors instead of growing it).

    Each buffer is kept with its storage's Python object: torch returns that same object for
    the storage while it lives, so the free check reads its reference count without making
    one (the cache's tensor and that object: 2 when free, as in ``_is_free``). A buffer handed
    out moves to the end of its class's list, so the search starts at the buffer handed out
    longest ago: in a step that takes a class's buffers in turn, each is found first."""

    MAX_PER_CLASS = 16

    def __init__(self, cache: Workspace | None = None) -> None:
        # Where this layer's large buffers come from: its model runtime's workspace (None:
        # torch's allocator).
        self.cache = cache
        self._lock = threading.Lock()
        self._classes: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}
        self.nbytes = 0  # bytes the arena holds (resident for the life of the layer)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        size = max(64, 1 << max(0, numel * dtype.itemsize - 1).bit_length())
        key = (size, dtype)
        with self._lock:
            bufs = self._classes.setdefault(key, [])
            for i, entry in enumerate(bufs):
                if _storage_use_count(entry[1]._cdata) <= 2:
                    if i + 1 < len(bufs):
                        bufs.append(bufs.pop(i))
                    return _prefix(entry[0], shape)
            buf = torch.empty(size // dtype.itemsize, dtype=dtype)
            if len(bufs) < self.MAX_PER_CLASS:
                bufs.append((buf, buf.untyped_storage()))
                self.nbytes += size
            return _prefix(buf, shape)

    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers ``empty`` would hand out now (whole, not as views)."""
        with self._lock:
            return [buf for bufs in self._classes.values() for buf, storage in bufs
                    if _storage_use_count(storage._cdata) <= 2]


@contextlib.contextmanager
def arena_scope(arena: Arena | None) -> Iterator[None]:
    """Small :func:`empty` buffers of the enclosed code come from ``arena`` (None: from torch)."""
    token = _arena.set(arena)
    try:
        yield
    finally:
        _arena.reset(token)


def current_arena() -> Arena | None:
    return _arena.get()


def ctx_arena(ctx: Any) -> contextlib.AbstractContextManager:
    """In an autograd Function's backward: the arena its forward ran in (``ctx.arena``, set by
    ``ctx.arena = current_arena()`` in forward), so backward's buffers come from the same layer."""
    return arena_scope(getattr(ctx, "arena", None))
