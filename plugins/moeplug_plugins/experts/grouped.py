"""``grouped`` experts: every local expert in one call to ``moeplug.ops.expert_mlp``.

Legend: S rows, D hidden, F ffn hidden, L local experts.
"""

from __future__ import annotations

import torch

from moeplug.ops import expert_mlp
from moeplug_plugins.experts._params import ExpertParams


class GroupedExperts(ExpertParams):
    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        return expert_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj)
