"""Expert activations in plain torch: the FC1 output ``h`` in, the FC2 input ``a`` out.

Legend: N rows (any count), F FFN hidden size; ``X`` is 2F for gated activations, F otherwise.

Gated activations (Megatron ``gated_linear_unit=True``) split FC1's output into a gate half
and an up half (gate rows first, the Hugging Face Mixtral layout of ``gate_up_proj``):
    swiglu        a = silu(h[:, :F]) * h[:, F:]
    geglu         a = gelu(h[:, :F]) * h[:, F:]          (exact, erf-based GELU)
Plain activations use all of h:
    gelu          a = gelu(h)                            (exact, erf-based GELU)
    squared_relu  a = relu(h) ** 2                       (Primer; Megatron squared_relu)
The names match :data:`moeplug.config.ACTIVATIONS`; the fused C++ kernel covers swiglu only.

:func:`act_times_probs` and :func:`act_times_probs_backward` compute ``act(h) * p`` and its
vector-Jacobian product with the ops autograd runs for the composition above (MulBackward0,
SiluBackward0 / GeluBackward0, PowBackward0 + ReluBackward0, SplitBackward0), bitwise, but into
buffers the caller's ``empty`` hands out: the grouped expert MLP takes them from the layer's
workspace, so a steady-state step allocates nothing.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moeplug.config import ACTIVATIONS, GATED_ACTIVATIONS
from moeplug.runtime.workspace import Empty


def _swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    return F.silu(gate_NF) * up_NF


def _geglu(h_N2F: torch.Tensor) -> torch.Tensor:
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    return F.gelu(gate_NF) * up_NF


def _squared_relu(h_NF: torch.Tensor) -> torch.Tensor:
    return torch.relu(h_NF).square()


_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": _swiglu,
    "geglu": _geglu,
    "gelu": F.gelu,
    "squared_relu": _squared_relu,
}
# moeplug.config validates names without importing torch; both lists must name the same functions.
assert tuple(_FUNCS) == ACTIVATIONS, "moeplug.config.ACTIVATIONS and _FUNCS must match"


def is_gated(name: str) -> bool:
    """True if FC1 produces 2F features (gate half, then up half)."""
    return name in GATED_ACTIVATIONS


def fc1_rows(name: str, ffn_hidden_size: int) -> int:
    """Output features of FC1 (rows of a ``gate_up_proj`` matrix) for this activation."""
    return 2 * ffn_hidden_size if is_gated(name) else ffn_hidden_size


def act_width(name: str, fc1_features: int) -> int:
    """Output features of the activation over FC1's ``fc1_features`` (the inverse of
    :func:`fc1_rows`)."""
    return fc1_features // 2 if is_gated(name) else fc1_features


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``h_NX -> a_NF`` for ``name`` (differentiable with autograd)."""
    try:
        return _FUNCS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is unknown. Fix: use one of "
                         f"{', '.join(map(repr, ACTIVATIONS))}") from None


aten = torch.ops.aten


def act_into(h_SX: torch.Tensor, name: str, out_SF: torch.Tensor) -> torch.Tensor:
    """``act(h)`` into out_SF, as activation_fn(name) computes it."""
    if is_gated(name):
        gate_SF, up_SF = h_SX.chunk(2, dim=-1)
        _gate_into(gate_SF, name, out_SF)
        return torch.mul(out_SF, up_SF, out=out_SF)
    if name == "gelu":
        return aten.gelu.out(h_SX, out=out_SF)
    torch.clamp_min(h_SX, 0, out=out_SF)  # torch.relu is clamp_min(x, 0); square is pow(x, 2)
    return torch.pow(out_SF, 2, out=out_SF)


def _gate_into(gate_SF: torch.Tensor, name: str, out_SF: torch.Tensor) -> torch.Tensor:
    return (aten.silu.out(gate_SF, out=out_SF) if name == "swiglu" else
            aten.gelu.out(gate_SF, out=out_SF))


def _probs_col(probs_S: torch.Tensor, dtype: torch.dtype, empty: Empty) -> torch.Tensor:
    """``probs_S.unsqueeze(-1).to(dtype)``."""
    col = probs_S.unsqueeze(-1)
    return col if col.dtype == dtype else empty(tuple(col.shape), dtype).copy_(col)


def act_times_probs(h_SX: torch.Tensor, probs_S: torch.Tensor | None, name: str,
                    empty: Empty) -> torch.Tensor:
    """``activation_fn(name)(h) * probs_S[:, None]`` (``* 1`` skipped for None), bitwise."""
    S, X = h_SX.shape
    a_SF = act_into(h_SX, name, empty((S, act_width(name, X)), h_SX.dtype))
    if probs_S is not None:
        torch.mul(a_SF, _probs_col(probs_S, a_SF.dtype, empty), out=a_SF)
    return a_SF


def act_times_probs_backward(grad_SF: torch.Tensor, h_SX: torch.Tensor,
                             probs_S: torch.Tensor | None, name: str, want_dp: bool,
                             empty: Empty) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh_SX, dp_S or None) of :func:`act_times_probs`, bitwise what autograd computes for
    the composition (dp in probs_S's dtype)."""
    dt = h_SX.dtype
    F = grad_SF.shape[1]
    dp_S = None
    if probs_S is None:
        grad_act = grad_SF
    else:  # MulBackward0 of act * p_col: grad * p_col, and (grad * act) summed to [S, 1]
        grad_act = torch.mul(grad_SF, _probs_col(probs_S, dt, empty),
                             out=empty(tuple(grad_SF.shape), dt))
        if want_dp:
            prod = act_into(h_SX, name, empty(tuple(grad_SF.shape), dt))
            torch.mul(grad_SF, prod, out=prod)
            dp_col = torch.sum(prod, dim=1, keepdim=True, out=empty((prod.shape[0], 1), dt))
            if dp_col.dtype != probs_S.dtype:  # ToCopyBackward0
                dp_col = empty(tuple(dp_col.shape), probs_S.dtype).copy_(dp_col)
            dp_S = dp_col.view(-1)
    dh_SX = empty(tuple(h_SX.shape), dt)
    if is_gated(name):  # MulBackward0 of gate_act * up, the gate's own backward, SplitBackward0
        gate_SF, up_SF = h_SX.chunk(2, dim=-1)
        dgate_SF, dup_SF = dh_SX.chunk(2, dim=-1)
        gate_act = _gate_into(gate_SF, name, empty(tuple(grad_SF.shape), dt))
        torch.mul(grad_act, gate_act, out=dup_SF)
        d_act = torch.mul(grad_act, up_SF, out=gate_act)  # gate_act is not needed any more
        if name == "swiglu":
            aten.silu_backward.grad_input(d_act, gate_SF, grad_input=dgate_SF)
        else:
            aten.gelu_backward.grad_input(d_act, gate_SF, approximate="none",
                                          grad_input=dgate_SF)
    elif name == "gelu":
        aten.gelu_backward.grad_input(grad_act, h_SX, approximate="none", grad_input=dh_SX)
    else:  # PowBackward0 (grad * (2 * r)), then ReluBackward0 (grad where r > 0)
        r_SF = torch.clamp_min(h_SX, 0, out=empty((h_SX.shape[0], F), dt))
        # r + r is 2 * r exactly, without the wrapped-scalar tensor a mul by 2.0 allocates.
        two_r = torch.add(r_SF, r_SF, out=empty(tuple(r_SF.shape), dt))
        torch.mul(grad_act, two_r, out=two_r)
        aten.threshold_backward.grad_input(two_r, r_SF, 0, grad_input=dh_SX)
    return dh_SX, dp_S
