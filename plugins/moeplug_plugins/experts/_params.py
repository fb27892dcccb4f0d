"""The parameters every built-in experts backend shares (Hugging Face Mixtral layout).

Legend: L local experts, F expert FFN hidden size, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from moeplug.api import ConfigError, Experts, fc1_rows, ModelConfig


class ExpertParams(Experts):
    """``gate_up_proj`` [L, 2F, D] (gate rows first, then up rows) for gated activations
    (swiglu, geglu), [L, F, D] for plain ones (gelu, squared_relu); ``down_proj`` [L, D, F].
    ``activation`` is ``model.moe.activation`` (see moeplug.ops.activations)."""

    def __init__(self, model: ModelConfig, num_local_experts: int):
        super().__init__()
        if not isinstance(num_local_experts, int) or num_local_experts <= 0:
            raise ConfigError(f"num_local_experts = {num_local_experts!r}: must be a positive integer. "
                              f"Fix: pass num_experts // expert_parallel_size")
        L, F, D = num_local_experts, model.moe.ffn_hidden_size, model.hidden_size
        self.num_local_experts = L
        self.ffn_hidden_size = F
        self.activation = model.moe.activation
        self.gate_up_proj = nn.Parameter(torch.empty(L, fc1_rows(self.activation, F), D,
                                                     dtype=torch.float32))
        self.down_proj = nn.Parameter(torch.empty(L, D, F, dtype=torch.float32))
        nn.init.normal_(self.gate_up_proj, std=model.init_std)
        nn.init.normal_(self.down_proj, std=model.init_std)
