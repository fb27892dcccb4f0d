"""Pipeline parallelism applied from outside: which layers each pipeline rank holds, as model
chunks of the built model (the embedding copies' grad sum: moeplug.parallel.embedding_group).

Legend: B micro-batch, S sequence, D hidden, V vocabulary; P pipeline ranks (PP), C model chunks
per rank (VPP, "virtual stages"), N layers, K MTP depths.

Partition: a :class:`moeplug.config.pipeline_layout.PipelineLayout` (from
``ParallelConfig.layer_layout``: an even split, uneven first / last stages, the embedding / loss
counted as layers, or Megatron's layout string) says what virtual stage ``v = c * P + r``
(chunk c of rank r) holds: the embedding (v = 0), consecutive decoder layers, the MTP blocks
(one stage, by default the last), the final norm + head + loss (the last stage, v = P·C - 1).
E.g. N = 8, P = 2, C = 2 split evenly: rank 0 holds layers {0,1} and {4,5}, rank 1 {2,3} and
{6,7}; ``E|ttt|t|L`` at P = 2: rank 0 the embedding alone and layer 3, rank 1 layers 0-2 and
the loss alone. A stage may hold nothing at all: it passes its input on.

Activations between stages are [B, S, D] (S / TP under SP). After a stage of MTP blocks that
is not the last, they are the main hidden state and each MTP depth's normed hidden state,
concatenated along the sequence ([B, (1 + K) S, D], S / TP each under SP, this rank's CP
shard under CP): the loss stage computes every logit, as Megatron's MTP block hands its hidden
states to the output layer.

Embedding copies: the embedding lives on every rank that needs it -- the first stage, the MTP
stage (MTP embeds the tokens k steps ahead), the last stage when the head is the tied
embedding -- each a copy with the first stage's initial value, whose grads are summed over the
embedding group (those pipeline ranks, Megatron's embedding group and
``_allreduce_word_embedding_grads``) after the backwards.

Chunks reuse the single-process model's submodules under the same names (``embed``,
``blocks.<global layer index>``, ``norm``, ``head``, ``mtp``), so a chunk's state_dict keys are a
subset of the full model's: :func:`load_pipeline_shard` loads a full checkpoint into any layout
and checkpoints can be resharded by key.

Chunks run the model's own forward stages (embed_tokens / run_blocks / head_and_loss), so
tensor/sequence, context and expert parallelism and MTP compose with PP without a second copy
of the loss code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from moeplug.config import ParallelConfig
from moeplug.config.pipeline_layout import PipelineLayout, VirtualStage
from moeplug.modules.mtp import mtp_depths, mtp_hidden
from moeplug.modules.stages import ModelStages
from moeplug.modules.transformer import MoETransformer
from moeplug.moe import MoELayer


@dataclass(frozen=True)
class ChunkOutput:
    """What a chunk's forward returns for one micro-batch.

    x_BSD: the activation for the next virtual stage (None on the last one; after the MTP
        stage, the concatenation described in the module docstring).
    lm_loss: mean cross-entropy of the micro-batch (last virtual stage only, else None).
    aux_loss: sum of this chunk's MoE routers' aux losses (already times their coefficient),
        its MTP blocks' included.
    expert_counts: per MoE layer of the chunk (MTP blocks last), int64 [E] tokens per expert.
    mtp_loss: the scaled multi-token-prediction loss (last stage with MTP layers, else None).
    """

    x_BSD: torch.Tensor | None
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    expert_counts: list[torch.Tensor]
    mtp_loss: torch.Tensor | None = None


def model_layout(pipe: ParallelConfig, model_cfg: Any, pp: int | None = None) -> PipelineLayout:
    """The pipeline layout of ``model_cfg`` under ``pipe`` (``pp`` ranks, default pipe.pp)."""
    return pipe.layer_layout(model_cfg.num_layers, model_cfg.mtp_num_layers, pp)


class PipelineChunk(ModelStages, nn.Module):
    """One virtual stage of a :class:`MoETransformer` (:class:`VirtualStage`: embedding, a
    block of consecutive layers, MTP blocks, norm + head + loss, any of them), under the full
    model's parameter names. Runs the model's own stages
    (:class:`moeplug.modules.stages.ModelStages`), so TP/SP, CP and MTP behave exactly as in
    ``MoETransformer.forward``.

    A stage other than the first that needs the embedding (MTP, a tied head) holds a second
    copy of it (same name, same initial value), flagged ``pipeline_copy = True`` on ranks other
    than the first so the global grad norm counts the parameter once. Its grad is summed with
    the others over ``embedding_group`` by
    :func:`moeplug.parallel.embedding_group.allreduce_embedding_grads` (the schedule calls
    it), so every copy gets the single-process grad and they stay equal under the optimizer."""

    def __init__(self, model: MoETransformer, stage: VirtualStage, *, index: int = 0,
                 mtp_stage: int | None = None, embedding_group: Any = None) -> None:
        super().__init__()
        self.is_first, self.is_last = stage.embedding, stage.loss
        self.layers = stage.layers
        # After a standalone MTP stage the activation carries the MTP hidden states too.
        self.receives_mtp = mtp_stage is not None and index > mtp_stage
        self.runs_mtp = bool(stage.mtp)
        # The model's TP/CP hooks (moeplug.parallelize), which its stages call.
        self.cfg, self.wiring = model.cfg, model.wiring
        # The model's moeplug.runtime.stash.ModelRuntime, on every chunk: a rank whose stages hold no MoE
        # layer still takes part in the stash's and sync-free's per-step collectives.
        self.runtime = model.runtime
        self.hidden_size = model.cfg.hidden_size  # the [B, S, D] activation the stages exchange
        # Set only on a stage whose embedding has a twin on another pipeline rank.
        self.embedding_group = embedding_group
        if stage.embedding or stage.mtp or (stage.loss and model.cfg.tie_embeddings):
            self.embed = model.embed
        # Keys are global layer indices, so parameter names match the full model's blocks.<i>.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in stage.layers})
        if stage.mtp:
            self.mtp = model.mtp
        if stage.loss:
            self.norm = model.norm
            self.head = model.head
            if not stage.mtp:  # the MTP blocks ran in an earlier stage (or there are none)
                self.mtp = nn.ModuleList()

    def activation_shape(self, tokens_BS: torch.Tensor) -> tuple[int, int, int]:
        """Shape of the [B, S, D] activation this chunk receives for ``tokens_BS`` (this rank's
        CP shard): under SP each TP rank holds S / TP positions, as between any two blocks;
        after the MTP stage the MTP hidden states follow along S."""
        B, S = tokens_BS.shape
        s = self.wiring.local_seq_len(S)
        if self.receives_mtp:  # the main hidden state and one per MTP depth, each [B, s, D]
            # the depths the whole sequence has (S x CP under CP), as mtp_hidden counts them
            return (B, s * (1 + mtp_depths(self.cfg, self.wiring.whole_seq_len(S))),
                    self.hidden_size)
        return (B, s, self.hidden_size)

    def forward(self, x: torch.Tensor, targets_BS: torch.Tensor | None = None,
                tokens_BS: torch.Tensor | None = None,
                positions_BS: torch.Tensor | None = None) -> ChunkOutput:
        """``x`` is tokens_BS on the first virtual stage, else the previous stage's x_BSD.
        ``targets_BS`` and ``tokens_BS`` are read by the loss and MTP stages.
        ``positions_BS``: the micro-batch's document positions on every stage (packed
        documents), or None."""
        if self.is_first:
            tokens_BS = x
            x = self.embed_tokens(x)
        mtp_in = None  # the MTP depths' normed hidden states, from an earlier stage
        if self.receives_mtp:
            x, *mtp_in = x.chunk(1 + mtp_depths(self.cfg, self.wiring.whole_seq_len(
                tokens_BS.shape[1])), dim=1)
        blocks_out = self.run_blocks(x, self.blocks.values(), self.layers.start, positions_BS)
        x, aux, counts = blocks_out.x_BSD, blocks_out.aux_loss, blocks_out.expert_counts
        if self.runs_mtp and not self.is_last:
            if tokens_BS is None or targets_BS is None:
                raise ValueError("PipelineChunk: the MTP stage needs the micro-batch's tokens "
                                 "and targets. Fix: pass them to every stage's forward")
            mtp_in, mtp_aux, mtp_counts = mtp_hidden(self.mtp, x, tokens_BS, targets_BS,
                                                     self.embed, positions_BS, self.wiring)
            aux, counts = sum(mtp_aux, aux), counts + mtp_counts
        if not self.is_last:
            out = x if mtp_in is None else torch.cat([x, *mtp_in], dim=1)
            return ChunkOutput(out, None, aux, counts)
        head_out = self.head_and_loss(x, tokens_BS, targets_BS, mtp_hidden_states=mtp_in,
                                      positions_BS=positions_BS)
        return ChunkOutput(None, head_out.lm_loss, aux + head_out.mtp_aux_loss,
                           counts + head_out.mtp_counts, head_out.mtp_loss)

    def finalize_step(self, group: Any = None) -> None:
        """Per optimizer step, after ``optimizer.step()`` (see MoETransformer.finalize_step)."""
        blocks = [*self.blocks.values(), *(layer.block for layer in getattr(self, "mtp", ()))]
        for block in blocks:
            if isinstance(block.ffn, MoELayer):
                block.ffn.router.finalize_step(group)


def split_model(model: MoETransformer, pipe: ParallelConfig, pp: int, pp_rank: int,
                embedding_group: Any = None) -> list[PipelineChunk]:
    """The ``vpp`` chunks of pipeline rank ``pp_rank`` (references to ``model``'s submodules:
    drop ``model`` afterwards and the other ranks' layers are freed). ``embedding_group``: from
    :func:`moeplug.parallel.embedding_group.build_embedding_group` (None with one process, or
    when nothing is shared)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank = {pp_rank} is outside [0, {pp}). Fix: pass "
                         "groups.rank_in('pp') and groups.size('pp')")
    layout = model_layout(pipe, model.cfg, pp)
    shared = len(layout.embedding_ranks(model.cfg.tie_embeddings)) > 1
    chunks = []
    for c, stage in enumerate(layout.rank_stages(pp_rank)):
        chunk = PipelineChunk(model, stage, index=c * pp + pp_rank, mtp_stage=layout.mtp_stage,
                              embedding_group=embedding_group if shared else None)
        if not hasattr(chunk, "embed"):
            chunk.embedding_group = None
        elif pp_rank != 0:  # the first rank holds the original; the norm counts it once
            for p in chunk.embed.parameters():
                p.pipeline_copy = True
        chunks.append(chunk)
    return chunks


def pipeline_state_dict(chunks: list[PipelineChunk]) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers under the full model's names (a subset of its keys)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        out.update(chunk.state_dict())
    return out


@torch.no_grad()
def load_pipeline_shard(chunks: list[PipelineChunk], full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's entries of a full-model state_dict into its chunks (strict: every chunk
    key must be present; entries for other ranks' layers are ignored). Experts sharded by EP
    inside a chunk are loaded by moeplug.parallel.sharding.load_expert_shard instead."""
    for chunk in chunks:
        own = chunk.state_dict()
        missing = sorted(k for k in own if k not in full_state)
        if missing:
            raise KeyError(f"load_pipeline_shard: the state_dict lacks {len(missing)} key(s) of "
                           f"this pipeline chunk, e.g. {missing[:3]}. Fix: pass the full "
                           "single-process model's state_dict (same model config)")
        for k, t in own.items():
            src = full_state[k]
            if src.shape != t.shape:
                raise ValueError(f"load_pipeline_shard: {k} has shape {tuple(src.shape)} in the "
                                 f"state_dict but {tuple(t.shape)} in the chunk. Fix: use a "
                                 "checkpoint of the same model config (and EP layout)")
            t.copy_(src)
