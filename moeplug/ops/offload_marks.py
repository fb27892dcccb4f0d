"""Where an op says which of its saved tensors Megatron's offload names mean (``expert_fc1``:
the experts' FC1 input, ``moe_act``: the activation's input). moeplug.modules.offload reads
the marks; this module is the ground both import, so ops never import the offload machinery."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

# The offload scope of the module call running now (moeplug.modules.offload._Scope) or None.
SCOPE: ContextVar[Any] = ContextVar("moeplug_offload_scope", default=None)


def storage_key(t: torch.Tensor) -> int:
    """What names ``t``'s storage while it lives: its address, or for a meta tensor (which has
    none: every one reads 0) the storage object's identity."""
    storage = t.untyped_storage()
    return id(storage) if t.device.type == "meta" else storage.data_ptr()


def note(name: str, t: torch.Tensor) -> None:
    """``t`` is what ``name`` means in this op; it leaves memory when that name is offloaded in
    the current module call (a no-op outside any offload scope)."""
    scope = SCOPE.get()
    if scope is not None and name in scope.names:
        scope.allowed.add(storage_key(t))
