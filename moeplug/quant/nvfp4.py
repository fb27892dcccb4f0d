"""NVFP4: FP4 E2M1 elements in 16-element blocks, each block with an FP8 E4M3 scale, plus one
fp32 per-tensor scale (two-level scaling, as NVIDIA's NVFP4 recipe and torchao's
``nvfp4_quantize``):

    per_tensor = amax(x) / (448 * 6)                    # so the largest block scale is ~448
    block_e4m3 = e4m3(clamp(amax(block) / 6 / per_tensor, tiny_e4m3, 448))
    q          = e2m1(clamp(x * ((1 / per_tensor) / block_e4m3), -6, 6))   # RNE or stochastic
    x ~= q * block_e4m3 * per_tensor

E2M1 values are {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign; payloads here are the 4-bit codes
(sign in bit 3) in a uint8, unpacked. Weights use 16 x 16 tiles (one scale serves both GEMM
orientations). Gradient inputs of the weight-gradient GEMM go through a random Hadamard
transform (``rht``) along the contraction axis, and gradients can round stochastically.
A NaN anywhere in a block makes its scale NaN, so the block dequantizes to NaN.
"""

from __future__ import annotations

import math

import torch

from moeplug.quant._blocks import from_blocks, from_tiles, to_blocks, to_tiles
from moeplug.quant.fp8 import E4M3, fp8_max

BLOCK = 16
E2M1_MAX = 6.0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between neighbouring grid values; a tie goes to the even code (RNE): down at most,
# up at 0.75 (-> 1.0), 1.75 (-> 2.0) and 3.5 (-> 4.0).
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIES_UP = torch.tensor([0.75, 1.75, 3.5])
E4M3_TINY = torch.finfo(E4M3).tiny


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; no ``.to`` call where it is there already (on the CPU a no-op, but
    the sync-free region's host-sync counter cannot tell it from a device read)."""
    return t if t.device == device else t.to(device)


def e2m1_round(a: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """|x| (already clamped to [0, 6]) -> magnitude code 0..7. ``generator``: stochastic
    rounding (round up with probability equal to the distance from the lower grid value)."""
    if generator is None:
        code = torch.bucketize(a, _on(_MIDS, a.device))  # midpoints strictly below: ties go down
        return (code + torch.isin(a, _on(_TIES_UP, a.device))).to(torch.uint8)
    grid = _on(E2M1_GRID, a.device)
    lo = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, 6)
    frac = (a - grid[lo]) / (grid[lo + 1] - grid[lo])
    u = _on(torch.rand(a.shape, generator=generator), a.device)  # a CPU stream on every device
    return (lo + (u < frac).long()).to(torch.uint8)


def e2m1_encode(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    a = x.abs().clamp(max=E2M1_MAX).nan_to_num(0.0)
    return e2m1_round(a, generator) | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    mag = _on(E2M1_GRID, code.device)[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float() / (fp8_max(E4M3) * E2M1_MAX)


def _quantize_blocks(xb: torch.Tensor, pts: torch.Tensor, generator):
    """xb [..., B] fp32 -> (codes [..., B], E4M3 block scales [...])."""
    block = xb.abs().amax(-1) / E2M1_MAX / pts
    scale = block.clamp(E4M3_TINY, fp8_max(E4M3)).to(E4M3)
    recip = (1.0 / pts) / scale.float()
    return e2m1_encode((xb * recip.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX), generator), scale


def quantize_nvfp4(x: torch.Tensor, axis: int = -1, generator: torch.Generator | None = None,
                   pts: torch.Tensor | None = None):
    """1 x 16 blocks along ``axis``: returns (codes, E4M3 scales [..., n_blocks], per_tensor)."""
    pts = per_tensor_scale(x) if pts is None else pts
    n = x.shape[axis]
    codes, scale = _quantize_blocks(to_blocks(x.float(), axis, BLOCK), pts, generator)
    return from_blocks(codes, axis, n), scale, pts


def dequantize_nvfp4(codes, scale, pts, axis: int = -1) -> torch.Tensor:
    n = codes.shape[axis]
    xb = e2m1_decode(to_blocks(codes, axis, BLOCK)) * (scale.float() * pts).unsqueeze(-1)
    return from_blocks(xb, axis, n)


def quantize_nvfp4_tiles(w: torch.Tensor, generator: torch.Generator | None = None):
    """16 x 16 tiles of a 2-D weight: (codes [R, C], scales [R/16, C/16], per_tensor)."""
    pts = per_tensor_scale(w)
    codes, scale = _quantize_blocks(to_tiles(w.float(), BLOCK), pts, generator)
    return from_tiles(codes, BLOCK, w.shape), scale, pts


def dequantize_nvfp4_tiles(codes, scale, pts) -> torch.Tensor:
    xt = e2m1_decode(to_tiles(codes, BLOCK)) * (scale.float() * pts).unsqueeze(-1)
    return from_tiles(xt, BLOCK, codes.shape)


def hadamard(n: int = BLOCK) -> torch.Tensor:
    """Sylvester Hadamard matrix divided by sqrt(n): orthonormal, H @ H.T = I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_hadamard(signs: torch.Tensor) -> torch.Tensor:
    """H @ diag(signs): the random Hadamard transform's 16 x 16 orthonormal matrix."""
    return hadamard(signs.numel()) * signs.to(torch.float32).unsqueeze(0)


def rht(x: torch.Tensor, axis: int, transform: torch.Tensor) -> torch.Tensor:
    """Apply ``transform`` to every 16-element group along ``axis``. Since the transform T is
    orthonormal, (T a)^T (T b) = a^T b: applied to both inputs of the weight-gradient GEMM along
    its contraction axis it leaves the exact product unchanged while spreading outliers before
    quantization. ``axis`` is zero-padded to a multiple of 16 and stays padded (the transform
    moves mass into the padding, so cutting it off would change the product)."""
    xb = to_blocks(x.float(), axis, transform.shape[0]) @ _on(transform.t(), x.device)
    return xb.reshape(*xb.shape[:-2], -1).movedim(-1, axis)
