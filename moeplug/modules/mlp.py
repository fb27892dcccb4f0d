"""Dense SwiGLU feed-forward (Shazeer 2020), used by the first ``first_k_dense`` layers.

Legend: N any leading dims, D hidden, F FFN hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeplug.modules.wiring import LOCAL


class SwiGLUMLP(nn.Module):
    """y = down(silu(gate x) * up x), no biases (Llama/Mixtral naming). Built for one process;
    moeplug.parallelize makes gate/up column- and down row-parallel (TP) and sets ``wiring``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.wiring = LOCAL

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        x_ND = self.wiring.enter(x_ND)
        return self.down_proj(F.silu(self.gate_proj(x_ND)) * self.up_proj(x_ND))
