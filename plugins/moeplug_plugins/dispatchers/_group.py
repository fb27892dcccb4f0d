"""Expert-parallel group facts shared by the dispatchers."""

from __future__ import annotations

import torch.distributed as dist

from moeplug.api import ConfigError, ModelConfig

def ep_layout(model: ModelConfig, group) -> tuple[int, int, int]:
    """(ep_size, ep_rank, num_local_experts) for ``group`` (None = one process)."""
    ep_size = 1 if group is None else dist.get_world_size(group)
    ep_rank = 0 if group is None else dist.get_rank(group)
    num_experts = model.moe.num_experts
    if num_experts % ep_size:
        raise ConfigError(f"MoEConfig.num_experts = {num_experts}: not divisible by the expert-parallel "
                          f"size ({ep_size}). Fix: choose num_experts a multiple of {ep_size}")
    return ep_size, ep_rank, num_experts // ep_size
