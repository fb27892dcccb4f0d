"""Decoder-only MoE transformer: embedding, pre-norm blocks (attention + dense MLP or MoE), head.

Legend: B batch, S sequence, D hidden, V vocabulary, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from moeplug.config import ModelConfig
from moeplug.modules.attention import Attention
from moeplug.modules.flops import flops_per_token
from moeplug.modules.mla import MLAttention
from moeplug.modules.mlp import SwiGLUMLP
from moeplug.moe import MoELayer, MoEOutput
from moeplug.modules.mtp import MTPLayer
from moeplug.modules.norm import RMSNorm
from moeplug.modules.rope import RotaryEmbedding
from moeplug.modules.stages import ModelStages
from moeplug.modules.wiring import LOCAL
from moeplug.observability.timing import stage
from moeplug.ops.discard import release


@dataclass(frozen=True)
class ModelOutput:
    """What one forward returns.

    loss = lm_loss + aux_loss; loss and lm_loss are None when no targets were given.
    aux_loss: sum over MoE layers of each router's aux loss (already times its coefficient).
    expert_counts: per MoE layer, an int64 [E] tensor of tokens routed to each expert.
    """

    logits_BSV: torch.Tensor
    loss: torch.Tensor | None
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    expert_counts: list[torch.Tensor]
    # Multi-token prediction (model.mtp_num_layers > 0, targets given): the scaled MTP loss,
    # already inside ``loss``.
    mtp_loss: torch.Tensor | None = None
    # Per MoE layer (aligned with expert_counts), the router's detached, unscaled logging values
    # (RouterOutput.losses: aux_loss, z_loss, dropped_fraction, ...); {} for MTP layers.
    router_losses: list[dict] = field(default_factory=list)


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + ffn(norm(x)); ffn is a dense SwiGLU or an MoELayer.
    ``wiring`` (set by moeplug.parallelize): what the tokens do around the MoE layer under TP."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, ffn: SwiGLUMLP | MoELayer
                 ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = MLAttention(cfg, rope) if cfg.attention == "mla" else Attention(cfg, rope)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn = ffn
        self.wiring = LOCAL

    def forward(self, x_BSD: torch.Tensor, positions_BS: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``positions_BS``: the tokens' positions in their documents (packed documents, for
        attention only; the whole CP-local sequence also under SP), or None."""
        # release(): recompute ``layernorm`` drops a norm's output once its reader has run
        # (moeplug.ops.discard; without the mark it does nothing).
        with stage("attention"):
            h_BSD = self.attn_norm(x_BSD)
            a_BSD = self.attn(h_BSD, positions_BS)
            release(h_BSD, a_BSD)
            x_BSD = x_BSD + a_BSD
        h_BSD = self.ffn_norm(x_BSD)
        if isinstance(self.ffn, MoELayer):
            # TP: the MoE layer routes only this rank's sequence chunk (Wiring.moe_tokens_in).
            moe_out = self.ffn(self.wiring.moe_tokens_in(h_BSD))
            y_BSD, aux_loss, counts_E = moe_out
            # The router's losses read the norm's output only through the gate GEMM, whose
            # backward waits for the routing weights' gradient, which comes through y.
            release(h_BSD, y_BSD)
            y_BSD = self.wiring.moe_tokens_out(y_BSD)
            return MoEOutput(x_BSD + y_BSD, aux_loss, counts_E, moe_out.router_losses,
                             moe_out.pooled_aux)
        y_BSD = self.ffn(h_BSD)
        release(h_BSD, y_BSD)
        return x_BSD + y_BSD, None, None


class MoETransformer(ModelStages, nn.Module):
    """Layer i is MoE iff ``cfg.moe_layer_pattern[i]`` (moe.layer_freq, the first
    ``first_k_dense`` forced dense); MoE layers take ``moe_layers`` in order, the others a dense
    SwiGLU MLP.

    Built for one process, its layers holding torch's default init: moeplug.parallelize
    applies the parallel layout from outside (TP/SP, CP, ...), then the builder
    (moeplug.build.build_model) calls :meth:`reset_parameters` on the parallelized model, as
    torchtitan initialises its weights after parallelizing."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, moe_layers: Sequence[MoELayer]
                 ) -> None:
        super().__init__()
        pattern = cfg.moe_layer_pattern
        # MTP blocks are the same kind as the last layer (Megatron); MoE ones come last.
        num_mtp_moe = cfg.mtp_num_layers if pattern[-1] else 0
        if len(moe_layers) != sum(pattern) + num_mtp_moe:
            raise ValueError(
                f"MoETransformer: got {len(moe_layers)} MoE layers but ModelConfig's layer "
                f"pattern (moe.layer_freq = {cfg.moe.layer_freq!r}, first_k_dense = "
                f"{cfg.first_k_dense}) has {sum(pattern)} (+ {num_mtp_moe} MTP). "
                f"Fix: build one MoELayer per MoE layer (use moeplug.build.build_model)")
        if vocab_size <= 0:
            raise ValueError(f"MoETransformer: vocab_size = {vocab_size} must be >= 1. "
                             f"Fix: pass the tokenizer's vocab_size")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        if cfg.attention == "mla":  # RoPE covers only MLA's rope dims
            self.rope = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta,
                                        interleaved=cfg.mla.rope_interleave)
        else:
            self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        moe_iter = iter(moe_layers)
        ffns = [next(moe_iter) if is_moe else SwiGLUMLP(cfg.hidden_size, cfg.dense_ffn_hidden_size)
                for is_moe in pattern]
        self.blocks = nn.ModuleList(TransformerBlock(cfg, self.rope, ffn) for ffn in ffns)
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, TransformerBlock(cfg, self.rope, next(moe_iter) if num_mtp_moe else
                                           SwiGLUMLP(cfg.hidden_size, cfg.dense_ffn_hidden_size)))
            for _ in range(cfg.mtp_num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        # The stages' TP/CP hooks (vocab-parallel head input and loss, CP's loss and aux-loss
        # grad scale): moeplug.parallelize sets them.
        self.wiring = LOCAL

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, init_std) for every matrix; output projections (attention o_proj, FFN and
        expert down_proj) use init_std / sqrt(2 * num_layers) so the residual stream's variance
        does not grow with depth (GPT-2 / Megatron scaled init). Norm weights are 1; vectors owned
        by plugins (e.g. router biases) keep the plugin's own initialisation. A plugin component
        (router, dispatcher, experts) whose class defines ``reset_parameters()`` initialises all
        of its own parameters with it instead (PyTorch's convention; a plugin's [1, E] scale
        was drawn from normal(0, init_std) before)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        own: set[int] = set()  # parameters a plugin initialises itself
        for module in self.modules():
            if not isinstance(module, MoELayer):
                continue
            for part in (module.router, module.dispatcher, module.experts):
                if isinstance(part, nn.Module) and callable(getattr(part, "reset_parameters", None)):
                    part.reset_parameters()
                    own.update(id(p) for p in part.parameters())
        for name, p in self.named_parameters():
            if id(p) in own:
                continue
            owner, _, leaf = name.rpartition(".")
            if p.ndim < 2:
                if isinstance(self.get_submodule(owner), RMSNorm):
                    p.fill_(1.0)
                continue
            # "attn.o_proj.weight" (nn.Linear) or "experts.down_proj" (a bare [L, D, F] parameter).
            is_output = bool({"o_proj", "down_proj"} & {leaf, owner.rpartition(".")[2]})
            p.normal_(0.0, out_std if is_output else std)

    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None,
                positions_BS: torch.Tensor | None = None) -> ModelOutput:
        """``positions_BS``: each token's position in its document when the rows pack several
        (moeplug.data.documents.document_positions; this CP rank's shard under CP):
        attention stays inside each document and RoPE restarts per document. None: every row
        is one sequence."""
        # The stages (moeplug.modules.stages) are the ones pipeline chunks run, one code path.
        blocks_out = self.run_blocks(self.embed_tokens(tokens_BS), self.blocks,
                                     positions_BS=positions_BS)
        head_out = self.head_and_loss(blocks_out.x_BSD, tokens_BS, targets_BS,
                                       positions_BS=positions_BS)
        lm_loss, aux_loss, mtp_loss = head_out.lm_loss, blocks_out.aux_loss, head_out.mtp_loss
        loss = None if lm_loss is None else lm_loss + aux_loss
        router_losses = list(blocks_out.router_losses)
        if mtp_loss is not None:
            aux_loss = aux_loss + head_out.mtp_aux_loss
            router_losses += [{} for _ in head_out.mtp_counts]  # mtp_losses does not pass them on
            loss = lm_loss + aux_loss + mtp_loss
        return ModelOutput(head_out.logits_BSV, loss, lm_loss, aux_loss,
                           blocks_out.expert_counts + head_out.mtp_counts, mtp_loss,
                           router_losses=router_losses)

    def finalize_step(self, group=None) -> None:
        """Call once per optimizer step, right after ``optimizer.step()``: each router applies
        its per-step updates (e.g. the expert-bias update) and resets its per-step counts.
        ``group``: the data/context-parallel process group whose ranks saw different tokens."""
        for block in [*self.blocks, *(layer.block for layer in self.mtp)]:
            if isinstance(block.ffn, MoELayer):
                block.ffn.router.finalize_step(group)

    def flops_per_token(self, seq_len: int) -> float:
        """Megatron model-FLOPs per training token (see moeplug.modules.flops)."""
        return flops_per_token(self.cfg, self.vocab_size, seq_len)
