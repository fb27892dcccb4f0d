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
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moeplug.config import ACTIVATIONS, GATED_ACTIVATIONS


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
# config.py validates names without importing torch; both lists must name the same functions.
assert tuple(_FUNCS) == ACTIVATIONS, "moeplug.config.ACTIVATIONS and _FUNCS must match"


def is_gated(name: str) -> bool:
    """True if FC1 produces 2F features (gate half, then up half)."""
    return name in GATED_ACTIVATIONS


def fc1_rows(name: str, ffn_hidden_size: int) -> int:
    """Output features of FC1 (rows of a ``gate_up_proj`` matrix) for this activation."""
    return 2 * ffn_hidden_size if is_gated(name) else ffn_hidden_size


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``h_NX -> a_NF`` for ``name`` (differentiable with autograd)."""
    try:
        return _FUNCS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is unknown. Fix: use one of "
                         f"{', '.join(map(repr, ACTIVATIONS))}") from None
