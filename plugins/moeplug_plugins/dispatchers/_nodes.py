"""Which node each rank of the expert-parallel group sits on, and the two subgroups of that split.

Legend: W ranks in the EP group, N nodes, n EP ranks per node (W = N * n).

EP rank r is rank ``r % n`` of node ``r // n``: the nodes hold consecutive EP ranks, so the
experts of one node are a contiguous range (node b owns global experts ``b*n*L .. (b+1)*n*L-1``).
Two subgroups come out of the split:
    intra  the n EP ranks of my node (the fan-out to the experts' owners: moeplug_plugins.
           dispatchers.intra_node)
    inter  the N EP ranks with my local index, one per node (the network hop); group rank = node
``n`` comes from the launcher (``$LOCAL_WORLD_SIZE`` processes per node, EP members grouped by
``global rank // LOCAL_WORLD_SIZE``) unless the ``node_size`` option overrides it (tests run two
"nodes" on one machine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from moeplug.api import ConfigError

NODE_SIZE_FIELD = "plugins.dispatcher_options.node_size"


def check_node_size(node_size: int, ep_size: int, where: str) -> None:
    """``node_size`` (EP ranks per node) must split the EP group into equal nodes."""
    if node_size and ep_size % node_size:
        divisors = [d for d in range(1, ep_size + 1) if ep_size % d == 0]
        raise ConfigError(
            f"{NODE_SIZE_FIELD} = {node_size}: does not divide {where} = {ep_size}, so the "
            f"nodes would hold different numbers of EP ranks. Fix: set node_size to one of "
            f"{', '.join(map(str, divisors))}, or 0 to take $LOCAL_WORLD_SIZE from the launcher")


@dataclass(frozen=True)
class NodeSplit:
    num_nodes: int   # N
    node_size: int   # n, EP ranks per node
    node: int        # this rank's node b
    local: int       # this rank's index inside its node

    def intra_ranks(self, members: list[int]) -> list[int]:
        """Global ranks of my node's EP ranks, in EP order."""
        return members[self.node * self.node_size:(self.node + 1) * self.node_size]

    def inter_ranks(self, members: list[int]) -> list[int]:
        """Global ranks of the EP ranks with my local index, node by node."""
        return members[self.local::self.node_size]


def launcher_node_size(members: list[int], local_world_size: int) -> int:
    """EP ranks per node when node k holds global ranks ``k*lws .. (k+1)*lws - 1``."""
    nodes = [g // local_world_size for g in members]
    runs: list[int] = []
    for i, node in enumerate(nodes):
        if i and node == nodes[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    if len(set(runs)) != 1 or len(runs) != len(set(nodes)):
        raise ConfigError(
            f"$LOCAL_WORLD_SIZE = {local_world_size}: the EP group's ranks {members} fall on "
            f"nodes {nodes}, not equal consecutive runs, which the hierarchical dispatcher needs. "
            f"Fix: set {NODE_SIZE_FIELD} to the EP ranks per node you want, or change "
            "parallel.order so each node holds the same number of consecutive EP ranks")
    return runs[0]


def split(members: list[int], ep_rank: int, node_size: int) -> NodeSplit:
    """The node split of an EP group whose global ranks are ``members`` (EP order)."""
    W = len(members)
    if not node_size:
        lws = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
        # Without a launcher every process is on this machine: one node.
        node_size = launcher_node_size(members, lws) if lws > 0 else W
    check_node_size(node_size, W, "the EP group size")
    return NodeSplit(num_nodes=W // node_size, node_size=node_size, node=ep_rank // node_size,
                     local=ep_rank % node_size)


def group_timeout(group: Any) -> Any:
    """The timeout ``group`` was created with (parallel.timeout_s for the trainer's groups), so a
    hung peer stops the subgroups' collectives as soon as the EP group's; None if torch hides it
    (``new_group`` then falls back to torch's 30-minute default)."""
    for device in ("cpu", "cuda"):
        try:  # private but stable since torch 2.0: the backend's options hold the timeout
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def group_timeout_s(group: Any) -> float:
    """:func:`group_timeout` in seconds, 300 if torch hides it: what a shared-memory heap's
    waits on ``group``'s peers fail after, as its collectives do."""
    timeout = group_timeout(group)
    return timeout.total_seconds() if timeout is not None else 300.0


def node_groups(members: list[int], s: NodeSplit, timeout: Any = None) -> tuple[Any, Any]:
    """(intra, inter) process groups; None for a subgroup of one rank.

    Only the members of a subgroup create it (``use_local_synchronization``): the ranks of other
    EP groups (other pipeline stages, other DP replicas) build other layers and must not be
    asked to join. Every rank creates its node's group first, then the network one, so the
    group-local barriers of creation cannot wait on each other in a cycle.
    """
    import torch.distributed as dist

    def make(ranks: list[int]) -> Any:
        if len(ranks) == 1:
            return None
        return dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=True)

    return make(s.intra_ranks(members)), make(s.inter_ranks(members))
