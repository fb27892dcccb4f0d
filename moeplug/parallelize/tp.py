"""Step 1 of moeplug.parallelize: tensor and sequence parallelism (Megatron TP/SP) on a built,
unparallelized model (torchtitan's ``apply_tp``).

Layout (Shoeybi et al. 2019; Korthikanti et al. 2022; the layers and regions are
moeplug.parallel.tensor_parallel's):
  * attention: q/k/v column-parallel by heads (each rank holds H/W query heads and G/W kv heads,
    so GQA groups never straddle ranks), o row-parallel;
  * dense SwiGLU: gate/up column-parallel, down row-parallel;
  * embedding: vocab-parallel; output head: column-parallel over the vocabulary, fed to the
    vocab-parallel cross-entropy;
  * MLA attention (Megatron's MLASelfAttention): q_a_proj / kv_a_proj replicated, run on the
    tokens the rank holds (its sequence chunk under SP), their latents entering the region
    (all-gathered under SP: Q + C + R a token instead of D); q_b_proj (or q_proj) and
    kv_b_proj column-parallel by heads, o_proj row-parallel. The latent norms run after the
    entry on the whole sequence with this rank's heads' part of their grads, so their weights'
    grads are summed over TP (``sequence_parallel``), as are the down projections' under SP;
  * MTP (Megatron's MultiTokenPredictionLayer): each depth's block as any decoder block, its
    ``eh_proj`` column-parallel with the output gathered (scattered over the sequence under SP),
    the embedding and head the main model's vocab-parallel ones.
Layers keep their names, so checkpoints and state dicts do not change.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moeplug.modules.attention import Attention
from moeplug.modules.mla import MLAttention
from moeplug.modules.mlp import SwiGLUMLP
from moeplug.modules.norm import RMSNorm
from moeplug.moe import MoELayer
from moeplug.parallel import comm
from moeplug.parallel.experts import expert_param_names
from moeplug.parallel.tensor_parallel import (ColumnParallelLinear, GatheredColumnParallelLinear,
                                              RowParallelLinear, VocabParallelEmbedding,
                                              check_divisible, mark_sequence_parallel)
from moeplug.parallelize.wiring import ParallelWiring


def tp_of(groups: Any) -> tuple[Any, bool]:
    """(TP group or None, sequence parallel on?) of a ParallelGroups (None: one process)."""
    tp = None if groups is None else groups.tp
    return tp, tp is not None and bool(groups.config.sequence_parallel)


def parallelize_attention(attn: Attention, cfg: Any, tp: Any, sp: bool) -> None:
    """Swap an Attention's q/k/v for column-parallel and o for row-parallel layers (same names)
    and make its head counts local. GQA: kv heads are split too, so each rank keeps whole groups
    (query head h uses kv head h // (H/G), and rank r's query heads map to its kv heads)."""
    W = comm.group_size(tp)
    check_divisible("ModelConfig.num_heads", cfg.num_heads, W, "choose tp dividing num_heads")
    check_divisible("ModelConfig.num_kv_heads", cfg.num_kv_heads, W,
                    "choose tp dividing num_kv_heads (each TP rank needs whole KV heads)")
    D, Dh = cfg.hidden_size, cfg.head_dim
    attn.q_proj = ColumnParallelLinear(D, cfg.num_heads * Dh, tp)
    attn.k_proj = ColumnParallelLinear(D, cfg.num_kv_heads * Dh, tp)
    attn.v_proj = ColumnParallelLinear(D, cfg.num_kv_heads * Dh, tp)
    attn.o_proj = RowParallelLinear(cfg.num_heads * Dh, D, tp, sp)
    attn.num_heads, attn.num_kv_heads = cfg.num_heads // W, cfg.num_kv_heads // W
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:  # one [Dh] weight shared by all heads; each rank has other heads
            mark_sequence_parallel(norm)


def parallelize_mla(attn: MLAttention, cfg: Any, tp: Any, sp: bool) -> None:
    """Split an MLAttention's heads over TP (same names): the up projections column-parallel,
    o_proj row-parallel; the down projections stay whole on every rank (Megatron's duplicated
    linear_q_down_proj / linear_kv_down_proj). Each per-head weight is [H * d, ...] head-major
    (the forward views it as [.., H, d]), so rank r's contiguous chunk is its H/W heads."""
    W = comm.group_size(tp)
    check_divisible("ModelConfig.num_heads", cfg.num_heads, W, "choose tp dividing num_heads")
    m, H, D = cfg.mla, cfg.num_heads, cfg.hidden_size
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    # The latent norms run after the entry, on this rank's heads' part of their grads; under SP
    # the down projections see only this rank's sequence chunk. Both: grads summed over TP.
    if attn.q_proj is not None:
        attn.q_proj = ColumnParallelLinear(D, H * qk, tp)
    else:
        attn.q_b_proj = ColumnParallelLinear(m.q_lora_rank, H * qk, tp)
        mark_sequence_parallel(attn.q_a_norm)
        if sp:
            mark_sequence_parallel(attn.q_a_proj)
    attn.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim),
                                          tp)
    mark_sequence_parallel(attn.kv_a_norm)
    if sp:
        mark_sequence_parallel(attn.kv_a_proj)
    attn.o_proj = RowParallelLinear(H * m.v_head_dim, D, tp, sp)
    attn.num_heads = H // W


def parallelize_mlp(mlp: SwiGLUMLP, tp: Any, sp: bool) -> None:
    """Dense SwiGLU: gate/up column-parallel, down row-parallel (same names)."""
    D, F = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    mlp.gate_proj = ColumnParallelLinear(D, F, tp)
    mlp.up_proj = ColumnParallelLinear(D, F, tp)
    mlp.down_proj = RowParallelLinear(F, D, tp, sp)


def apply_tp(model: nn.Module, groups: Any) -> ParallelWiring | None:
    """TP/SP on ``model`` (a MoETransformer) for ``groups.tp``; returns the wiring the modules
    now need (the CP step adds to it), or None without TP. Before parameter init: the new
    layers' weights are empty until ``reset_parameters`` or a shard load."""
    tp, sp = tp_of(groups)
    if tp is None:
        return None
    cfg = model.cfg
    for block in [*model.blocks, *(layer.block for layer in model.mtp)]:
        if isinstance(block.attn, Attention):
            parallelize_attention(block.attn, cfg, tp, sp)
        elif isinstance(block.attn, MLAttention):
            parallelize_mla(block.attn, cfg, tp, sp)
        if isinstance(block.ffn, SwiGLUMLP):
            parallelize_mlp(block.ffn, tp, sp)
    for layer in model.mtp:  # [emb | hidden] -> D, gathered so the block gets a decoder's input
        layer.eh_proj = GatheredColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, tp, sp)
    parallelize_embedding_and_flags(model, tp, sp)
    return ParallelWiring(tp_group=tp, sequence_parallel=sp)


def parallelize_embedding_and_flags(model: nn.Module, tp: Any, sp: bool) -> None:
    """The model-level TP pieces: vocab-parallel embedding (and head, column-parallel over V;
    tied heads reuse the embedding shard), and the ``sequence_parallel`` flag on parameters
    whose grads are partial over TP: norms under SP, and every non-expert parameter of the MoE
    layers (router, shared experts), whose tokens are always split over TP
    (ParallelWiring.moe_tokens_in)."""
    V, D = model.vocab_size, model.cfg.hidden_size
    model.embed = VocabParallelEmbedding(V, D, tp, sp)
    if model.head is not None:
        model.head = ColumnParallelLinear(D, V, tp)
    expert_names = expert_param_names(model)
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm) and sp:
            mark_sequence_parallel(module)
        if isinstance(module, MoELayer):
            for pname, p in module.named_parameters():
                if f"{name}.{pname}" not in expert_names:
                    p.sequence_parallel = True
