"""Module marks: a built module's forward made to run inside something, without changing the
module. Recompute (a checkpoint, moeplug.modules.recompute) and offload (a saved-tensor scope,
moeplug.modules.offload) are the two kinds; moeplug.parallelize applies them in that order.

A mark swaps the instance's class for a subclass, made once per (class, kind), whose marked
methods call ``kind.around(module, the_original_method, *args)``: isinstance, parameter
names, state dicts and deepcopy keep working (a forward closure on the instance would not
survive a copy). Marks nest in the order applied, the later one outermost (a module both
recomputed and offloaded runs its offload scope around the checkpoint); :func:`unmark` takes
one kind off wherever it sits in the chain and keeps the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True, eq=False)
class MarkKind:
    """One kind of mark: ``around(module, fn, *args)`` runs ``fn(*args)`` (the unmarked
    method, bound) its way; ``methods``: the method names it wraps, where the class has them."""

    name: str
    around: Callable[..., Any]
    methods: tuple[str, ...] = ("forward",)


# (unmarked-or-less-marked class, kind) -> its marked subclass; the subclass knows both.
_SUBCLASSES: dict[tuple[type, MarkKind], type] = {}


def _marked_class(cls: type, kind: MarkKind) -> type:
    key = (cls, kind)
    if key not in _SUBCLASSES:
        def wrapper(name: str) -> Callable:
            def method(self, *args):
                return kind.around(self, getattr(super(sub, self), name), *args)
            method.__name__ = name
            return method
        body = {name: wrapper(name) for name in kind.methods if hasattr(cls, name)}
        body.update(_mark_kind=kind, _mark_base=cls)
        sub = type(f"{kind.name}{cls.__name__}", (cls,), body)
        _SUBCLASSES[key] = sub
    return _SUBCLASSES[key]


def _chain(cls: type) -> tuple[type, list[MarkKind]]:
    """The class under every mark, and the kinds on it from the innermost out."""
    kinds: list[MarkKind] = []
    while "_mark_kind" in cls.__dict__:
        kinds.append(cls.__dict__["_mark_kind"])
        cls = cls.__dict__["_mark_base"]
    return cls, kinds[::-1]


def is_marked(module: nn.Module, kind: MarkKind) -> bool:
    return kind in _chain(type(module))[1]


def mark(module: nn.Module, kind: MarkKind) -> None:
    """Wrap ``module``'s methods by ``kind`` (once: marking again changes nothing)."""
    if not is_marked(module, kind):
        module.__class__ = _marked_class(type(module), kind)


def unmark(module: nn.Module, kind: MarkKind) -> bool:
    """Take ``kind`` off ``module`` (the other marks stay, in their order); False if it had
    none."""
    base, kinds = _chain(type(module))
    if kind not in kinds:
        return False
    cls = base
    for k in kinds:
        if k is not kind:
            cls = _marked_class(cls, k)
    module.__class__ = cls
    return True
