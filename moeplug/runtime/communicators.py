"""Which communicators the runtime can own on this machine, each with the reason when it cannot:
the one-machine shared-memory heap (moeplug.parallel.shm_heap), and on GPU the NCCL communicator
(torch's, through torch.distributed) and NVSHMEM. The GPU libraries are looked up, never
imported here (importing NVSHMEM initialises it); ``moeplug --version`` prints this."""

from __future__ import annotations

import importlib.util
import os
import sys


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def shm_heap_status(core) -> str:
    if not sys.platform.startswith("linux"):
        return f"unavailable: needs Linux POSIX shared memory, this is {sys.platform}"
    if core is None or not hasattr(core, "ShmHeap"):
        return "unavailable: the runtime core was built without it (rebuild: pip install -e .)"
    if not os.access("/dev/shm", os.W_OK):
        return "unavailable: /dev/shm is not writable"
    return "available (direct_write dispatcher; ranks of one machine)"


def nccl_status() -> str:
    import torch
    import torch.distributed as dist
    if not torch.cuda.is_available():
        return "unavailable: torch sees no GPU"
    if not dist.is_nccl_available():
        return "unavailable: this torch build has no NCCL backend"
    return f"available (torch's, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"


def nvshmem_status() -> str:
    import torch
    for module in ("nvshmem", "nvshmem4py"):
        if _module_found(module):
            if not torch.cuda.is_available():
                return f"unavailable: module {module} is installed but torch sees no GPU"
            return f"installed ({module}; imported when a GPU transport first needs it)"
    return ("unavailable: NVIDIA's nvshmem Python module is not installed; no moeplug transport "
            "uses it yet")


def communicator_status(core) -> dict[str, str]:
    """{"shm_heap": ..., "nccl": ..., "nvshmem": ...}: "available ..." or "unavailable: why"."""
    return {"shm_heap": shm_heap_status(core), "nccl": nccl_status(),
            "nvshmem": nvshmem_status()}
