"""Built-in expert backends: ``sequential`` (a Python loop) and ``grouped`` (one grouped MLP op).

Both own the same parameters (HF Mixtral layout), so a checkpoint from one loads into the other.
"""

from __future__ import annotations

from moeplug.api import hookimpl


def make_sequential(model, options, num_local_experts):
    from moeplug_plugins.experts.sequential import SequentialExperts
    return SequentialExperts(model, num_local_experts)


def make_grouped(model, options, num_local_experts):
    from moeplug_plugins.experts.grouped import GroupedExperts
    return GroupedExperts(model, num_local_experts)


@hookimpl
def moeplug_register_experts(registry) -> None:
    registry.add("sequential", make_sequential,
                 description="loop over local experts with torch ops (reference backend)")
    registry.add("grouped", make_grouped,
                 description="all local experts in one grouped MLP op (moeplug.ops.grouped_ffn)")
