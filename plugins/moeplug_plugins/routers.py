"""Built-in router ``topk``: softmax gate, top-k choice, Switch load-balancing loss.

Legend: T tokens, D hidden, E experts, K top-k.

Semantics (Mixtral / Hugging Face, Megatron ``score_function=softmax``):
    logits_TE = x_TD @ W_ED^T            in fp32 even under autocast (routing is precision-sensitive)
    scores_TE = softmax(logits_TE)       over all E experts
    ids_TK    = top-k of scores_TE
    probs_TK  = chosen scores / their sum            (renormalize=True, Mixtral)
              = chosen scores                        (renormalize=False, Megatron pre-softmax)
    aux_loss  = coeff * E * sum_i f_i * P_i,  f_i = n_i / (T*K) (no grad),  P_i = mean_t scores_TE[t, i]
A perfectly uniform router gives aux_loss / coeff == 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeplug import hookimpl
from moeplug.config import ModelConfig
from moeplug.interfaces import Router, RouterOutput


@dataclass(frozen=True)
class TopKOptions:
    # True: renormalise the K chosen probabilities to sum to 1 (Mixtral). False: keep them as
    # fractions of the softmax over all E (Megatron's moe_router_pre_softmax).
    renormalize: bool = True


class TopKRouter(Router):
    """fp32 gate ``weight`` [E, D] (named like HF Mixtral's ``gate.weight``)."""

    def __init__(self, model: ModelConfig, options: TopKOptions):
        super().__init__()
        self.num_experts = model.moe.num_experts
        self.top_k = model.moe.top_k
        self.aux_loss_coeff = float(model.moe.aux_loss_coeff)
        self.renormalize = options.renormalize
        self.weight = nn.Parameter(torch.empty(self.num_experts, model.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=model.init_std)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            logits_TE = x_TD.float() @ self.weight.t()
        scores_TE = torch.softmax(logits_TE, dim=-1)
        top_TK, ids_TK = torch.topk(scores_TE, self.top_k, dim=-1)
        probs_TK = top_TK / top_TK.sum(dim=-1, keepdim=True) if self.renormalize else top_TK
        return RouterOutput(probs_TK=probs_TK, ids_TK=ids_TK,
                            aux_loss=self._aux_loss(scores_TE, ids_TK), logits_TE=logits_TE)

    def _aux_loss(self, scores_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        T, K = ids_TK.shape
        if self.aux_loss_coeff == 0.0 or T == 0:
            return scores_TE.new_zeros(())
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts)  # integer: no grad
        f_E = counts_E.to(scores_TE.dtype) / (T * K)
        P_E = scores_TE.mean(dim=0)
        return self.aux_loss_coeff * self.num_experts * torch.sum(f_E * P_E)


def make_topk(model: ModelConfig, options: TopKOptions) -> TopKRouter:
    return TopKRouter(model, options)


@hookimpl
def moeplug_register_routers(registry) -> None:
    registry.add("topk", make_topk, options_cls=TopKOptions,
                 description="softmax top-k router with Switch aux loss (Mixtral semantics)")
