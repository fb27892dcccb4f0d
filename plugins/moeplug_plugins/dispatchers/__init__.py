"""Built-in token dispatchers: ``alltoall`` (default) and ``allgather``, one file each."""

from __future__ import annotations

from moeplug import hookimpl


def make_alltoall(model, options, group):
    from moeplug_plugins.dispatchers.alltoall import AlltoAllDispatcher
    return AlltoAllDispatcher(model, group)


def make_allgather(model, options, group):
    from moeplug_plugins.dispatchers.allgather import AllGatherDispatcher
    return AllGatherDispatcher(model, group)


@hookimpl
def moeplug_register_dispatchers(registry) -> None:
    registry.add("alltoall", make_alltoall,
                 description="permute -> all-to-all over EP -> sort by local expert (Megatron alltoall)")
    registry.add("allgather", make_allgather,
                 description="all-gather over EP -> select local experts -> reduce-scatter "
                             "(Megatron allgather)")
