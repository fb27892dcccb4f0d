"""Fused AdamW step and bf16 stochastic rounding over the C++ kernels (moeplug/adamw.h).

The precision-aware optimizer (moeplug.training.optim) calls these on CPU tensors, and on CUDA
tensors where moeplug._runtime_cuda is loaded (runtime_cpp/cuda/src/adamw.cu: the same
arithmetic, bitwise the CPU kernels' results, on torch's current stream). Its torch version of
the same step stays beside it as the reference they must match bitwise.
"""

from __future__ import annotations

import math

import torch

from moeplug.ops import cuda_ops
from moeplug.runtime import dtype_code, get_cuda_runtime, runtime_for

_U32 = 0xFFFFFFFF


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as torch rounds a Python scalar for a float32 tensor op."""
    return float(torch.tensor(x, dtype=torch.float32))


def kernel_applies(*tensors: torch.Tensor, cuda: bool = False) -> bool:
    """True when every tensor is a contiguous float32/bfloat16 tensor on one device: the CPU,
    or, with ``cuda``, a GPU where the CUDA extension is loaded (the kernels' input). Elsewhere
    the optimizer takes the torch step. ``cuda`` is the caller's opt-in while the CUDA kernels
    wait for a GPU session to prove them (docs/GPU.md)."""
    device = tensors[0].device
    if device.type == "cuda" and not (cuda and cuda_ops.available(tensors[0])):
        return False
    return device.type in ("cpu", "cuda") and all(
        t.device == device and t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16)
        for t in tensors)


def stochastic_round_bf16_(dst: torch.Tensor, src32: torch.Tensor, step: int) -> None:
    """``dst`` (bf16) <- ``src32`` (fp32) rounded stochastically, bitwise as
    :func:`moeplug.training.optim.stochastic_round_reference_` (finite values and infinities)."""
    op = "stochastic_round_bf16_"
    if src32.dtype != torch.float32 or dst.dtype != torch.bfloat16:
        raise TypeError(f"{op}: src32 must be float32 and dst bfloat16, got {src32.dtype} and "
                        f"{dst.dtype}. Fix: pass src32.float() and a bfloat16 dst")
    if dst.numel() != src32.numel():
        raise ValueError(f"{op}: dst has {dst.numel()} elements, src32 {src32.numel()}. Fix: "
                         f"pass tensors of the same shape")
    _check_placed(op, {"dst": dst, "src32": src32})
    runtime, extra = runtime_for(dst)
    runtime.stochastic_round_bf16(src=src32.data_ptr(), dst=dst.data_ptr(), n=dst.numel(),
                                  step=step & _U32, **extra)


def _check_placed(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor contiguous and on the first one's device: the CPU, or a GPU with the CUDA
    extension loaded."""
    first, head = next(iter(tensors.items()))
    if head.device.type == "cuda":
        get_cuda_runtime()  # raises RuntimeMissingError naming the build that has the kernels
    elif head.device.type != "cpu":
        raise ValueError(f"{op}: {first} is on {head.device}; the kernels take CPU or CUDA "
                         f"tensors. Fix: use the torch step there (moeplug.training.optim)")
    for name, t in tensors.items():
        if t.device != head.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} on {head.device}. "
                             f"Fix: keep a parameter's grad, moments and main copy together")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} with shape {tuple(t.shape)} and strides {t.stride()} "
                             f"is not contiguous. Fix: pass {name}.contiguous()")


def _check_step(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor contiguous on one device, with as many elements as the first."""
    _check_placed(op, tensors)
    first, n = next(iter(tensors)), next(iter(tensors.values())).numel()
    for name, t in tensors.items():
        if t.numel() != n:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, {first} {n}. Fix: pass "
                             f"the parameter's own grad and moments")


def _scalars(runtime, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             step: int) -> object:
    """The step's scalars as ``runtime``'s kernels take them (moeplug/adamw.h AdamWScalars),
    each rounded to fp32 as torch rounds it."""
    return runtime.AdamWScalars(
        lerp_weight=_f32(1 - beta1), beta2=_f32(beta2), grad_sq_coef=_f32(1 - beta2),
        decay=_f32(1 - lr * weight_decay), bias2_sqrt=_f32(math.sqrt(1 - beta2 ** step)),
        eps=_f32(eps), step_size=_f32(-lr / (1 - beta1 ** step)), step=step & _U32)


def adamw_step_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int) -> None:
    """One AdamW step of ``p`` in place (``step`` is the 1-based count after this update): the
    arithmetic of LowPrecisionMomentsAdamW's torch step in one pass, bitwise equal to it."""
    op = "adamw_step_"
    _check_step(op, {"p": p, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
    if grad.dtype != p.dtype or exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"{op}: grad ({grad.dtype}) must match p ({p.dtype}) and exp_avg "
                        f"({exp_avg.dtype}) exp_avg_sq ({exp_avg_sq.dtype}). Fix: cast them")
    runtime, extra = runtime_for(p)
    runtime.adamw_step(
        param=p.data_ptr(), grad=grad.data_ptr(), param_dtype=dtype_code(p, op, "p"),
        exp_avg=exp_avg.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(),
        moment_dtype=dtype_code(exp_avg, op, "exp_avg"), n=p.numel(),
        scalars=_scalars(runtime, lr, beta1, beta2, eps, weight_decay, step), **extra)


def adamw_step_main_(main: torch.Tensor, grad: torch.Tensor, p: torch.Tensor,
                     exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     step: int) -> None:
    """One AdamW step of the fp32 main copy ``main`` of the bf16 parameter ``p`` from its bf16
    ``grad``, writing ``p`` as the result rounded to nearest in the same pass: bitwise
    ``adamw_step_(main, grad.float(), ...)`` then ``p.copy_(main)``, with neither the fp32 grad
    copy nor the second pass (train.param_dtype: bf16)."""
    op = "adamw_step_main_"
    _check_step(op, {"main": main, "grad": grad, "p": p, "exp_avg": exp_avg,
                     "exp_avg_sq": exp_avg_sq})
    if (main.dtype, grad.dtype, p.dtype) != (torch.float32, torch.bfloat16, torch.bfloat16) \
            or exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"{op}: main must be float32, grad and p bfloat16, and the moments one "
                        f"dtype; got {main.dtype}, {grad.dtype}, {p.dtype}, {exp_avg.dtype}, "
                        f"{exp_avg_sq.dtype}. Fix: pass a bf16 parameter, its grad and its fp32 "
                        f"main copy")
    runtime, extra = runtime_for(p)
    runtime.adamw_step_main(
        main=main.data_ptr(), grad=grad.data_ptr(), param=p.data_ptr(),
        exp_avg=exp_avg.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(),
        moment_dtype=dtype_code(exp_avg, op, "exp_avg"), n=p.numel(),
        scalars=_scalars(runtime, lr, beta1, beta2, eps, weight_decay, step), **extra)
