"""Argument checks shared by the ops: each error names the op, the argument, what arrived and
the fix, before any pointer reaches C++ (where a wrong shape would read out of bounds)."""

from __future__ import annotations

import torch

from moeplug.runtime import dtype_code


def check_cpu_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} is on {t.device}; the runtime kernels take CPU tensors. "
                         f"Fix: move it with {name}.cpu() (CUDA kernels are not built)")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} with shape {tuple(t.shape)} and strides {t.stride()} is "
                         f"not contiguous. Fix: pass {name}.contiguous()")


def check_rows(op: str, name: str, t: torch.Tensor, ndim: int, legend: str) -> int:
    """Validates a float32/bfloat16 activation tensor; returns its dtype code."""
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {legend}, got shape {tuple(t.shape)}. "
                         f"Fix: reshape it to {legend}")
    check_cpu_contiguous(op, name, t)
    return dtype_code(t, op, name)


def check_index(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...] | None,
                legend: str) -> None:
    if t.dtype != torch.int64:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected torch.int64. "
                        f"Fix: pass {name}.long()")
    if t.dim() != len(legend.split(",")) or (shape is not None and tuple(t.shape) != shape):
        want = legend if shape is None else f"{legend} = {shape}"
        raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(t.shape)}. "
                         f"Fix: pass the tensor that matches the other arguments")
    check_cpu_contiguous(op, name, t)


def check_probs(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Probabilities may be any float dtype; the kernels read them as contiguous float32."""
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected a floating dtype "
                        f"(float32). Fix: pass routing weights, not expert ids")
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(t.shape)}. "
                         f"Fix: pass one weight per routed row")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} is on {t.device}; the runtime kernels take CPU tensors. "
                         f"Fix: move it with {name}.cpu()")
    return t.detach().to(torch.float32).contiguous()


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
