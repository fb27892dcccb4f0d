"""``grouped`` experts: every local expert in one op, moeplug.ops.grouped_ffn — ``expert_mlp``
(fused C++ SwiGLU) for swiglu, ``grouped_mlp`` (torch activation) for the others; on a GPU
moeplug.ops.cuda_ffn (a grouped GEMM, or a batched one when every expert has the same rows);
under a low-precision recipe moeplug.quant's quantized one. runtime.sync_free's budget rows:
packed on the CPU (``forward_packed``, no FLOPs on padding), the batched GEMM on a GPU.

Legend: S rows, D hidden, F ffn hidden, L local experts, G chunks.
"""

from __future__ import annotations

import torch

from moeplug.api import (active_recipe, batched_ffn, expert_mlp, grouped_ffn_packed, grouped_mlp,
                         quant_expert_mlp, same_rows)
from moeplug_plugins.experts._params import ExpertParams


class GroupedExperts(ExpertParams):
    # moe_act recompute (moeplug.modules.recompute): keep FC1's output, rebuild the activation.
    can_recompute_activation = True
    # runtime.sync_free: budget rows and their packed form; runtime.capture compiles or records
    # both (the ops are custom ops of static shape on the CPU, batched GEMMs on a GPU).
    budget_rows = True
    runs_recipe = True  # quant_expert_mlp under active_recipe()
    packed_rows = True
    capturable = True

    def __init__(self, model, num_local_experts: int) -> None:
        super().__init__(model, num_local_experts)
        # model.moe.delay_wgrad_compute (moeplug.ops.delayed_wgrad): the backward hands dX and dp to
        # autograd first and queues the weight-gradient GEMMs to run during the dispatch's
        # exchange. Not on the emulated low-precision path (RootConfig refuses that).
        self.delay_wgrad_compute = model.moe.delay_wgrad_compute

    def forward(self, x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        recipe = active_recipe()  # a low-precision precision plugin's recipe (emulated GEMMs)
        if recipe is not None:
            return quant_expert_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                                    self.activation, recipe, self.recompute_activation)
        if x_SD.device.type == "cuda" and same_rows(counts_L):
            return batched_ffn(x_SD, probs_S, self.gate_up_proj, self.down_proj, self.activation)
        if self.activation == "swiglu":  # the fused C++ SwiGLU kernel (a GPU: grouped_mm)
            return expert_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                              self.recompute_activation, self.delay_wgrad_compute)
        return grouped_mlp(x_SD, probs_S, counts_L, self.gate_up_proj, self.down_proj,
                           self.activation, self.recompute_activation, self.delay_wgrad_compute)

    def forward_packed(self, x_GSD: torch.Tensor, counts_GL: torch.Tensor) -> torch.Tensor:
        return grouped_ffn_packed(x_GSD, counts_GL, self.gate_up_proj, self.down_proj,
                                  self.activation)
