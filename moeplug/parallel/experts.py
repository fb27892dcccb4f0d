"""Which parameters are expert-parallel, and how an EP rank's expert shard maps to global experts.

Legend: E experts (global), L experts local to one EP rank (E = EP * L), W EP ranks.

EP rank r holds global experts ``r*L .. (r+1)*L - 1`` as its local experts ``0 .. L-1`` (the
layout both built-in dispatchers assume). Every parameter of an :class:`~moeplug.interfaces.Experts`
module has a leading ``[L]`` dim (the interface's ``gate_up_proj`` [L, 2F, D], ``down_proj``
[L, D, F]); every other parameter is replicated across the EP group.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from moeplug.interfaces import Experts


def expert_param_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of parameters owned by an Experts module."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, Experts):
            names.update(f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters())
    return names


def local_expert_ids(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global ids of the experts EP rank ``ep_rank`` holds, in local order."""
    if num_experts % ep_size:
        raise ValueError(f"num_experts = {num_experts} is not divisible by the EP size {ep_size}. "
                         f"Fix: choose num_experts a multiple of {ep_size}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank = {ep_rank} is outside the EP group of size {ep_size}. "
                         "Fix: pass the rank inside the EP group (dist.get_rank(ep_group))")
    L = num_experts // ep_size
    return range(ep_rank * L, (ep_rank + 1) * L)


@torch.no_grad()
def load_expert_shard(model: nn.Module, full_state: Mapping[str, torch.Tensor], ep_rank: int,
                      ep_size: int) -> None:
    """Copy a single-process state dict (all E experts) into an EP rank's ``model``.

    Expert parameters take global experts ``ep_rank*L .. (ep_rank+1)*L - 1`` (rows of dim 0);
    every other parameter is copied whole. Buffers are left alone (they are derived, e.g. RoPE).
    """
    expert_names = expert_param_names(model)
    for name, p in model.named_parameters():
        if name not in full_state:
            raise KeyError(f"load_expert_shard: parameter '{name}' is missing from the source "
                           "state dict. Fix: pass the state_dict of a model built from the same "
                           "config at EP size 1")
        src = full_state[name]
        if name in expert_names:
            L = p.shape[0]
            ids = local_expert_ids(src.shape[0], ep_size, ep_rank)
            if len(ids) != L:
                raise ValueError(f"load_expert_shard: '{name}' holds {L} local experts here but "
                                 f"the source has {src.shape[0]} experts / EP {ep_size} = "
                                 f"{len(ids)}. Fix: build this model with ep_size {ep_size} and "
                                 "the same num_experts as the source")
            src = src[ids.start:ids.stop]
        if src.shape != p.shape:
            raise ValueError(f"load_expert_shard: '{name}' has shape {tuple(p.shape)} here but "
                             f"{tuple(src.shape)} in the source. Fix: build both models from the "
                             "same ModelConfig")
        p.copy_(src)
