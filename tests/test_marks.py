"""Module marks (moeplug.modules.marks): the one mechanism recompute and offload use to make a
built module's forward run inside a checkpoint / an offload scope.

A marked module keeps its type (isinstance), its parameter names and its copies working; marks
of two kinds nest in the order applied, and taking one off keeps the other wherever it sits.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moeplug.modules import marks, offload, recompute


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return 2 * self.lin(x)


def _tracing(name: str, log: list) -> marks.MarkKind:
    def around(module, fn, *args):
        log.append(f"{name}>")
        out = fn(*args)
        log.append(f"<{name}")
        return out
    return marks.MarkKind(name, around)


def test_marks_nest_in_order_and_unmark_keeps_the_other():
    log: list[str] = []
    inner, outer = _tracing("A", log), _tracing("B", log)
    m = Twice()
    names = [n for n, _ in m.named_parameters()]
    x = torch.randn(2, 3)
    want = m(x)
    marks.mark(m, inner)
    marks.mark(m, outer)
    marks.mark(m, inner)  # again: nothing changes
    assert isinstance(m, Twice) and [n for n, _ in m.named_parameters()] == names
    assert torch.equal(m(x), want)
    assert log == ["B>", "A>", "<A", "<B"]  # the later mark outermost
    # A deep copy (benchmarks twin models) is marked the same.
    log.clear()
    twin = copy.deepcopy(m)
    twin(x)
    assert log == ["B>", "A>", "<A", "<B"] and type(twin) is type(m)
    # Taking off the inner kind keeps the outer one.
    assert marks.unmark(m, inner) and not marks.is_marked(m, inner)
    assert marks.is_marked(m, outer)
    log.clear()
    m(x)
    assert log == ["B>", "<B"]
    assert marks.unmark(m, outer) and type(m) is Twice
    assert not marks.unmark(m, outer)
    # One subclass per (class, kind): marking another instance reuses it.
    a, b = Twice(), Twice()
    marks.mark(a, inner)
    marks.mark(b, inner)
    assert type(a) is type(b) and type(a).__name__ == "ATwice"


def test_recompute_and_offload_share_the_marks():
    """A module both recomputed and offloaded (core_attn is a name of both): removing the
    recompute mark first leaves the offload mark on, and the reverse."""
    m = Twice()
    recompute.mark(m)
    offload.mark(m, offload.Offloader("", 4096, 1 << 20), frozenset(), inputs=True)
    assert marks.is_marked(m, recompute.RECOMPUTE) and marks.is_marked(m, offload.OFFLOAD)
    assert type(m).__name__ == "OffloadedRecomputedTwice"
    root = nn.Sequential(m)
    recompute.remove_recompute(root)
    assert type(m).__name__ == "OffloadedTwice" and m._moeplug_offload_inputs
    offload.remove_offload(root)
    assert type(m) is Twice and "_moeplug_offloader" not in m.__dict__
    x = torch.randn(2, 3, requires_grad=True)
    recompute.mark(m)
    y = m(x)  # checkpointed: same value and grad as the plain module
    y.sum().backward()
    g = x.grad.clone()
    recompute.remove_recompute(root)
    x.grad = None
    assert torch.equal(m(x), y)
    m(x).sum().backward()
    assert torch.equal(x.grad, g)
