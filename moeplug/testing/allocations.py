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

import bisect
import collections
import contextlib
import itertools
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
    from moeplug.moe import MoELayer
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
    return _tally(_self_bytes_of_ops(_profile(model, call)))


def _profile(model: torch.nn.Module, call: Callable[[], object]):
    with _moe_ranges(model), profile(activities=[ProfilerActivity.CPU],
                                     profile_memory=True) as prof:
        call()
    return prof


def _self_bytes_of_ops(prof):
    """(self bytes, names up the tree) of every op that allocated more than it freed."""
    for op in _op_tree(prof.profiler.kineto_results):
        if not op.is_async:
            self_bytes = op.total - sum(c.total for c in op.children)
            if self_bytes > 0:
                yield self_bytes, _names_up(op, "parent")


def _self_bytes_of_function_events(prof):
    """The same from ``prof.events()``, torch's FunctionEvents: what _op_tree is checked
    against (tests/test_moe_allocations.py)."""
    for ev in prof.events():
        if ev.self_cpu_memory_usage > 0:
            yield ev.self_cpu_memory_usage, _names_up(ev, "cpu_parent")


def _names_up(node, parent_attr: str) -> list[str]:
    """The names of ``node`` and its ancestors, innermost first."""
    names = []
    while node is not None:
        names.append(node.name)
        node = getattr(node, parent_attr)
    return names


def _tally(ops) -> Allocations:
    """Allocations of (self bytes, names up the tree) pairs: the ops under a MoE range."""
    count = big = nbytes = 0
    where: collections.Counter = collections.Counter()
    for self_bytes, names in ops:
        if FORWARD in names or BACKWARD in names:
            count += 1
            big += self_bytes >= BIG
            nbytes += self_bytes
            where[" <- ".join(names[:6])] += 1
    return Allocations(count, big, nbytes, dict(where))

# -- the profiler's op tree, without its FunctionEvents -------------------------------------------
# ``prof.events()`` builds a FunctionEvent per kineto event (shapes, stacks, flops, ...): ~1 s
# for the ~8,000 events of one tiny training step, twice per test, over a hundred tests. The
# count needs only each op's name, interval, thread and memory, so this builds that tree from
# the raw events by torch's own rules (torch.autograd.profiler._parse_kineto_results and
# EventList._build_tree): an op's memory is every CPU memory record inside its interval, on any
# thread; its parent is the innermost op of its thread whose interval holds it; a parent whose
# only child has its name absorbs it. tests/test_moe_allocations.py checks it against
# ``prof.events()``.

_MEMORY = "[memory]"
_NOT_OPS = frozenset({_MEMORY, "[OutOfMemory]", "profiler::_record_function_enter",
                      "profiler::_record_function_enter_new", "profiler::_record_function_exit",
                      "aten::is_leaf", "aten::output_nr", "aten::_version"})


class _Op:
    __slots__ = ("name", "start", "end", "thread", "is_async", "total", "parent", "children")

    def __init__(self, name, start, end, thread, is_async, total):
        self.name, self.start, self.end, self.thread = name, start, end, thread
        self.is_async, self.total = is_async, total
        self.parent, self.children = None, []


def _op_tree(results) -> list[_Op]:
    from torch._C._autograd import DeviceType
    from torch.autograd.profiler_util import _rewrite_name

    cpu_memory = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    events = results.events()
    records = sorted((e.start_ns(), e.nbytes() if e.device_type() in cpu_memory else 0)
                     for e in events if e.name() == _MEMORY)
    stamps = [t for t, _ in records]
    prefix = list(itertools.accumulate((b for _, b in records), initial=0))
    ops: list[_Op] = []
    for e in events:
        name = e.name()
        if name in _NOT_OPS or e.is_hidden_event() or e.device_type() != DeviceType.CPU:
            continue  # other devices' events hold no CPU memory and have no CPU parent
        start, end = e.start_ns(), e.end_ns()
        total = (prefix[bisect.bisect_right(stamps, end)]
                 - prefix[bisect.bisect_left(stamps, start)])
        ops.append(_Op(_rewrite_name(name, with_wildcard=True), start, end,
                       e.start_thread_id(), e.is_async() or e.start_thread_id() !=
                       e.end_thread_id(), total))
    by_thread: dict[int, list[_Op]] = collections.defaultdict(list)
    for op in ops:
        if not op.is_async:
            by_thread[op.thread].append(op)
    for thread_ops in by_thread.values():
        stack: list[_Op] = []
        for op in sorted(thread_ops, key=lambda o: (o.start, -o.end)):
            while stack:
                top = stack[-1]
                if op.start >= top.end or op.end > top.end:
                    stack.pop()
                else:
                    top.children.append(op)
                    op.parent = top
                    break
            stack.append(op)
    while True:  # a parent whose only child has its name absorbs it, in list order
        gone = set()
        for i, op in enumerate(ops):
            up = op.parent
            if up is not None and up.name == op.name and len(up.children) == 1:
                up.children = op.children
                for child in op.children:
                    child.parent = up
                gone.add(i)
        if not gone:
            return ops
        ops = [op for i, op in enumerate(ops) if i not in gone]

