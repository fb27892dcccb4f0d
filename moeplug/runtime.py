"""Loads the C++ runtime core (``moeplug._runtime_core``) and says how to rebuild it when missing.

Importing moeplug never needs the extension; the first op that does calls :func:`get_runtime`.
There is deliberately no slow pure-Python fallback: a broken build should fail loudly, once,
with the command that fixes it, rather than silently train 10x slower.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

import torch

REBUILD_COMMAND = "pip install -e . --no-build-isolation   (or: pip install -e .)"

# dtype codes understood by the C++ kernels (runtime_cpp/include/moeplug/dtype.h).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class RuntimeMissingError(ImportError):
    """The compiled extension ``moeplug._runtime_core`` could not be imported."""


_lock = threading.Lock()
_core: ModuleType | None = None
_failure: RuntimeMissingError | None = None


def get_runtime() -> ModuleType:
    """The imported extension, with its worker pool sized to ``torch.get_num_threads()``."""
    global _core, _failure
    if _core is not None:
        return _core
    with _lock:
        if _core is not None:
            return _core
        if _failure is not None:  # already diagnosed: re-raise the same error, no retry spam
            raise _failure
        try:
            core = importlib.import_module("moeplug._runtime_core")
        except ImportError as exc:
            _failure = RuntimeMissingError(
                f"moeplug's C++ runtime core (moeplug._runtime_core) is not importable: {exc}. "
                f"Fix: rebuild it from the repository root with `{REBUILD_COMMAND}`")
            raise _failure from exc
        # The pool and torch's intra-op threads take turns (kernels run between GEMMs), so the
        # same count uses every core without oversubscribing.
        core.set_num_threads(max(1, torch.get_num_threads()))
        _core = core
        return core


def runtime_available() -> bool:
    try:
        get_runtime()
    except RuntimeMissingError:
        return False
    return True


def runtime_info() -> dict[str, Any]:
    """What ``moeplug --version`` prints about the runtime core."""
    try:
        info = dict(get_runtime().build_info())
    except RuntimeMissingError as exc:
        return {"available": False, "error": str(exc)}
    info["available"] = True
    return info


def dtype_code(t: torch.Tensor, op: str, name: str) -> int:
    """The kernel dtype code of ``t``; errors name the op, the argument and the fix."""
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; the runtime kernels take float32 or "
                        f"bfloat16. Fix: cast with {name}.float() or {name}.bfloat16()")
    return code


__all__ = ["RuntimeMissingError", "REBUILD_COMMAND", "get_runtime", "runtime_available",
           "runtime_info", "dtype_code"]
