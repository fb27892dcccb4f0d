"""Tensor parallelism applied to a built model from outside (torchtitan's pattern): the
vocab-parallel embedding and head, and the ``sequence_parallel`` flag on parameters whose grads
are partial over TP. It needs the model's module classes, and the model's modules need the TP
layers of moeplug.parallel.tensor_parallel: keeping this step here keeps that import one-way.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moeplug.modules.mla import MLAttention
from moeplug.moe import MoELayer
from moeplug.modules.norm import RMSNorm
from moeplug.parallel.experts import expert_param_names
from moeplug.parallel.tensor_parallel import (ColumnParallelLinear, GatheredColumnParallelLinear,
                                              VocabParallelEmbedding, mark_sequence_parallel,
                                              tp_of)


def parallelize_transformer(model: nn.Module, groups: Any) -> None:
    """The model-level TP pieces, called by MoETransformer before its parameter init:
    vocab-parallel embedding (and head, column-parallel over V; tied heads reuse the embedding
    shard), and the ``sequence_parallel`` flag on parameters whose grads are partial over TP:
    norms and MLA attention (replicated, its output kept per chunk: tensor_parallel.
    on_whole_sequence) under SP, and every non-expert parameter of the MoE layers (router, shared
    experts), whose tokens are always split over TP (see tensor_parallel.moe_tokens_in)."""
    tp, sp = tp_of(groups)
    if tp is None:
        return
    V, D = model.vocab_size, model.cfg.hidden_size
    model.embed = VocabParallelEmbedding(V, D, tp, sp)
    if model.head is not None:
        model.head = ColumnParallelLinear(D, V, tp)
    expert_names = expert_param_names(model)
    for name, module in model.named_modules():
        if isinstance(module, (RMSNorm, MLAttention)) and sp:
            mark_sequence_parallel(module)
        if isinstance(module, MoELayer):
            for pname, p in module.named_parameters():
                if f"{name}.{pname}" not in expert_names:
                    p.sequence_parallel = True


def parallelize_mtp(model: nn.Module, groups: Any) -> None:
    """The MTP blocks' own TP piece (Megatron's MultiTokenPredictionLayer), called by
    MoETransformer after :func:`parallelize_transformer`: each depth's ``eh_proj`` becomes
    column-parallel with its output gathered over TP (and scattered over the sequence under
    SP), so the block after it gets the same activation as any decoder block. The rest is the
    decoder's: the blocks are built tensor-parallel with the groups, their norms and MoE
    router flagged by parallelize_transformer, the shared embedding and head vocab-parallel
    (moeplug.modules.stages.ModelStages.vocab_logits / mean_cross_entropy)."""
    tp, sp = tp_of(groups)
    if tp is None:
        return
    D = model.cfg.hidden_size
    for layer in model.mtp:
        layer.eh_proj = GatheredColumnParallelLinear(2 * D, D, tp, sp)
