"""Differentiable runtime ops over the C++ kernels (plain-torch versions in ``reference``)."""

from moeplug.ops.grouped_ffn import expert_mlp
from moeplug.ops.permute import permute, permute_probs, unpermute
from moeplug.ops.swiglu import swiglu

__all__ = ["permute", "permute_probs", "unpermute", "swiglu", "expert_mlp"]
