"""``grouped`` experts: every local expert in one op, moeplug.ops.grouped_ffn — ``expert_mlp``
(fused C++ SwiGLU; a GPU's grouped GEMM) for swiglu, ``grouped_mlp`` (torch activation) for
the others; under a low-precision recipe moeplug.quant's quantized one.

Legend: S rows, D hidden, F ffn hidden, L local experts.
"""

from __future__ import annotations

import torch

from moeplug.ops.grouped_ffn import expert_mlp, grouped_mlp
from moeplug.quant import active_recipe, quant_expert_mlp
from moeplug_plugins.experts._params import ExpertParams


class GroupedExperts(ExpertParams):
    # moe_act recompute (moeplug.modules.recompute): keep FC1's output, rebuild the activation.
    can_recompute_activation = True

    def __init__(self, model, num_local_experts: int) -> None:
        super().__init__(model, num_local_experts)
        # model.moe.delay_wgrad_compute (moeplug.delayed_wgrad): the backward hands dX and dp to
        # autograd first and queues the weight-gradient GEMMs to run during the dispatch's
        # exchange. Not on the emulated low-precision path (RootConfig refuses that).
        self.delay_wgrad_compute = model.moe.delay_wgrad_compute

    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        recipe = active_recipe()  # a low-precision precision plugin's recipe (emulated GEMMs)
        if recipe is not None:
            return quant_expert_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                                    self.activation, recipe, self.recompute_activation)
        if self.activation == "swiglu":  # the fused C++ SwiGLU kernel
            return expert_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                              self.recompute_activation, self.delay_wgrad_compute)
        return grouped_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                           self.activation, self.recompute_activation, self.delay_wgrad_compute)
