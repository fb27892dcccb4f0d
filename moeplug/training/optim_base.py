"""The optimizers' base: torch.optim.Optimizer's parameter groups, per-parameter state and
state-dict format, without its torch.compile wrappers.

Why not torch.optim.Optimizer itself: its ``add_param_group`` (run by ``__init__``),
``zero_grad``, ``state_dict``, ``load_state_dict`` and every built-in ``step`` are wrapped so that
torch.compile skips them, and the wrapper imports ``torch._dynamo`` at its first call. That
import is ~2.4 s of CPU (2.4 s more after ``import torch``'s own 2.4 s, measured on the 2-core
development host) in every rank of every run, for optimizers that are never compiled. The
update itself stays torch's: :class:`moeplug.training.optim.AdamW` calls torch's functional
AdamW (``torch.optim.adamw.adamw``), which is not wrapped.

What is kept is what a training loop, a checkpoint and a resharding tool read: ``param_groups``
(dicts holding ``"params"`` and the hyper-parameters; the trainer sets ``lr`` there each step),
``state`` (a dict per parameter), ``zero_grad``, and ``state_dict`` / ``load_state_dict`` in
torch's format: state keyed by the parameter's index counted over the groups in order, each
group's ``"params"`` those indices. A state dict of one loads into the other, both ways.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch


class Optimizer:
    """Parameter groups and state; subclasses implement ``step``."""

    def __init__(self, params: Iterable, defaults: dict) -> None:
        self.defaults = dict(defaults)
        self.state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        self.param_groups: list[dict] = []
        groups = [params] if isinstance(params, torch.Tensor) else list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list. Fix: pass the model's "
                             "parameters, or groups of them")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group: dict) -> None:
        """Add ``group`` (``{"params": ..., hyper-parameter: value}``); the defaults fill the
        hyper-parameters it does not set. A parameter may be in one group only."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer can only optimize tensors, got {type(p).__name__}. "
                                "Fix: pass the model's parameters")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf tensor. Fix: pass the model's "
                                 "parameters, not tensors computed from them")
        held = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params}) != len(params) or any(id(p) in held for p in params):
            raise ValueError("some parameters appear in more than one parameter group. Fix: "
                             "put each parameter in one group")
        self.param_groups.append({**self.defaults, **group, "params": params})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()

    def step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """torch's format: ``{"state": {index: state}, "param_groups": [group with "params" as
        indices]}``. Like torch's, the state dicts are the live ones (a checkpoint copies)."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: s for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's format, as torch does: the saved groups' hyper-parameters replace these
        groups' (their parameters stay), and each floating state tensor is cast to its
        parameter's dtype and device (``"step"`` is kept as saved). A state dict of other groups
        is refused in torch's words; a checkpoint's load adds the fix (CheckpointError)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        params = dict(zip((i for s in saved for i in s["params"]),
                          (p for g in self.param_groups for p in g["params"])))
        state: defaultdict[Any, dict] = defaultdict(dict)
        for i, values in state_dict["state"].items():
            if i not in params:
                state[i] = values
                continue
            p = params[i]
            state[p] = {k: _cast(p, k, v) for k, v in values.items()}
        self.state = state
        self.param_groups = [{**{k: v for k, v in s.items() if k != "params"},
                              "params": g["params"]}
                             for s, g in zip(saved, self.param_groups)]


def _cast(p: torch.Tensor, key: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or key == "step":
        return value
    if p.is_floating_point() and value.is_floating_point():
        return value.to(dtype=p.dtype, device=p.device)
    return value.to(device=p.device)
