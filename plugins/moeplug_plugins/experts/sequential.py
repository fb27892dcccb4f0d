"""``sequential`` experts: a Python loop, one expert at a time. The obviously-correct backend.

Legend: S rows, D hidden, F ffn hidden, L local experts; n rows of one expert;
X = FC1 features (2F for gated activations, F otherwise).
"""

from __future__ import annotations

import torch

from moeplug.api import activation_fn, active_recipe, quant_expert_mlp
from moeplug_plugins.experts._params import ExpertParams


class SequentialExperts(ExpertParams):
    # runtime.sync_free's budget rows are rows like any others: B per expert, empty slots zero
    # rows of weight 0 (computed for nothing, but correctly). Not capturable: the reference
    # backend reads its counts on the host.
    budget_rows = True
    runs_recipe = True  # quant_expert_mlp under active_recipe()

    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        recipe = active_recipe()  # a low-precision precision plugin's recipe (emulated GEMMs)
        if recipe is not None:
            return quant_expert_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                                    self.activation, recipe)
        act = activation_fn(self.activation)
        ys = []
        start = 0
        for e, n in enumerate(counts_L.tolist()):
            x_nD, p_n = x_SD[start:start + n], probs_S[start:start + n]
            start += n
            h_nX = x_nD @ self.gate_up_proj[e].t()  # X = 2F (gated) or F
            # Routing weight after the activation (Megatron weighted SwiGLU): rows stay unweighted.
            a_nF = act(h_nX) * p_n.unsqueeze(-1).to(h_nX.dtype)
            ys.append(a_nF @ self.down_proj[e].t())
        return torch.cat(ys, dim=0)
