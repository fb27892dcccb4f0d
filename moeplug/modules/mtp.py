"""Multi-token prediction (DeepSeek-V3 section 2.2; Megatron ``multi_token_prediction.py``).

Legend: B batch, S sequence, D hidden, V vocabulary; depth k = 1..mtp_num_layers.

MTP module k sees the main model's last hidden state (before the final norm) chained through
modules 1..k-1, and the embedding of the token k steps further on:
    h'_i = M_k [hnorm(h_i); enorm(Emb(t_{i+k}))]      M_k = ``eh_proj`` [D, 2D]
    h_i  = TransformerBlock_k(h'_i)                   causal, same kind as the last main layer
    p_i  = OutHead(norm_k(h_i))                       embedding and output head shared
    L_k  = CE(p_i, t_{i+k+1}) over the S - k positions that have that target
    L_MTP = mtp_loss_scaling_factor / K * sum_k L_k
``eh_proj`` stores its input columns as [embedding | hidden] — the order of the DeepSeek-V3
checkpoint, Megatron and vLLM — which is the paper's M with its two column blocks swapped.
Every depth runs on the whole sequence, as Megatron's ``roll_tensor``: depth k embeds t_{i+k}
where i + k < S and token 0 at the k last positions, whose loss is not taken (the mean is over
the S - k positions that have a target). Attention is causal, so those tail positions change
no kept one; they are routed like any token (the MTP MoE block's aux loss and expert counts
see all S, as Megatron's). Keeping the length S lets tensor and sequence parallelism split the
MTP blocks as any layer (moeplug.parallelize.tp.apply_tp). Context parallelism: a rank holds
two non-contiguous chunks of each sequence, so the tokens and targets k ahead come from the
model's wiring (``Wiring.ahead``: the whole sequence's ids, all-gathered over CP) and each
depth's loss is the CP group's mean over its S - k targets (``Wiring.lm_loss_ahead``); the
blocks' attention is CP's as any layer's, and their aux losses take CP's grad scale
(``Wiring.aux_loss``). Packed documents: the
block at position i attends within the document of token i, as the main model's blocks
(Megatron passes MTP the main attention mask and rotary positions).

Tensor parallelism (Megatron's MultiTokenPredictionLayer): the embedding and output head are
the main model's vocab-parallel ones; ``eh_proj`` is column-parallel with its output gathered
(then scattered over the sequence under SP); the block is tensor-parallel as any layer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeplug.config import ModelConfig
from moeplug.modules.norm import RMSNorm
from moeplug.modules.wiring import LOCAL, Wiring

# Logits of this rank's vocabulary columns for a normed hidden state (whole sequence):
# moeplug.modules.stages passes its TP-aware one.
Logits = Callable[[torch.Tensor], torch.Tensor]


class MTPLayer(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj``, a transformer ``block`` and its ``norm``
    (DeepSeek's ``shared_head.norm``)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.norm_eps)
        self.hnorm = RMSNorm(D, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = block
        self.norm = RMSNorm(D, cfg.norm_eps)

    def forward(self, h_BSD: torch.Tensor, emb_BSD: torch.Tensor,
                positions_BS: torch.Tensor | None = None):
        """Returns the block's (h_BSD, aux_loss or None, counts_E or None)."""
        x_BSD = self.eh_proj(torch.cat((self.enorm(emb_BSD), self.hnorm(h_BSD)), dim=-1))
        return self.block(x_BSD) if positions_BS is None else self.block(x_BSD, positions_BS)


def mtp_depths(cfg: ModelConfig, seq_len: int) -> int:
    """MTP depths that have a target at sequence length ``seq_len``: depth k needs S - k > 0."""
    return max(0, min(cfg.mtp_num_layers, seq_len - 1))


def mtp_hidden(layers: Sequence[MTPLayer], h_BSD: torch.Tensor, tokens_BS: torch.Tensor,
               targets_BS: torch.Tensor, embed: nn.Module,
               positions_BS: torch.Tensor | None = None, wiring: Wiring = LOCAL):
    """Each depth's normed hidden state ``norm_k(h_k)`` [B, S, D] (what the output head reads;
    [B, S/TP, D] under SP, as ``h_BSD``), plus the MoE blocks' aux losses and counts: the MTP
    blocks' part of :func:`mtp_losses`, which a pipeline's MTP stage runs when the loss sits in
    a later one.

    ``targets_BS`` must be the next-token targets (``targets[:, i] = tokens[:, i + 1]``, as
    ``moeplug.data.get_batch`` returns them): :func:`mtp_head_losses` reads depth k's from them.
    ``wiring``: the model's (its ``ahead`` and ``aux_loss`` under context parallelism).
    """
    S = tokens_BS.shape[1]  # this rank's positions (a CP shard under CP)
    next_BS = wiring.ahead(tokens_BS, 1, fill=-1)  # token ids are >= 0: -1 marks the end
    has_next = next_BS >= 0
    if not torch.equal(targets_BS[has_next], next_BS[has_next]):
        raise ValueError("multi-token prediction needs next-token targets (targets[:, i] == "
                         "tokens[:, i + 1]); got other targets. Fix: pass the batch from "
                         "moeplug.data.get_batch, or set model.mtp_num_layers=0")
    hidden, aux, counts = [], [], []
    for k, layer in enumerate(layers, start=1):
        if wiring.whole_seq_len(S) - k <= 0:
            break  # too short to have a target k + 1 ahead: no loss at this depth
        # t_{i+k}, token 0 where i + k >= S (Megatron's roll_tensor fills its tail with 0).
        emb_BSD = embed(wiring.ahead(tokens_BS, k))
        h_BSD, layer_aux, counts_E = layer(h_BSD, emb_BSD, positions_BS)
        hidden.append(layer.norm(h_BSD))
        if counts_E is not None:
            aux.append(wiring.aux_loss(layer_aux.float()))
            counts.append(counts_E)
    return hidden, aux, counts


def mtp_head_losses(hidden: Sequence[torch.Tensor], targets_BS: torch.Tensor,
                    logits: Logits, wiring: Wiring = LOCAL):
    """Per-depth cross-entropies [L_1, ..., L_K] of :func:`mtp_hidden`'s states through the
    shared output head (``logits``: the whole sequence's, this rank's vocabulary columns):
    depth k predicts t_{i+k+1} = targets[:, i + k] at its S - k first positions
    (``wiring.lm_loss_ahead``: vocab-parallel under TP, the CP group's mean under CP)."""
    return [wiring.lm_loss_ahead(logits(hn_BSD), targets_BS, k)
            for k, hn_BSD in enumerate(hidden, start=1)]


def mtp_losses(layers: Sequence[MTPLayer], h_BSD: torch.Tensor, tokens_BS: torch.Tensor,
               targets_BS: torch.Tensor, embed: nn.Module, logits: Logits,
               positions_BS: torch.Tensor | None = None, wiring: Wiring = LOCAL):
    """Per-depth cross-entropies [L_1, ..., L_K] plus the MoE blocks' aux losses and counts:
    :func:`mtp_hidden` then :func:`mtp_head_losses`. ``positions_BS``: document positions
    (packed documents), or None."""
    hidden, aux, counts = mtp_hidden(layers, h_BSD, tokens_BS, targets_BS, embed, positions_BS,
                                     wiring)
    return mtp_head_losses(hidden, targets_BS, logits, wiring), aux, counts
