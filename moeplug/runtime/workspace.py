"""A small cache of large CPU activation buffers, reused across steps.

Why: glibc returns every freed block over 32 MB to the kernel, so each fresh [S, 2F] activation
is page-faulted back in, 4 KB at a time. At the standard expert shape that is ~0.6 s of faults
per fwd+bwd next to ~2.5 s of GEMMs. Like a CUDA caching allocator, this keeps freed buffers
mapped and hands them out again.

A cached buffer is free when no tensor other than the cache shares its storage (the storage's
reference count says so), so a buffer still held by autograd, a caller or a view is never
reused. Only buffers of at least ``MIN_BYTES`` are cached; ``clear()`` drops them all.
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

_lock = threading.Lock()
# size class in bytes -> buffers (uint8; handed out as a typed view of their first bytes)
_cache: dict[int, list[torch.Tensor]] = {}
_cached_bytes = 0
_high_water = 0  # the most bytes the cache's buffers held live at once (since clear())
_misses = 0  # requests that allocated (since clear())
_bypassed = 0
_arena: ContextVar["Arena | None"] = ContextVar("moeplug_workspace_arena", default=None)


_storage_use_count = torch._C._storage_Use_Count


def _is_free(buf: torch.Tensor) -> bool:
    # Two references: the cache's own tensor and the temporary storage object made here.
    return _storage_use_count(buf.untyped_storage()._cdata) <= 2


def free_cached() -> list[torch.Tensor]:
    """The shared cache's buffers that ``empty`` would hand out now (whole, as bytes)."""
    with _lock:
        return [buf for bufs in _cache.values() for buf in bufs if _is_free(buf)]


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


def _drop_free(nbytes: int) -> None:
    """Forget free buffers, size class by size class in the order the classes were first
    cached, until ``nbytes`` more fit under the high-water mark plus SLACK (or none is left).
    Called with the lock held, on a miss, before allocating."""
    global _cached_bytes, _high_water
    live = sum(key for key, bufs in _cache.items() for buf in bufs if not _is_free(buf))
    _high_water = max(_high_water, live + nbytes)
    limit = _high_water * SLACK
    for key in list(_cache):
        if _cached_bytes + nbytes <= limit:
            return
        keep = []
        for buf in _cache[key]:
            if _cached_bytes + nbytes > limit and _is_free(buf):
                _cached_bytes -= key
            else:
                keep.append(buf)
        if keep:
            _cache[key] = keep
        else:
            del _cache[key]


def number(value: float, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 0-d :func:`empty` buffer of ``dtype``: where an op given a Python number
    would wrap it in a fresh tensor each call. IEEE operations on the same operands give the
    same results either way."""
    return empty((), dtype).fill_(value)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.empty(shape, dtype=dtype)`` on CPU (contents undefined)."""
    global _cached_bytes, _misses
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if _bypassed:
        return torch.empty(shape, dtype=dtype)
    if nbytes < MIN_BYTES:
        arena = _arena.get()
        return torch.empty(shape, dtype=dtype) if arena is None else arena.empty(shape, dtype)
    key = size_class(nbytes)
    with _lock:
        # The smallest free buffer that fits, up to MAX_OVERSIZE over (a row count that
        # changes per layer and step lands here instead of allocating).
        for size in sorted(k for k in _cache if key <= k <= key * MAX_OVERSIZE):
            for buf in _cache[size]:
                if _is_free(buf):
                    return _prefix(buf.view(dtype), shape)
        _drop_free(key)
        _misses += 1
        buf = torch.empty(key, dtype=torch.uint8)
        if _cached_bytes + key <= MAX_CACHED_BYTES:
            _cache.setdefault(key, []).append(buf)
            _cached_bytes += key
        return _prefix(buf.view(dtype), shape)


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
    """In this scope ``empty`` is plain ``torch.empty`` (the cache is neither read nor filled)."""
    global _bypassed
    _bypassed += 1
    try:
        yield
    finally:
        _bypassed -= 1


def clear() -> None:
    """Forget every cached buffer (live tensors keep theirs)."""
    global _cached_bytes, _high_water, _misses
    with _lock:
        _cache.clear()
        _cached_bytes = _high_water = _misses = 0


def cached_bytes() -> int:
    return _cached_bytes


def misses() -> int:
    """Requests of at least MIN_BYTES that found no free buffer and allocated (since clear())."""
    return _misses


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

    def __init__(self) -> None:
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
