"""The model's forward as three stages that a whole model and a pipeline chunk both run.

Legend: B batch, S sequence (this rank's: S/CP under context parallelism, S/TP between blocks
under sequence parallelism), D hidden, V vocabulary (V/TP under tensor parallelism).

    embed_tokens(tokens_BS)                      -> x_BSD          first stage
    run_blocks(x_BSD, blocks, first_layer)       -> BlocksOutput   any stage
    head_and_loss(x_BSD, tokens_BS, targets_BS)  -> HeadOutput     last stage (+ MTP)

Packed documents (``data.document_mask``): ``run_blocks`` and ``head_and_loss`` (for the MTP
blocks) take the tokens' document positions ``positions_BS``, which only attention reads
(moeplug.data.documents); every stage of a pipeline gets them with the micro-batch.

:class:`ModelStages` is a mixin: :class:`moeplug.modules.transformer.MoETransformer` and
:class:`moeplug.parallelize.pipeline.PipelineChunk` both inherit it, so a pipelined run executes the
very code of the single-process forward (TP: vocab-parallel embedding/head/CE and SP
scatter/gather at the ends; CP: the CP group's token-mean loss and the aux-loss grad scale; MTP:
the embedding and output head shared with the main model). It reads only these attributes of
its host: ``cfg``, ``wiring`` (moeplug.modules.wiring: the TP/CP hooks moeplug.parallelize
installs), ``embed``, ``norm``, ``head`` (None when tied), ``mtp``. A pipeline chunk holds the pieces of its stage under the model's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from moeplug.modules.mtp import mtp_head_losses, mtp_losses
from moeplug.modules.recompute import block_chunks, chunk_is_checkpointed, run_chunk
from moeplug.quant.linear import block_scope_factory
from moeplug.routing.pooled import pooled_aux_loss


@dataclass(frozen=True)
class BlocksOutput:
    """x_BSD after the blocks; aux_loss: their routers' aux losses summed (times coefficient,
    grad scaled by CP); expert_counts / router_losses: per MoE block, in block order."""

    x_BSD: torch.Tensor
    aux_loss: torch.Tensor
    expert_counts: list[torch.Tensor]
    router_losses: list[dict]


@dataclass(frozen=True)
class HeadOutput:
    """logits_BSV: this TP rank's vocabulary columns. lm_loss / mtp_loss: None without targets
    (mtp_loss also None without MTP layers). mtp_aux_loss: the MTP MoE blocks' aux losses summed
    (zero when none); mtp_counts: their expert counts, per MTP MoE block."""

    logits_BSV: torch.Tensor
    lm_loss: torch.Tensor | None
    mtp_loss: torch.Tensor | None
    mtp_aux_loss: torch.Tensor
    mtp_counts: list[torch.Tensor]


class ModelStages:
    """Mixin: the stages of the forward over the host's ``embed`` / blocks / ``norm`` / head."""

    def output_weight(self) -> torch.Tensor:
        """The output head's [V, D] weight: the embedding's when tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def embed_tokens(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Token embeddings; under SP the vocab-parallel embedding's reduce-scatter already
        leaves this rank's [B, S/TP, D] chunk. Positions need no input: attention applies RoPE
        at each held token's global position (CP layout) itself."""
        return self.embed(tokens_BS)

    def run_blocks(self, x_BSD: torch.Tensor, blocks: Iterable[torch.nn.Module],
                   first_layer: int = 0, positions_BS: torch.Tensor | None = None) -> BlocksOutput:
        """``blocks``: the model's layers ``first_layer``, ``first_layer + 1``, ... (a pipeline
        chunk's contiguous range). ``positions_BS``: document positions (packed documents)."""
        aux_loss = torch.zeros((), device=x_BSD.device, dtype=torch.float32)
        expert_counts: list[torch.Tensor] = []
        router_losses: list[dict] = []
        rc = self.cfg.recompute  # full recompute: chunks of blocks keep only their input
        blocks = list(blocks)
        # The precision recipe of each block, decided now: a recomputed chunk re-runs its
        # blocks during backward, outside the precision's plan. bf16_first/last_layers count
        # the model's layers (Megatron's), whichever pipeline chunk runs them.
        scopes = [block_scope_factory(first_layer + i, self.cfg.num_layers)
                  for i in range(len(blocks))]
        block_outs, start = [], 0
        for i, chunk in enumerate(block_chunks(blocks, rc)):
            block_outs += run_chunk(chunk, x_BSD, chunk_is_checkpointed(i, rc),
                                    scopes[start:start + len(chunk)], positions_BS)
            start += len(chunk)
            x_BSD = block_outs[-1][0]
        pooled = []  # the layers' parts of a loss over all of them (routing.pooled)
        for block_out in block_outs:
            _, layer_aux, counts_E = block_out
            if counts_E is not None:
                aux_loss = aux_loss + layer_aux.float()
                expert_counts.append(counts_E)
                router_losses.append(block_out.router_losses)
                if block_out.pooled_aux is not None:
                    pooled.append(block_out.pooled_aux)
        if pooled:  # one pipeline chunk holds every layer: the router refuses PP (and TP, CP)
            aux_loss = aux_loss + pooled_aux_loss(pooled)
        # CP: grad x CP, as sync_gradients averages over CP (context_parallel.cp_aux_loss).
        # Linear, so applying it per pipeline chunk equals applying it to the model's sum.
        aux_loss = self.wiring.aux_loss(aux_loss)
        return BlocksOutput(x_BSD, aux_loss, expert_counts, router_losses)

    def head_and_loss(self, x_BSD: torch.Tensor, tokens_BS: torch.Tensor | None,
                      targets_BS: torch.Tensor | None, *,
                      mtp_hidden_states: list[torch.Tensor] | None = None,
                      positions_BS: torch.Tensor | None = None) -> HeadOutput:
        """Final norm, output head, LM loss and (with targets) the MTP losses. ``x_BSD`` is the
        last block's output before the final norm (MTP depth 1 reads it); ``tokens_BS`` is
        needed only by MTP. ``mtp_hidden_states``: the MTP depths' normed hidden states when an
        earlier pipeline stage ran the MTP blocks (:func:`moeplug.modules.mtp.mtp_hidden`); then
        only their logits and losses are computed here (their aux losses are that stage's).
        ``positions_BS``: document positions (packed documents; the MTP blocks' attention), or
        None."""
        # TP: logits_BSV holds this rank's V/TP vocabulary columns; [B, S, V] is never built.
        logits_BSV = self.vocab_logits(self.norm(x_BSD))
        mtp_aux = torch.zeros((), device=x_BSD.device, dtype=torch.float32)
        if targets_BS is None:
            return HeadOutput(logits_BSV, None, None, mtp_aux, [])
        # fp32; vocab-parallel under TP, the CP group's token mean under CP.
        lm_loss = self.wiring.lm_loss(logits_BSV, targets_BS)
        if not self.cfg.mtp_num_layers:
            return HeadOutput(logits_BSV, lm_loss, None, mtp_aux, [])
        if tokens_BS is None:
            raise ValueError("head_and_loss: ModelConfig.mtp_num_layers = "
                             f"{self.cfg.mtp_num_layers} needs the input tokens (MTP embeds the "
                             "tokens k steps ahead) but tokens_BS is None. Fix: pass the "
                             "micro-batch's tokens to the last pipeline stage")
        if mtp_hidden_states is None:
            depth_losses, aux, mtp_counts = mtp_losses(
                self.mtp, x_BSD, tokens_BS, targets_BS, self.embed, self.vocab_logits,
                positions_BS, self.wiring)
        else:
            depth_losses, aux, mtp_counts = mtp_head_losses(
                mtp_hidden_states, targets_BS, self.vocab_logits, self.wiring), [], []
        mtp_loss = (self.cfg.mtp_loss_scaling_factor / self.cfg.mtp_num_layers) * sum(
            depth_losses, torch.zeros((), device=x_BSD.device))
        return HeadOutput(logits_BSV, lm_loss, mtp_loss, sum(aux, mtp_aux), mtp_counts)

    def vocab_logits(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The output head on a normed hidden state: the whole sequence's logits of this TP
        rank's vocabulary columns (under SP the sequence is gathered first)."""
        return F.linear(self.wiring.enter(h_BSD), self.output_weight())
