"""Shared experts: a dense MLP every token goes through, beside the routed experts.

Legend: T tokens, D hidden, F shared-expert FFN hidden size (``moe.shared_expert_ffn_hidden_size``).

Megatron ``SharedExpertMLP`` (DeepSeek-MoE / Qwen2-MoE): out = MLP(x) [* sigmoid(x . w_g)], added
to the routed experts' output by the MoE layer (stage 5). The MLP uses ``moe.activation``, like
the routed experts. Parameter names follow Hugging Face DeepSeek-V3 (``gate_proj``, ``up_proj``,
``down_proj``); ``gate_proj`` exists only for gated activations.
"""

from __future__ import annotations

import torch
from torch import nn

from moeplug.config import MoEConfig
from moeplug.ops.activations import activation_fn, is_gated


class SharedExperts(nn.Module):
    """``y = down(act(x)) * (sigmoid(x . w_g) if gated)``; act over [gate x, up x] or up x.

    Weights: ``gate_proj`` [F, D] (gated activations only), ``up_proj`` [F, D], ``down_proj``
    [D, F], and with ``shared_expert_gate`` ``output_gate`` [1, D] (w_g).
    """

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        D, F = hidden_size, moe.shared_expert_ffn_hidden_size
        if F <= 0:
            raise ValueError(f"SharedExperts: MoEConfig.shared_expert_ffn_hidden_size = {F} means "
                             f"no shared expert. Fix: build SharedExperts only when it is > 0")
        self.activation = moe.activation
        self.gate_proj = nn.Linear(D, F, bias=False) if is_gated(moe.activation) else None
        self.up_proj = nn.Linear(D, F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)
        self.output_gate = nn.Linear(D, 1, bias=False) if moe.shared_expert_gate else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        up_TF = self.up_proj(x_TD)
        # activations.py takes FC1's output: [gate | up] halves for gated activations.
        h_TX = up_TF if self.gate_proj is None else torch.cat([self.gate_proj(x_TD), up_TF], -1)
        y_TD = self.down_proj(activation_fn(self.activation)(h_TX))
        if self.output_gate is not None:
            y_TD = y_TD * torch.sigmoid(self.output_gate(x_TD))
        return y_TD
