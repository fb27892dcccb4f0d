"""FP8 (E4M3 / E5M2) quantizers: tensorwise current scaling, delayed scaling, and blockwise
(1 x 128 activation/gradient blocks, 128 x 128 weight tiles, as DeepSeek-V3 and TE's
Float8BlockScaling).

Every quantizer returns the FP8 payload (a real ``torch.float8_*`` tensor) and the fp32 *scale*
that multiplied the input (``q = fp8(x * scale)``, ``x ~= q / scale``), the Transformer Engine /
torchao convention. Scales follow torchao's ``amax_to_scale``: ``max / clamp(amax, 1e-12)``
computed in fp64 then rounded to fp32, so results match torchao bit for bit.

Special values: casts saturate (anything beyond the format's max, Inf included, becomes +-max);
NaN stays NaN. A tensor (or block) whose amax is not finite gets scale 1 so that one Inf/NaN does
not wipe out its finite neighbours.
"""

from __future__ import annotations

import torch

from moeplug.quant._blocks import from_blocks, from_tiles, to_blocks, to_tiles

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12  # torchao's amax floor: an all-zero tensor gets a huge but finite scale


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def cast_saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> fp8 with saturation (torch's own cast turns overflow into NaN for e4m3fn)."""
    m = fp8_max(dtype)
    return x.float().clamp(-m, m).to(dtype)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """``fp8_max / amax`` in fp64 -> fp32; optionally rounded down to a power of two (then the
    scale multiplies exactly and only the fp8 rounding loses bits)."""
    scale = (fp8_max(dtype) / amax.double().clamp(min=EPS)).float()
    scale = torch.where(torch.isfinite(amax), scale, torch.ones_like(scale))
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cast_saturate(x.float() * scale, dtype)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = E4M3, power_of_2: bool = False):
    """Current scaling: one scale from this tensor's own amax. Returns (q, scale [])."""
    amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    scale = amax_to_scale(amax, dtype, power_of_2)
    return quantize_with_scale(x, scale, dtype), scale


def quantize_blockwise(x: torch.Tensor, axis: int = -1, block: int = 128, dtype: torch.dtype = E4M3,
                       power_of_2: bool = True):
    """1 x ``block`` scaling along ``axis``: returns (q shaped like x, scales [..., n_blocks])."""
    n = x.shape[axis]
    xb = to_blocks(x.float(), axis, block)
    scale = amax_to_scale(xb.abs().amax(-1), dtype, power_of_2)
    qb = quantize_with_scale(xb, scale.unsqueeze(-1), dtype)
    return from_blocks(qb, axis, n), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, axis: int = -1,
                         block: int = 128) -> torch.Tensor:
    n = q.shape[axis]
    return from_blocks(to_blocks(q.float(), axis, block) / scale.unsqueeze(-1), axis, n)


def quantize_tiles(w: torch.Tensor, block: int = 128, dtype: torch.dtype = E4M3,
                   power_of_2: bool = True):
    """``block`` x ``block`` tiles of a 2-D weight: returns (q [R, C], scales [R/b, C/b]). The
    same payload serves the forward (rows) and the data-gradient GEMM (columns)."""
    wt = to_tiles(w.float(), block)
    scale = amax_to_scale(wt.abs().amax(-1), dtype, power_of_2)
    return from_tiles(quantize_with_scale(wt, scale.unsqueeze(-1), dtype), block, w.shape), scale


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    return from_tiles(to_tiles(q.float(), block) / scale.unsqueeze(-1), block, q.shape)


class DelayedScaler:
    """Delayed scaling for one tensor role, as Transformer Engine's ``DelayedScaling``: every
    GEMM of a step quantizes with the scale fixed at the end of the previous step; the step's
    amaxes are recorded (``pending``, their max, on the device: no host sync per GEMM) and
    ``commit`` appends them to the history once the step is over (after the trainer reduced
    them over the ranks). The new scale is ``fp8_max / amax`` of the history (``max`` or
    ``most_recent`` of the last ``history_len`` entries), divided by ``2^margin``; a zero or
    non-finite amax keeps the previous scale (TE's rule). The first step runs at scale 1 (TE's
    initial scale)."""

    def __init__(self, history_len: int, algo: str, dtype: torch.dtype, margin: int = 0):
        self.history_len, self.algo, self.dtype, self.margin = history_len, algo, dtype, margin
        self.history = torch.empty(0)
        self.scale = torch.ones((), dtype=torch.float32)
        self.pending: torch.Tensor | None = None

    def quantize(self, x: torch.Tensor, record: bool = True):
        """(q, scale); ``record`` notes x's amax for this step (the backward's second use of
        an operand, and recomputed forwards, see the same values: recording is idempotent)."""
        q = quantize_with_scale(x, self.scale, self.dtype)
        if record and x.numel():
            amax = x.detach().abs().amax().float()
            self.pending = amax if self.pending is None else torch.maximum(self.pending, amax)
        return q, self.scale

    def commit(self, amax: torch.Tensor | None) -> None:
        """End of step: append ``amax`` (the step's, reduced; None when no rank recorded one)
        to the history and derive the next step's scale."""
        self.pending = None
        if amax is None:
            return
        self.history = torch.cat([self.history, amax.reshape(1).float().cpu()])
        self.history = self.history[-self.history_len:]
        top = self.history.amax() if self.algo == "max" else self.history[-1]
        if torch.isfinite(top) and top > 0:  # 2^margin: a power of two, exact in fp32
            self.scale = amax_to_scale(top, self.dtype) / 2.0 ** self.margin

    def restore(self, history: list, scale: float) -> None:
        """A checkpoint's history and scale."""
        self.history = torch.tensor(history, dtype=torch.float32)[-self.history_len:]
        self.scale = torch.tensor(scale, dtype=torch.float32)
