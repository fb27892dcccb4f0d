"""Multi-rank parallelism: layout math (no torch.distributed), process groups, collectives."""

from moeplug.parallel.experts import expert_param_names, local_expert_ids
from moeplug.parallel.grad_sync import clip_grad_norm, global_grad_norm, sync_gradients
from moeplug.parallel.groups import ParallelGroups
from moeplug.parallel.layout import (GROUP_KINDS, ParallelConfig, layout_rank_groups, rank_groups,
                                     validate_model)
from moeplug.parallel.sharding import load_expert_shard

__all__ = ["GROUP_KINDS", "ParallelConfig", "ParallelGroups", "clip_grad_norm", "expert_param_names",
           "global_grad_norm", "layout_rank_groups", "load_expert_shard", "local_expert_ids",
           "rank_groups", "sync_gradients", "validate_model"]
