"""Block views shared by the block-scaled formats: a tensor seen as ``[..., n_blocks, B]``.

``to_blocks(x, axis, B)`` moves ``axis`` last, zero-pads it to a multiple of B (zeros never raise a
block's amax) and splits it into blocks; ``from_blocks`` undoes all three. ``to_tiles`` /
``from_tiles`` do the same for square B x B tiles of a 2-D tensor (weights).
"""

from __future__ import annotations

import torch


def to_blocks(x: torch.Tensor, axis: int, B: int) -> torch.Tensor:
    x = x.movedim(axis, -1)
    pad = -x.shape[-1] % B
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // B, B)


def from_blocks(xb: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    # the block dims' product, not -1: a tensor with no rows (an EP rank without tokens) has
    # 0 elements and -1 would be ambiguous
    x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])[..., :n]
    return x.movedim(-1, axis)


def to_tiles(x: torch.Tensor, B: int) -> torch.Tensor:
    """[R, C] -> [R/B, C/B, B*B] (zero-padded), one row per B x B tile."""
    R, C = x.shape
    x = torch.nn.functional.pad(x, (0, -C % B, 0, -R % B))
    r, c = x.shape[0] // B, x.shape[1] // B
    return x.reshape(r, B, c, B).permute(0, 2, 1, 3).reshape(r, c, B * B)


def from_tiles(xt: torch.Tensor, B: int, shape: tuple[int, int]) -> torch.Tensor:
    r, c, _ = xt.shape
    x = xt.reshape(r, c, B, B).permute(0, 2, 1, 3).reshape(r * B, c * B)
    return x[:shape[0], :shape[1]]
