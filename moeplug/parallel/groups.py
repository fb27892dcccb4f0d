"""torch.distributed process groups for a :class:`ParallelConfig`, built once and passed explicitly.

There is no global registry: :meth:`ParallelGroups.build` returns an object that the trainer hands
to the modules that communicate (a dispatcher gets ``groups.ep``, attention gets ``groups.tp``...).
A group is ``None`` when its size is 1, so callers (and :mod:`moeplug.parallel.comm`) take their
single-process fast path without a special case.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist

from moeplug.config import ConfigError
from moeplug.parallel import comm
from moeplug.parallel.layout import GROUP_KINDS, ParallelConfig, layout_rank_groups


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    """This rank's process group of every kind in ``GROUP_KINDS`` (None when of size 1).

    ``members[kind]`` holds the global ranks of this rank's group of that kind, in group-rank
    order, so ``size(kind)`` and ``rank_in(kind)`` need no communication.
    """

    config: ParallelConfig  # resolved: dp and edp filled
    rank: int
    world_size: int
    members: Mapping[str, tuple[int, ...]]
    tp: Any = None
    cp: Any = None
    dp: Any = None
    pp: Any = None
    tp_cp: Any = None
    dp_cp: Any = None
    tp_dp_cp: Any = None
    ep: Any = None
    etp: Any = None
    edp: Any = None
    ep_etp: Any = None
    # With parallel.overlap_moe_expert_parallel_comm: group -> its twin (same ranks, its own
    # gloo/NCCL context), used by the overlapped backward's thread (moeplug.parallel.ep_overlap).
    twins: Mapping[Any, Any] | None = None

    @classmethod
    def build(cls, pcfg: ParallelConfig, world_size: int, rank: int,
              timeout: timedelta | None = None) -> "ParallelGroups":
        """Validate ``pcfg`` for ``world_size`` and create every group.

        Collective: ``dist.new_group`` must be called by every rank for every group in the same
        order, so all ranks walk the same tables in the same order and keep only their own group.
        """
        resolved = pcfg.resolve(world_size)  # raises ConfigError before any group exists
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}. "
                              "Fix: pass dist.get_rank() and dist.get_world_size()")
        tables = layout_rank_groups(resolved)
        members = {kind: next(tuple(g) for g in groups if rank in g)
                   for kind, groups in tables.items()}
        if world_size == 1 and not dist.is_initialized():
            return cls(config=resolved, rank=rank, world_size=1, members=members)
        if not dist.is_initialized():
            raise ConfigError(f"world size {world_size} > 1 but torch.distributed is not "
                              "initialised. Fix: call dist.init_process_group first (or use "
                              "moeplug.testing.distributed.run_distributed in tests)")
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise ConfigError(f"ParallelGroups.build(world_size={world_size}, rank={rank}) does "
                              f"not match the process group (world size {dist.get_world_size()}, "
                              f"rank {dist.get_rank()}). Fix: pass dist.get_world_size() and "
                              "dist.get_rank()")
        handles: dict[str, Any] = {}
        for kind in GROUP_KINDS:  # fixed order on every rank
            groups = tables[kind]
            if len(groups[0]) == 1:
                handles[kind] = None  # every group of this kind has size 1: nothing to create
                continue
            for ranks in groups:
                g = dist.new_group(ranks=ranks, timeout=timeout)
                if rank in ranks:
                    handles[kind] = g
        twins = None
        if resolved.overlap_moe_expert_parallel_comm:
            # A second walk over the same tables, after the first on every rank: same order.
            twins = {}
            for kind in GROUP_KINDS:
                groups = tables[kind]
                if len(groups[0]) == 1:
                    continue
                for ranks in groups:
                    g = dist.new_group(ranks=ranks, timeout=timeout)
                    if rank in ranks:
                        twins[handles[kind]] = g
                        comm.register_twin(handles[kind], g)
        return cls(config=resolved, rank=rank, world_size=world_size, members=members,
                   twins=twins, **handles)

    def group(self, kind: str) -> Any:
        if kind not in GROUP_KINDS:
            raise KeyError(f"unknown group kind {kind!r}; known: {', '.join(GROUP_KINDS)}")
        return getattr(self, kind)

    def size(self, kind: str) -> int:
        self.group(kind)  # validates the name
        return len(self.members[kind])

    def rank_in(self, kind: str) -> int:
        """This rank's index inside its group of ``kind``."""
        self.group(kind)
        return self.members[kind].index(self.rank)
