"""Multi-rank parallelism: layout math (no torch.distributed), process groups, collectives."""

from moeplug.parallel.groups import ParallelGroups
from moeplug.parallel.layout import (GROUP_KINDS, ParallelConfig, layout_rank_groups, rank_groups,
                                     validate_model)

__all__ = ["GROUP_KINDS", "ParallelConfig", "ParallelGroups", "layout_rank_groups", "rank_groups",
           "validate_model"]
