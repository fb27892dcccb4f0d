"""Dense SwiGLU feed-forward (Shazeer 2020), used by the first ``first_k_dense`` layers.

Legend: N any leading dims, D hidden, F FFN hidden.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeplug.parallel.tensor_parallel import enter_for, parallelize_mlp


class SwiGLUMLP(nn.Module):
    """y = down(silu(gate x) * up x), no biases (Llama/Mixtral naming)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, groups: Any = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        # Tensor parallel (groups.tp set): gate/up column-parallel, down row-parallel.
        parallelize_mlp(self, hidden_size, ffn_hidden_size, groups)
        self._groups = groups

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        x_ND = enter_for(self._groups, x_ND)
        return self.down_proj(F.silu(self.gate_proj(x_ND)) * self.up_proj(x_ND))
