"""RMSNorm (Zhang & Sennrich 2019), as in Llama/Mixtral.

Legend: D hidden size; ``x_ND`` any leading dims N flattened conceptually.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps).

    The statistic is computed in fp32 even under bf16 autocast: a bf16 mean of squares loses the
    small components and the norm drifts (same choice as Hugging Face's MixtralRMSNorm, which our
    parity test relies on).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        in_dtype = x_ND.dtype
        x32_ND = x_ND.float()
        inv_rms_N1 = torch.rsqrt(x32_ND.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x32_ND * inv_rms_N1).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
