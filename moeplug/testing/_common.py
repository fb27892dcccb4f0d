"""Helpers shared by the contract checks: building the component, failing with a clear message,
and detecting per-call state kept on ``self``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeplug.config import ModelConfig, MoEConfig


class ContractError(AssertionError):
    """A plugin broke an interface contract; the message names the plugin and the rule."""


def tiny_model_config(num_experts: int = 4, top_k: int = 2, hidden_size: int = 16,
                      ffn_hidden_size: int = 8, aux_loss_coeff: float = 1e-2) -> ModelConfig:
    # init_std well above the training default so outputs are far from zero and tolerances bite.
    return ModelConfig(hidden_size=hidden_size, num_heads=2, num_kv_heads=1, num_layers=1,
                       first_k_dense=0, dense_ffn_hidden_size=16, max_seq_len=16, init_std=0.2,
                       moe=MoEConfig(num_experts=num_experts, top_k=top_k,
                                     ffn_hidden_size=ffn_hidden_size, aux_loss_coeff=aux_loss_coeff))


def build(source: Any, kind: str, name: str | None, options: Any, *args: Any) -> tuple[Any, str]:
    """(component, label) from a PluginHost + name, or from a bare factory."""
    if hasattr(source, "create") and hasattr(source, "infos"):
        if not name:
            raise TypeError(f"check_{kind}(host, name): pass the {kind} name to check")
        return source.create(kind, name, options or {}, *args), f"{kind} '{name}'"
    if not callable(source):
        raise TypeError(f"check_{kind}: expected a PluginHost or a factory, got {source!r}")
    label = f"{kind} '{name or getattr(source, '__name__', 'factory')}'"
    return source(*args[:1], options, *args[1:]), label


def differentiable(t: torch.Tensor, label: str, what: str) -> torch.Tensor:
    """``t``, after checking it carries a gradient (a detached output made autograd raise a
    bare RuntimeError instead of naming the plugin and the rule)."""
    expect(t.requires_grad, label, f"{what} carries no gradient (detached, or computed under "
           "no_grad): backward would not reach the inputs and parameters")
    return t


def expect(cond: Any, label: str, rule: str) -> None:
    if not bool(cond):
        raise ContractError(f"{label}: {rule}")


def close(actual: torch.Tensor, expected: torch.Tensor, label: str, what: str,
          rtol: float = 1e-4, atol: float = 1e-5) -> None:
    expect(actual is not None, label, f"{what} is missing (no gradient reached it)")
    expect(actual.shape == expected.shape, label,
           f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if not torch.allclose(actual.float(), expected.float(), rtol=rtol, atol=atol):
        err = (actual.float() - expected.float()).abs().max().item()
        raise ContractError(f"{label}: {what} differs from the reference (max abs error {err:.3g}, "
                            f"rtol={rtol}, atol={atol})")


def state_snapshot(obj: Any) -> dict:
    """Attribute identities (and container sizes, buffer values) of ``obj`` and its submodules."""
    objs = list(obj.modules()) if isinstance(obj, nn.Module) else [obj]
    snap: dict = {}
    for i, o in enumerate(objs):
        for key, value in vars(o).items():
            if key == "_buffers":
                for b, t in value.items():
                    snap[(i, "buffer", b)] = None if t is None else t.detach().clone()
                continue
            snap[(i, key)] = (id(value), len(value) if isinstance(value, (list, dict, set)) else None)
    return snap


def expect_no_new_state(before: dict, obj: Any, label: str, call: str) -> None:
    after = state_snapshot(obj)
    changed = sorted(str(k[-1]) for k in set(before) | set(after)
                     if k not in before or k not in after or not _same(before[k], after[k]))
    expect(not changed, label, f"{call} changed attributes on self ({', '.join(changed)}); keep "
                               f"per-call state out of self (return it, e.g. in Dispatched.meta)")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return a == b
