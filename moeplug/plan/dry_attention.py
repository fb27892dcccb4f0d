"""The dry run's attention: a GPU's fused kernel, not SDPA's math fallback.

On the meta device ``F.scaled_dot_product_attention`` picks its math path, which saves the
[B, H, S, S] probabilities (576 GiB for one DeepSeek-V3 micro-batch at 4,096 tokens); on a GPU
it runs a fused kernel that saves q, k, v, the output and one log-sum-exp per row. This
function mode sends meta SDPA calls without a mask to torch's memory-efficient attention op
(its meta kernels give the shapes, its autograd formula the backward), GQA's shared kv heads
kept unrepeated in what backward saves, as a fused GQA kernel keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_aten = torch.ops.aten


def _repeat(kv_BGSD: torch.Tensor, heads: int) -> torch.Tensor:
    G = kv_BGSD.shape[1]
    return kv_BGSD if G == heads else kv_BGSD.repeat_interleave(heads // G, dim=1)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        H = q.shape[1]
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            q, _repeat(k, H), _repeat(v, H), None, True, 0.0, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        H, G = q.shape[1], k.shape[1]
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, _repeat(k, H), _repeat(v, H), None, out, lse, seed, offset, 0.0,
            [True, True, True, False], ctx.is_causal, scale=ctx.scale)
        if G != H:  # each kv head's gradient: the sum over the query heads sharing it
            dk = dk.unflatten(1, (G, H // G)).sum(2)
            dv = dv.unflatten(1, (G, H // G)).sum(2)
        return dq, dk, dv, None, None


class FusedAttentionMode(TorchFunctionMode):
    """Meta SDPA without a mask -> :class:`_FusedAttention`; anything else as it was."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].is_meta \
                and kwargs.get("attn_mask") is None and kwargs.get("dropout_p", 0.0) == 0.0:
            q, k, v = args[:3]
            return _FusedAttention.apply(q, k, v, bool(kwargs.get("is_causal", False)),
                                         kwargs.get("scale"))
        return func(*args, **kwargs)
