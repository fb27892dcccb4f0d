"""Built-in token dispatchers: ``alltoall`` (default), ``allgather``, ``hierarchical``,
``direct_write`` and ``deepep`` (GPU, when the deep_ep module imports), one file each."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from moeplug.api import hookimpl


@dataclass(frozen=True)
class HierarchicalOptions:
    """``plugins.dispatcher_options`` of ``hierarchical``.

    node_size:  EP ranks per node (EP rank r sits on node r // node_size); 0 takes
                $LOCAL_WORLD_SIZE from the launcher (one node without one). Tests set it to run
                two "nodes" on one machine.
    intra_node: how rows move inside a node. "shm": direct writes into the owners' memory
                through the node's shared-memory heap (as ``direct_write``; CPU tensors);
                "torch": a torch.distributed all-to-all on the node's subgroup (gloo, NCCL);
                "auto": shm where the platform and runtime have the heap and the tokens are on
                the CPU, else torch.
    """

    node_size: int = 0
    intra_node: str = "auto"

    def __post_init__(self) -> None:
        from moeplug.api import ConfigError
        if self.node_size < 0:
            raise ConfigError(f"plugins.dispatcher_options.node_size = {self.node_size}: must be "
                              ">= 0. Fix: set node_size to the EP ranks per node, or 0 to take "
                              "$LOCAL_WORLD_SIZE from the launcher")
        if self.intra_node not in ("auto", "shm", "torch"):
            raise ConfigError(f"plugins.dispatcher_options.intra_node = {self.intra_node!r}: "
                              "unknown. Fix: use 'auto', 'shm' or 'torch'")
        if self.intra_node == "shm" and direct_write_unavailable():
            raise ConfigError(f"plugins.dispatcher_options.intra_node = 'shm': "
                              f"{direct_write_unavailable()}; or use intra_node 'torch'")

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
    return HierarchicalDispatcher(model, group, node_size=options.node_size,
                                  intra_node=options.intra_node)
def make_direct_write(model, options, group):
    from moeplug_plugins.dispatchers.direct_write import DirectWriteDispatcher
    return DirectWriteDispatcher(model, options, group)


def make_deepep(model, options, group):
    from moeplug_plugins.dispatchers.deepep import DeepEPDispatcher
    return DeepEPDispatcher(model, group)


def deepep_unavailable() -> str:
    """Why ``deepep`` cannot run here ("" when it can); imports nothing."""
    if importlib.util.find_spec("deep_ep") is None:
        return ("needs module 'deep_ep' (DeepEP: NVIDIA GPUs, NVLink within a node, NVSHMEM "
                "across nodes), which is not installed. Fix: build and install DeepEP "
                "(github.com/deepseek-ai/DeepEP); or use dispatcher alltoall on GPU, "
                "direct_write or hierarchical on the CPU")
    return ""


def direct_write_unavailable() -> str:
    """Why ``direct_write`` cannot run here ("" when it can): it needs POSIX shared memory and a
    runtime core built with the shared-memory heap."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux POSIX shared memory (/dev/shm); this is {sys.platform}"
    from moeplug.api import core_feature_missing  # the extension alone: registration stays light
    return core_feature_missing("ShmHeap", "the shared-memory heap")


@hookimpl
def moeplug_register_dispatchers(registry) -> None:
    registry.add("alltoall", make_alltoall,
                 description="permute -> all-to-all over EP -> sort by local expert (Megatron alltoall)")
    registry.add("allgather", make_allgather,
                 description="all-gather over EP -> select local experts -> reduce-scatter "
                             "(Megatron allgather)")
    registry.add("hierarchical", make_hierarchical, options_cls=HierarchicalOptions,
                 description="one row per (token, destination node) over the network, then "
                             "fan-out inside the node by direct writes into shared memory "
                             "(HybridEP); options node_size, intra_node")
    from moeplug_plugins.dispatchers._dw_options import DirectWriteOptions
    registry.add("direct_write", make_direct_write, options_cls=DirectWriteOptions,
                 unavailable=direct_write_unavailable(),
                 description="ranks of one machine write rows straight into the expert owner's "
                             "shared-memory heap; counts and ready flags in the heap (DeepEP "
                             "intranode, CPU)")
    registry.add("deepep", make_deepep, unavailable=deepep_unavailable(),
                 description="DeepEP's normal NVLink/RDMA kernels (deep_ep.Buffer dispatch / "
                             "combine, as Megatron's flex dispatcher), then a local permute; "
                             "GPU only")
