"""Which parameters are expert-parallel, and how an EP rank's expert shard maps to global experts.

Legend: E experts (global), L experts local to one EP rank (E = EP * L), W EP ranks.

EP rank r holds global experts ``r*L .. (r+1)*L - 1`` as its local experts ``0 .. L-1`` (the
layout both built-in dispatchers assume). Every parameter of an :class:`~moeplug.interfaces.Experts`
module has a leading ``[L]`` dim (the interface's ``gate_up_proj`` [L, 2F, D], ``down_proj``
[L, D, F]); every other parameter is replicated across the EP group.
"""

from __future__ import annotations

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
