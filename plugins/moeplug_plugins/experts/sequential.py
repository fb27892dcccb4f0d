"""``sequential`` experts: a Python loop, one expert at a time. The obviously-correct backend.

Legend: S rows, D hidden, F ffn hidden, L local experts; n rows of one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeplug_plugins.experts._params import ExpertParams


class SequentialExperts(ExpertParams):
    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        Fh = self.ffn_hidden_size
        ys = []
        start = 0
        for e, n in enumerate(counts_L.tolist()):
            x_nD, p_n = x_SD[start:start + n], probs_S[start:start + n]
            start += n
            h_n2F = x_nD @ self.gate_up_proj[e].t()
            # Routing weight after the activation (Megatron weighted SwiGLU): rows stay unweighted.
            a_nF = F.silu(h_n2F[:, :Fh]) * h_n2F[:, Fh:] * p_n.unsqueeze(-1).to(h_n2F.dtype)
            ys.append(a_nF @ self.down_proj[e].t())
        return torch.cat(ys, dim=0)
