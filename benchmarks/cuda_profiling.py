"""What the GPU profile scripts (profile_cuda_moe_layer.py, profile_cuda_train_step.py) share:
the check that a GPU is there, torch's host-sync detector around one call, and the kernel table
of a torch profile."""

from __future__ import annotations

import collections
import warnings
from typing import Callable

import torch


def require_gpu(script: str) -> None:
    """Exit with a message on stderr (status 1), not a traceback from torch's lazy CUDA init,
    where torch sees no GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU, and torch sees none "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False). "
                         f"Run it on a GPU machine: docs/gpu_checks.sh runs it with PROFILE=1")


def host_syncs(step: Callable[[], object]) -> collections.Counter:
    """The host syncs of one ``step()`` by source line (torch's sync detector, one warning per
    sync), after the device has drained."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch's own notice that the detector is a prototype comes as a warning too: not a sync.
    return collections.Counter(f"{w.filename}:{w.lineno}" for w in caught
                               if "prototype feature" not in str(w.message))


def print_host_syncs(name: str, what: str, step: Callable[[], object]) -> None:
    where = host_syncs(step)
    print(f"==== {name}: {sum(where.values())} host syncs in {what}")
    for line, n in where.most_common():
        print(f"  {n} x {line}")


def print_kernel_table(prof, rows: int, width: int = 70) -> None:
    """Kernels and ops sorted by their own device time (the sort key's name moved in torch)."""
    keys = prof.key_averages()
    for sort in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(keys.table(sort_by=sort, row_limit=rows, max_name_column_width=width))
            return
        except (AttributeError, KeyError, ValueError):
            continue
