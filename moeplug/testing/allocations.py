"""Counts the CPU allocations one call (a training step) makes on the MoE path.

The MoE path is everything that runs inside an ``MoELayer.forward`` plus the backward of every
autograd node that forward created (router, dispatch, experts, combine, aux loss and the
AccumulateGrad of the layer's own parameters), found by walking each layer's output graph back
to the layer's input. Counted from torch's profiler memory accounting (``profile_memory``):
every op whose own (self) allocations net of its own frees are positive counts once, so a
buffer reused from a cache or a workspace arena does not count and a fresh tensor does.

    report = moe_path_allocations(model, step)
    assert report.count == 0, report.describe()
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

FORWARD = "moeplug::moe_forward"
BACKWARD = "moeplug::moe_backward"
BIG = 1 << 20  # activation-sized: what the stash and the workspace cache exist for


@dataclass(frozen=True)
class Allocations:
    count: int                        # ops that allocated on the MoE path
    big: int                          # of them, those allocating >= 1 MiB
    nbytes: int                       # bytes those ops allocated
    where: dict[str, int]             # "op <- python frames" -> count, for the failure message

    def describe(self) -> str:
        rows = sorted(self.where.items(), key=lambda kv: -kv[1])
        return f"{self.count} allocations on the MoE path ({self.nbytes} bytes):\n" + "\n".join(
            f"  {n} x {k}" for k, n in rows)


def _graph_nodes(outputs: list[torch.Tensor], stop: set) -> list:
    """Every autograd node reachable from ``outputs`` without passing a node in ``stop``."""
    seen, todo, nodes = set(), [t.grad_fn for t in outputs if t.grad_fn is not None], []
    while todo:
        node = todo.pop()
        if node is None or node in stop or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return nodes


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@contextlib.contextmanager
def _moe_ranges(model: torch.nn.Module):
    """Opens a FORWARD profiler range around each MoELayer.forward, and a BACKWARD range
    around each autograd node that forward created (node pre-hook / hook)."""
    from moeplug.modules.moe import MoELayer
    open_ranges: list = []
    inputs: list = []
    handles = []

    def enter(name: str) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(record_function(name))
        open_ranges.append(stack)

    def pre(_module, args):
        inputs.append({t.grad_fn for t in _tensors(args) if t.grad_fn is not None})
        enter(FORWARD)

    def post(_module, _args, out):
        open_ranges.pop().close()
        for node in _graph_nodes(_tensors(out), inputs.pop()):
            node.register_prehook(lambda *_: enter(BACKWARD))
            node.register_hook(lambda *_: open_ranges.pop().close())

    for m in model.modules():
        if isinstance(m, MoELayer):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def moe_path_allocations(model: torch.nn.Module, call: Callable[[], object]) -> Allocations:
    """The allocations ``call()`` makes on the MoE path of ``model`` (see the module doc)."""
    with _moe_ranges(model), profile(activities=[ProfilerActivity.CPU],
                                     profile_memory=True) as prof:
        call()
    count = big = nbytes = 0
    where: collections.Counter = collections.Counter()
    for ev in prof.events():
        if ev.self_cpu_memory_usage <= 0:
            continue
        chain, parent, on_path = [], ev, False
        while parent is not None:
            on_path = on_path or parent.name in (FORWARD, BACKWARD)
            chain.append(parent.name)
            parent = parent.cpu_parent
        if on_path:
            count += 1
            big += ev.self_cpu_memory_usage >= BIG
            nbytes += ev.self_cpu_memory_usage
            where[" <- ".join(chain[:6])] += 1
    return Allocations(count, big, nbytes, dict(where))
