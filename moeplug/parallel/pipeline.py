"""Pipeline parallelism, part 1: which layers each pipeline rank holds, as model chunks.

Legend: B micro-batch, S sequence, D hidden, V vocabulary; P pipeline ranks (PP), C model chunks
per rank (VPP, "virtual stages"), N layers.

Partition (Megatron-Core semantics, ``get_num_layers_to_build`` / ``get_transformer_layer_offset``):
  * Rank r holds ``n_r`` layers: ``num_layers_in_first_stage`` on rank 0 and
    ``num_layers_in_last_stage`` on rank P-1 when set, the remaining layers split evenly over the
    other ranks (every rank gets N / P when neither is set).
  * With C > 1 each rank's layers split evenly into C chunks; chunk c of rank r is virtual stage
    ``v = c * P + r``, and virtual stages hold consecutive layer blocks in v order. E.g. N = 8,
    P = 2, C = 2: rank 0 holds layers {0,1} and {4,5}, rank 1 holds {2,3} and {6,7}.
  * The first virtual stage (rank 0, chunk 0) also holds the embedding; the last (rank P-1,
    chunk C-1) holds the final norm, the output head, the loss and the MTP layers.
  * Tied embeddings or MTP: the last stage holds a copy of the embedding too, whose grads are
    summed with the first stage's over the embedding group {first, last} after the backwards
    (Megatron's embedding group and ``_allreduce_word_embedding_grads``).

Chunks reuse the single-process model's submodules under the same names (``embed``,
``blocks.<global layer index>``, ``norm``, ``head``), so a chunk's state_dict keys are a subset
of the full model's: :func:`load_pipeline_shard` loads a full checkpoint into any layout and
checkpoints can be resharded by key.

Chunks run the model's own forward stages (embed_tokens / run_blocks / head_and_loss), so
tensor/sequence, context and expert parallelism and MTP compose with PP without a second copy
of the loss code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from moeplug.config import ParallelConfig, RootConfig
from moeplug.moe import MoELayer
from moeplug.modules.stages import ModelStages
from moeplug.modules.transformer import MoETransformer
from moeplug.parallel import comm
from moeplug.parallel import tensor_parallel as tpar
from moeplug.parallel.layout import layout_rank_groups


@dataclass(frozen=True)
class ChunkOutput:
    """What a chunk's forward returns for one micro-batch.

    x_BSD: the activation for the next virtual stage (None on the last one).
    lm_loss: mean cross-entropy of the micro-batch (last virtual stage only, else None).
    aux_loss: sum of this chunk's MoE routers' aux losses (already times their coefficient),
        MTP blocks' included on the last stage.
    expert_counts: per MoE layer of the chunk (MTP blocks last), int64 [E] tokens per expert.
    mtp_loss: the scaled multi-token-prediction loss (last stage with MTP layers, else None).
    """

    x_BSD: torch.Tensor | None
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    expert_counts: list[torch.Tensor]
    mtp_loss: torch.Tensor | None = None


def needs_embedding_copy(model_cfg: Any) -> bool:
    """Whether the last stage needs the embedding too: a tied head is the embedding, and MTP
    embeds the tokens k steps ahead (Megatron keeps the same copy on its last stage)."""
    return bool(model_cfg.tie_embeddings or model_cfg.mtp_num_layers)


class PipelineChunk(ModelStages, nn.Module):
    """A consecutive block of a :class:`MoETransformer`'s layers (plus its embedding on the first
    virtual stage, its norm + head + MTP layers on the last), under the full model's parameter
    names. Runs the model's own stages (:class:`moeplug.modules.stages.ModelStages`), so TP/SP,
    CP and MTP behave exactly as in ``MoETransformer.forward``.

    The last stage also holds ``embed`` when :func:`needs_embedding_copy`: a second copy of the
    first stage's parameter (same name, same initial value). Its grad is summed with the first
    stage's over ``embedding_group`` by :func:`allreduce_embedding_grads` (the schedule calls
    it), so both copies get the single-process grad and stay equal under the optimizer. The
    copy carries ``pipeline_copy = True`` so the global grad norm counts the parameter once."""

    def __init__(self, model: MoETransformer, layers: range, is_first: bool, is_last: bool,
                 embedding_group: Any = None) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layers = layers
        self.cfg, self._groups, self._cp_group = model.cfg, model._groups, model._cp_group
        # The model's moeplug.stash.ModelRuntime, on every chunk: a rank whose stages hold no MoE
        # layer still takes part in the stash's and sync-free's per-step collectives.
        self.runtime = model.runtime
        self.hidden_size = model.cfg.hidden_size  # the [B, S, D] activation the stages exchange
        # Set only on a stage whose embedding has a twin on another pipeline rank.
        self.embedding_group = embedding_group
        if is_first or (is_last and needs_embedding_copy(model.cfg)):
            self.embed = model.embed
            if not is_first:
                for p in self.embed.parameters():
                    p.pipeline_copy = True
        # Keys are global layer indices, so parameter names match the full model's blocks.<i>.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if is_last:
            self.norm = model.norm
            self.head = model.head
            self.mtp = model.mtp

    def activation_shape(self, tokens_BS: torch.Tensor) -> tuple[int, int, int]:
        """Shape of the [B, S, D] activation this chunk receives for ``tokens_BS`` (this rank's
        CP shard): under SP each TP rank holds S / TP positions, as between any two blocks."""
        B, S = tokens_BS.shape
        tp, sp = tpar.tp_of(self._groups)
        return (B, S // comm.group_size(tp) if sp else S, self.hidden_size)

    def forward(self, x: torch.Tensor, targets_BS: torch.Tensor | None = None,
                tokens_BS: torch.Tensor | None = None) -> ChunkOutput:
        """``x`` is tokens_BS on the first virtual stage, else the previous stage's x_BSD.
        ``targets_BS`` (and, for MTP, ``tokens_BS``) on the last virtual stage."""
        if self.is_first:
            tokens_BS = x
            x = self.embed_tokens(x)
        blocks_out = self.run_blocks(x, self.blocks.values(), self.layers.start)
        if not self.is_last:
            return ChunkOutput(blocks_out.x_BSD, None, blocks_out.aux_loss,
                               blocks_out.expert_counts)
        head_out = self.head_and_loss(blocks_out.x_BSD, tokens_BS, targets_BS)
        return ChunkOutput(None, head_out.lm_loss, blocks_out.aux_loss + head_out.mtp_aux_loss,
                           blocks_out.expert_counts + head_out.mtp_counts, head_out.mtp_loss)

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
    :func:`build_embedding_group` (None with one process, or when nothing is shared)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank = {pp_rank} is outside [0, {pp}). Fix: pass "
                         "groups.rank_in('pp') and groups.size('pp')")
    ranges = pipe.chunk_layers(model.cfg.num_layers, pp)[pp_rank]
    chunks = []
    for c, layers in enumerate(ranges):
        is_first, is_last = pp_rank == 0 and c == 0, pp_rank == pp - 1 and c == pipe.vpp - 1
        holds_twin = pp > 1 and (is_first or is_last) and needs_embedding_copy(model.cfg)
        chunks.append(PipelineChunk(model, layers, is_first, is_last,
                                    embedding_group if holds_twin else None))
    return chunks


def build_embedding_group(groups: Any, model_cfg: Any) -> Any:
    """The process group {first, last pipeline rank} of this rank's pipeline, over which the two
    embedding copies' grads are summed (Megatron's embedding group). None when no copy is needed
    or pp = 1; the pipeline group itself when pp = 2. Collective: every rank of the world must
    call it (``dist.new_group`` for each pipeline's pair, in the same order everywhere)."""
    pp = groups.size("pp")
    if pp == 1 or not needs_embedding_copy(model_cfg):
        return None
    if pp == 2:
        return groups.pp
    mine = None
    for ranks in layout_rank_groups(groups.config)["pp"]:
        pair = [ranks[0], ranks[-1]]
        g = dist.new_group(ranks=pair)
        if groups.rank in pair:
            mine = g
    return mine


@torch.no_grad()
def allreduce_embedding_grads(chunks: list[PipelineChunk],
                              grads_before: dict[int, torch.Tensor | None]) -> None:
    """Sum what this step added to the embedding copies' grads over their embedding group.

    ``grads_before`` (:func:`embedding_grads_snapshot`, taken before the step's backwards) is
    kept out of the sum, so grads accumulated over several calls are not added twice."""
    for chunk in chunks:
        if chunk.embedding_group is None:
            continue
        for p in chunk.embed.parameters():
            before = grads_before.get(id(p))
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            delta = grad if before is None else grad - before
            dist.all_reduce(delta, group=chunk.embedding_group)
            p.grad = delta if before is None else before + delta


def embedding_grads_snapshot(chunks: list[PipelineChunk]) -> dict[int, torch.Tensor | None]:
    """The embedding copies' current grads (cloned), keyed by parameter id."""
    return {id(p): None if p.grad is None else p.grad.clone()
            for chunk in chunks if chunk.embedding_group is not None
            for p in chunk.embed.parameters()}


def build_stage_modules(cfg: RootConfig, host: Any, vocab_size: int, groups: Any,
                        pipe: ParallelConfig | None = None) -> list[PipelineChunk]:
    """Build this rank's model chunks for ``groups`` (a ParallelGroups).

    The full model is built with :func:`moeplug.modules.build_model` (so whatever the model
    builder does for TP/CP/EP applies unchanged) and then sliced. Cost: the whole model exists
    briefly on every rank; gain: with the same seed every rank's chunks hold exactly the
    single-process initial weights, with no broadcast. Layout errors raise before building.
    Collective (the embedding group, see :func:`build_embedding_group`)."""
    from moeplug.modules import build_model

    pipe = pipe or ParallelConfig()
    pp, pp_rank = groups.size("pp"), groups.rank_in("pp")
    pipe.chunk_layers(cfg.model.num_layers, pp)  # validate before the (larger) build
    embedding_group = build_embedding_group(groups, cfg.model)
    model = build_model(cfg, host, vocab_size, groups=groups)
    return split_model(model, pipe, pp, pp_rank, embedding_group)


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
