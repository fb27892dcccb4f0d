"""MXFP8 per the OCP Microscaling Formats (MX) v1.0 spec: blocks of 32 elements along the
contraction axis share one E8M0 (power-of-two) scale; elements are FP8 E4M3 (or E5M2).

Scale (spec section 6.3, the "minimally supported" conversion):
    X = 2 ^ (floor(log2(amax)) - emax_elem)      emax_elem = 8 for E4M3 (448 = 1.75 * 2^8),
                                                 15 for E5M2
read straight off amax's fp32 exponent bits, clamped to E8M0's range [-127, 127]; a block holding
a NaN gets the E8M0 NaN code 0xFF. Elements ``x / X`` are cast with saturation. An all-zero
block gets X = 2^-127 (floored to fp32's smallest normal for the division, as torchao does);
in a NaN block the divisor is +Inf, so its finite elements become 0 and the scale carries the NaN.
"""

from __future__ import annotations

import torch

from moeplug.quant._blocks import from_blocks, to_blocks
from moeplug.quant.fp8 import E4M3, cast_saturate

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0 ** -126
EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


def e8m0_to_float(scale_u8: torch.Tensor) -> torch.Tensor:
    s = torch.exp2(scale_u8.to(torch.float32) - E8M0_BIAS)
    return torch.where(scale_u8 == E8M0_NAN, torch.full_like(s, float("nan")), s)


def _scale_code(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2) of a normal amax
    code = (exp - EMAX[dtype]).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(torch.isnan(amax), torch.full_like(code, E8M0_NAN), code).to(torch.uint8)


def quantize_mx(x: torch.Tensor, axis: int = -1, dtype: torch.dtype = E4M3):
    """Returns (q fp8 shaped like x, scales uint8 E8M0 codes [..., n_blocks]); ``axis`` is
    zero-padded to a multiple of 32 for the block split (padding never raises an amax)."""
    n = x.shape[axis]
    xb = to_blocks(x.float(), axis, BLOCK)
    amax = xb.abs().amax(-1)
    code = _scale_code(amax, dtype)
    # The divisor is the code's bits read as an fp32 exponent (0xFF -> +Inf).
    scale = (code.to(torch.int32) << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
    qb = cast_saturate(xb / scale.unsqueeze(-1), dtype)
    return from_blocks(qb, axis, n), code


def dequantize_mx(q: torch.Tensor, code: torch.Tensor, axis: int = -1) -> torch.Tensor:
    n = q.shape[axis]
    xb = to_blocks(q.float(), axis, BLOCK) * e8m0_to_float(code).unsqueeze(-1)
    return from_blocks(xb, axis, n)
