"""Router ``hash``: deterministic round-robin routing by token position, no learnable parameters.

Legend: T tokens, D hidden, E experts, K top-k. Token t chooses experts (t + k) mod E for k < K
(distinct because K <= E), each with weight 1/K. Every expert gets the same load, so there is
nothing to balance: aux_loss is zero.
"""

from __future__ import annotations

import torch

from moeplug.api import hookimpl, Router, RouterOutput


class HashRouter(Router):
    def __init__(self, model_cfg):
        super().__init__()
        self.num_experts = model_cfg.moe.num_experts
        self.top_k = model_cfg.moe.top_k

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        T = x_TD.shape[0]
        t_T1 = torch.arange(T, device=x_TD.device).unsqueeze(1)
        k_1K = torch.arange(self.top_k, device=x_TD.device).unsqueeze(0)
        ids_TK = (t_T1 + k_1K) % self.num_experts
        probs_TK = torch.full((T, self.top_k), 1.0 / self.top_k, device=x_TD.device)
        return RouterOutput(probs_TK=probs_TK, ids_TK=ids_TK,
                            aux_loss=torch.zeros((), device=x_TD.device))


def make_hash_router(model_cfg, options) -> HashRouter:
    return HashRouter(model_cfg)


@hookimpl
def moeplug_register_routers(registry) -> None:
    registry.add("hash", make_hash_router,
                 description="round-robin by token position: experts (t + k) mod E, weight 1/K")
