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
    chunk C-1) holds the final norm, the output head and the loss.

Chunks reuse the single-process model's submodules under the same names (``embed``,
``blocks.<global layer index>``, ``norm``, ``head``), so a chunk's state_dict keys are a subset
of the full model's: :func:`load_pipeline_shard` loads a full checkpoint into any layout and
checkpoints can be resharded by key.

Tied embeddings are rejected with PP > 1 (the head would live on another rank than the
embedding and would need a second copy whose gradients are all-reduced over an embedding group);
set ``model.tie_embeddings=false`` to pipeline a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from moeplug.config import ConfigError, RootConfig
from moeplug.modules.moe import MoELayer
from moeplug.modules.transformer import MoETransformer


def _fail(name: str, value: object, rule: str, fix: str) -> None:
    raise ConfigError(f"PipelineConfig.{name} = {value!r}: {rule}. Fix: {fix}")


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """How layers are split over the pipeline ranks (the PP degree itself is ParallelConfig.pp).

    vpp: model chunks per rank (virtual pipeline stages; interleaved 1F1B when > 1).
    num_layers_in_first_stage / num_layers_in_last_stage: layers on pipeline rank 0 / P-1
        (None: an even share). Useful because those ranks also carry the embedding / the head.
    """

    vpp: int = 1
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1:
            _fail("vpp", self.vpp, "must be a positive integer", "set vpp to 1 (no interleaving) "
                  "or to the number of model chunks per pipeline rank")
        for n in ("num_layers_in_first_stage", "num_layers_in_last_stage"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                _fail(n, v, "must be null or an integer >= 0",
                      f"leave {n} unset for an even split, or give a layer count")

    def rank_layer_counts(self, num_layers: int, pp: int) -> list[int]:
        """Layers held by each pipeline rank; raises ConfigError when they cannot tile N."""
        first, last = self.num_layers_in_first_stage, self.num_layers_in_last_stage
        if pp == 1:
            if self.vpp != 1:
                _fail("vpp", self.vpp, "virtual stages need pipeline parallelism (pp = 1)",
                      "set vpp = 1, or pp > 1")
            if first is not None or last is not None:
                name = "num_layers_in_first_stage" if first is not None else "num_layers_in_last_stage"
                _fail(name, getattr(self, name), "uneven stages need pp > 1", f"unset {name}")
            return [num_layers]
        if first is None and last is None:
            if num_layers % (pp * self.vpp):
                _fail("vpp", self.vpp, f"num_layers {num_layers} is not divisible by PP·VPP = "
                      f"{pp}·{self.vpp} = {pp * self.vpp}", "choose pp and vpp whose product "
                      "divides num_layers, or set num_layers_in_first_stage / _last_stage")
            return [num_layers // pp] * pp
        fixed = {0: first, pp - 1: last}
        fixed = {r: n for r, n in fixed.items() if n is not None}
        rest, middle = num_layers - sum(fixed.values()), pp - len(fixed)
        name = "num_layers_in_first_stage" if first is not None else "num_layers_in_last_stage"
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            _fail(name, fixed.get(0, fixed.get(pp - 1)),
                  f"with first = {first}, last = {last} the other {middle} stage(s) get "
                  f"{rest} of num_layers {num_layers} layers, which does not split evenly",
                  f"choose first/last so that num_layers - first - last is a multiple of the "
                  f"{middle} middle stage(s)" if middle else
                  f"make num_layers_in_first_stage + num_layers_in_last_stage = {num_layers}")
        counts = [fixed.get(r, rest // middle if middle else 0) for r in range(pp)]
        for r, n in enumerate(counts):
            if n % self.vpp:
                _fail("vpp", self.vpp, f"pipeline rank {r} holds {n} layers (per-rank counts "
                      f"{counts}), not divisible into {self.vpp} chunks",
                      "choose stage layer counts that are multiples of vpp")
        return counts

    def chunk_layers(self, num_layers: int, pp: int) -> list[list[range]]:
        """``[rank][chunk]`` -> the global layer indices of that model chunk."""
        counts = self.rank_layer_counts(num_layers, pp)
        sizes = [n // self.vpp for n in counts]  # layers per chunk on each rank
        out: list[list[range]] = [[] for _ in range(pp)]
        start = 0
        for c in range(self.vpp):  # virtual stage v = c * pp + r, in increasing v
            for r in range(pp):
                out[r].append(range(start, start + sizes[r]))
                start += sizes[r]
        return out


@dataclass(frozen=True)
class ChunkOutput:
    """What a chunk's forward returns for one micro-batch.

    x_BSD: the activation for the next virtual stage (None on the last one).
    lm_loss: mean cross-entropy of the micro-batch (last virtual stage only, else None).
    aux_loss: sum of this chunk's MoE routers' aux losses (already times their coefficient).
    expert_counts: per MoE layer of the chunk, int64 [E] tokens routed to each expert.
    """

    x_BSD: torch.Tensor | None
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    expert_counts: list[torch.Tensor]


class PipelineChunk(nn.Module):
    """A consecutive block of a :class:`MoETransformer`'s layers (plus its embedding on the first
    virtual stage, its norm + head on the last), under the full model's parameter names."""

    def __init__(self, model: MoETransformer, layers: range, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layers = layers
        self.hidden_size = model.cfg.hidden_size  # the [B, S, D] activation the stages exchange
        if is_first:
            self.embed = model.embed
        # Keys are global layer indices, so parameter names match the full model's blocks.<i>.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if is_last:
            self.norm = model.norm
            self.head = model.head

    def forward(self, x: torch.Tensor, targets_BS: torch.Tensor | None = None) -> ChunkOutput:
        """``x`` is tokens_BS on the first virtual stage, else the previous stage's x_BSD.
        Mirrors MoETransformer.forward op for op, so a pipelined run is numerically the single
        process's (tests/test_pipeline.py would catch a drift)."""
        x_BSD = self.embed(x) if self.is_first else x
        aux_loss = torch.zeros((), device=x_BSD.device, dtype=torch.float32)
        expert_counts: list[torch.Tensor] = []
        for block in self.blocks.values():
            x_BSD, layer_aux, counts_E = block(x_BSD)
            if counts_E is not None:
                aux_loss = aux_loss + layer_aux.float()
                expert_counts.append(counts_E)
        if not self.is_last:
            return ChunkOutput(x_BSD, None, aux_loss, expert_counts)
        logits_BSV = F.linear(self.norm(x_BSD), self.head.weight)
        lm_loss = None
        if targets_BS is not None:
            lm_loss = F.cross_entropy(logits_BSV.float().reshape(-1, logits_BSV.shape[-1]),
                                      targets_BS.reshape(-1))
        return ChunkOutput(None, lm_loss, aux_loss, expert_counts)

    def finalize_step(self, group: Any = None) -> None:
        """Per optimizer step, after ``optimizer.step()`` (see MoETransformer.finalize_step)."""
        for block in self.blocks.values():
            if isinstance(block.ffn, MoELayer):
                block.ffn.router.finalize_step(group)


def _check_untied(tie_embeddings: bool, pp: int) -> None:
    if pp > 1 and tie_embeddings:
        raise ConfigError(f"ModelConfig.tie_embeddings = True with pipeline parallelism (pp = "
                          f"{pp}): the head would sit on another rank than the embedding it "
                          "shares. Fix: set model.tie_embeddings=false, or pp = 1")


def split_model(model: MoETransformer, pipe: PipelineConfig, pp: int,
                pp_rank: int) -> list[PipelineChunk]:
    """The ``vpp`` chunks of pipeline rank ``pp_rank`` (references to ``model``'s submodules:
    drop ``model`` afterwards and the other ranks' layers are freed)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank = {pp_rank} is outside [0, {pp}). Fix: pass "
                         "groups.rank_in('pp') and groups.size('pp')")
    _check_untied(model.head is None, pp)
    ranges = pipe.chunk_layers(model.cfg.num_layers, pp)[pp_rank]
    return [PipelineChunk(model, layers, is_first=(pp_rank == 0 and c == 0),
                          is_last=(pp_rank == pp - 1 and c == pipe.vpp - 1))
            for c, layers in enumerate(ranges)]


def build_stage_modules(cfg: RootConfig, host: Any, vocab_size: int, groups: Any,
                        pipe: PipelineConfig | None = None) -> list[PipelineChunk]:
    """Build this rank's model chunks for ``groups`` (a ParallelGroups).

    The full model is built with :func:`moeplug.modules.build_model` (so whatever the model
    builder does for TP/EP applies unchanged) and then sliced. Cost: the whole model exists
    briefly on every rank; gain: with the same seed every rank's chunks hold exactly the
    single-process initial weights, with no broadcast. Layout errors raise before building."""
    from moeplug.modules import build_model

    pipe = pipe or PipelineConfig()
    pp, pp_rank = groups.size("pp"), groups.rank_in("pp")
    pipe.chunk_layers(cfg.model.num_layers, pp)  # validate before the (larger) build
    _check_untied(cfg.model.tie_embeddings, pp)
    check_composable(cfg.model, pp=pp, tp=groups.size("tp"), cp=groups.size("cp"))
    model = build_model(cfg, host, vocab_size, groups=groups)
    return split_model(model, pipe, pp, pp_rank)


def check_composable(model_cfg: Any, *, pp: int, tp: int, cp: int) -> None:
    """Reject what pipeline chunks cannot run yet (raises ConfigError).

    PipelineChunk.forward repeats MoETransformer.forward's plain path: embedding, blocks, norm,
    head and F.cross_entropy. The TP (vocab-parallel head/loss), CP (cross-shard loss) and MTP
    paths of the model's forward are not mirrored, so PP > 1 with any of them would silently
    compute a different loss. Lifting this needs MoETransformer to expose its embedding and its
    head + loss as methods the last chunk can call."""
    if pp == 1:
        return
    for name, size in (("tp", tp), ("cp", cp)):
        if size > 1:
            raise ConfigError(f"ParallelConfig.{name} = {size} with pp = {pp}: pipeline stages do "
                              f"not support {name.upper()} yet (the last stage's loss would skip "
                              f"the {name.upper()} path). Fix: set {name} = 1 or pp = 1")
    mtp = getattr(model_cfg, "mtp_num_layers", 0)
    if mtp:
        raise ConfigError(f"ModelConfig.mtp_num_layers = {mtp} with pp = {pp}: pipeline stages do "
                          "not hold MTP layers yet. Fix: set mtp_num_layers = 0 or pp = 1")


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
    inside a chunk are loaded by moeplug.parallel.experts.load_expert_shard instead."""
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
