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
(benchmarks/test_bench_stash.py counts them); smaller bookkeeping tensors still go to torch.
"""

from __future__ import annotations

import math
import threading

import torch

MIN_BYTES = 256 << 10
MAX_CACHED_BYTES = 8 << 30

_lock = threading.Lock()
_cache: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
_cached_bytes = 0


def _is_free(buf: torch.Tensor) -> bool:
    # Two references: the cache's own tensor and the temporary storage object made here.
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.empty(shape, dtype=dtype)`` on CPU (contents undefined)."""
    global _cached_bytes
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    key = (numel, dtype)
    with _lock:
        for buf in _cache.get(key, ()):
            if _is_free(buf):
                return buf.view(shape)
        buf = torch.empty(numel, dtype=dtype)
        if _cached_bytes + nbytes <= MAX_CACHED_BYTES:
            _cache.setdefault(key, []).append(buf)
            _cached_bytes += nbytes
        return buf.view(shape)


def clear() -> None:
    """Forget every cached buffer (live tensors keep theirs)."""
    global _cached_bytes
    with _lock:
        _cache.clear()
        _cached_bytes = 0


def cached_bytes() -> int:
    return _cached_bytes
