"""The pipeline's embedding group: the ranks holding a copy of the embedding (the first stage, the
MTP stage, a tied head's last stage) and the sum of their copies' grads after the backwards
(Megatron's embedding group and ``_allreduce_word_embedding_grads``).

The chunks are moeplug.parallelize.pipeline.PipelineChunk's: this module reads only their
``embedding_group`` and ``embed``, so the schedules (moeplug.parallel.schedules) call it without
knowing the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeplug.config.pipeline_layout import PipelineLayout
from moeplug.parallel.layout import layout_rank_groups


def build_embedding_group(groups: Any, model_cfg: Any, layout: PipelineLayout | None = None
                          ) -> Any:
    """The process group of this rank's pipeline ranks that hold an embedding copy
    (:meth:`PipelineLayout.embedding_ranks`), over which the copies' grads are summed
    (Megatron's embedding group). None when only one rank holds it; the pipeline group itself
    when all do. Collective: every rank of the world must call it (``dist.new_group`` for each
    pipeline's ranks, in the same order everywhere)."""
    pp = groups.size("pp")
    if pp == 1:
        return None
    layout = layout or groups.config.layer_layout(model_cfg.num_layers, model_cfg.mtp_num_layers, pp)
    holders = layout.embedding_ranks(model_cfg.tie_embeddings)
    if len(holders) == 1:
        return None
    if len(holders) == pp:
        return groups.pp
    mine = None
    for ranks in layout_rank_groups(groups.config)["pp"]:
        members = [ranks[i] for i in holders]
        g = dist.new_group(ranks=members)
        if groups.rank in members:
            mine = g
    return mine


def _embedding_params(chunks: list[Any]) -> list[nn.Parameter]:
    """The embedding copies' parameters of this rank, each once (two chunks of one rank share
    the same module)."""
    out: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        if chunk.embedding_group is not None:
            out.update((id(p), p) for p in chunk.embed.parameters())
    return list(out.values())


@torch.no_grad()
def allreduce_embedding_grads(chunks: list[Any],
                              grads_before: dict[int, torch.Tensor | None]) -> None:
    """Sum what this step added to the embedding copies' grads over their embedding group.

    ``grads_before`` (:func:`embedding_grads_snapshot`, taken before the step's backwards) is
    kept out of the sum, so grads accumulated over several calls are not added twice."""
    group = next((c.embedding_group for c in chunks if c.embedding_group is not None), None)
    for p in _embedding_params(chunks):
        before = grads_before.get(id(p))
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        delta = grad if before is None else grad - before
        dist.all_reduce(delta, group=group)
        p.grad = delta if before is None else before + delta


def embedding_grads_snapshot(chunks: list[Any]) -> dict[int, torch.Tensor | None]:
    """The embedding copies' current grads (cloned), keyed by parameter id."""
    return {id(p): None if p.grad is None else p.grad.clone()
            for p in _embedding_params(chunks)}
