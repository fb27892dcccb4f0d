"""Declared capabilities: what a plugin tells the core about itself is what its interface in
moeplug/interfaces.py declares, with the declared type.

Each ``check_*`` of moeplug.testing runs :func:`check_declared` on the component it built, so a
backend that writes ``accept_token_group = True`` (the core reads ``accepts_token_group``) or
``budget_rows = "yes"`` is told so by its contract test, not by a mode that silently ignores it.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from typing import Any

import torch
from torch import nn

from moeplug import interfaces
from moeplug.testing._common import expect

# What every nn.Module, and a component's own bookkeeping, defines: never a capability.
_MODULE_NAMES = frozenset(dir(nn.Module)) | {"training", "options"}


def declared(base: type) -> dict[str, Any]:
    """The capabilities ``base`` declares: name -> type, from its own class annotations (the
    interfaces' declared attributes, in moeplug/interfaces.py)."""
    own = vars(base).get("__annotations__", {})
    scope = {**vars(typing), **vars(interfaces)}
    return {n: eval(t, scope) if isinstance(t, str) else t  # noqa: S307 - our own annotations
            for n, t in own.items() if not n.startswith("_")}


def check_declared(component: Any, base: type, label: str) -> None:
    """Every declared capability of ``base`` reads as its declared type on ``component``, and
    no class attribute of the component's own looks like a misspelt one."""
    for name, kind in declared(base).items():
        if not hasattr(type(component), name) and name not in vars(component):
            continue  # e.g. num_experts, set in __init__ (checked by each kind's contract)
        value = getattr(component, name)
        if kind is bool:
            expect(isinstance(value, bool), label, f"{name} = {value!r}: declared as a bool on "
                   f"moeplug.interfaces.{base.__name__}. Fix: set {name} = True or False")
        elif kind is int:
            expect(isinstance(value, int) and not isinstance(value, bool), label,
                   f"{name} = {value!r}: declared as an int on moeplug.interfaces."
                   f"{base.__name__}")
        elif kind is torch.dtype:
            expect(isinstance(value, torch.dtype), label, f"{name} = {value!r}: declared as a "
                   f"torch.dtype on moeplug.interfaces.{base.__name__}")
    known = set(declared(base)) | set(dir(base)) | _MODULE_NAMES
    for cls in type(component).__mro__:
        if cls is base or not issubclass(cls, base):
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") or name in known or inspect.isroutine(value) \
                    or isinstance(value, (property, staticmethod, classmethod)):
                continue
            near = difflib.get_close_matches(name, sorted(declared(base)), n=1, cutoff=0.8)
            expect(not near, label, f"declares {name} = {value!r}, which the core never reads; "
                   f"moeplug.interfaces.{base.__name__} declares {near[0] if near else ''}. "
                   f"Fix: rename it")


__all__ = ["check_declared", "declared"]
