"""Built-in token dispatchers: ``alltoall`` (default), ``allgather`` and ``hierarchical``, one
file each."""

from __future__ import annotations

from dataclasses import dataclass

from moeplug import hookimpl


@dataclass(frozen=True)
class HierarchicalOptions:
    """``plugins.dispatcher_options`` of ``hierarchical``.

    node_size: EP ranks per node (EP rank r sits on node r // node_size); 0 takes
               $LOCAL_WORLD_SIZE from the launcher (one node without one). Tests set it to run
               two "nodes" on one machine.
    """

    node_size: int = 0

    def __post_init__(self) -> None:
        if self.node_size < 0:
            from moeplug.config import ConfigError
            raise ConfigError(f"plugins.dispatcher_options.node_size = {self.node_size}: must be "
                              ">= 0. Fix: set node_size to the EP ranks per node, or 0 to take "
                              "$LOCAL_WORLD_SIZE from the launcher")

    def check_parallel(self, parallel) -> None:
        """Before any process group exists (the CLI's plugin check): the nodes split EP evenly."""
        from moeplug_plugins.dispatchers._nodes import check_node_size
        check_node_size(self.node_size, parallel.ep, "parallel.ep")


def make_alltoall(model, options, group):
    from moeplug_plugins.dispatchers.alltoall import AlltoAllDispatcher
    return AlltoAllDispatcher(model, group)


def make_allgather(model, options, group):
    from moeplug_plugins.dispatchers.allgather import AllGatherDispatcher
    return AllGatherDispatcher(model, group)


def make_hierarchical(model, options: HierarchicalOptions, group):
    from moeplug_plugins.dispatchers.hierarchical import HierarchicalDispatcher
    return HierarchicalDispatcher(model, group, node_size=options.node_size)


@hookimpl
def moeplug_register_dispatchers(registry) -> None:
    registry.add("alltoall", make_alltoall,
                 description="permute -> all-to-all over EP -> sort by local expert (Megatron alltoall)")
    registry.add("allgather", make_allgather,
                 description="all-gather over EP -> select local experts -> reduce-scatter "
                             "(Megatron allgather)")
    registry.add("hierarchical", make_hierarchical, options_cls=HierarchicalOptions,
                 description="one row per (token, destination node) over the network, then "
                             "fan-out inside the node (HybridEP); option node_size")
