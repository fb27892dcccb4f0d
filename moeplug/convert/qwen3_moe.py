"""Hugging Face ``Qwen3MoeForCausalLM`` <-> moeplug (config + weights).

Qwen3-MoE: GQA attention whose head dim is independent of hidden / heads (``kv_channels``), a
per-head RMSNorm on q and k before RoPE (``qk_norm``), softmax over all experts then top-k,
renormalised only when ``norm_topk_prob`` (our topk router: renormalize true = softmax over the
chosen logits, the same numbers; false = Megatron's pre-softmax). Dense layers come from
``mlp_only_layers`` / ``decoder_sparse_step`` (layer i is MoE iff i is not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0), mapped onto ``first_k_dense`` / ``moe.layer_freq``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moeplug.config import ModelConfig, RootConfig
from moeplug.convert.common import (
    check_moe_forward, check_router, check_sizes, convert_model_weights, hf_config, hf_fail,
    hf_rope, require, rope_theta, router_semantics)

FAMILY = "Qwen3MoeConfig"
MODEL_TYPE = "qwen3_moe"
MOE_NAME = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# transformers' Qwen3MoeConfig defaults for every key read here (see
# moeplug.convert.common.hf_config) and its attribute_map (transformers 5 writes the expert
# count as num_local_experts). Qwen3MoeConfig has no head_dim field: the attention takes
# hidden_size // num_attention_heads unless config.json sets one.
HF_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
    "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None,
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "rope_theta": 10000.0}
HF_ALIASES = {"num_local_experts": "num_experts"}
# an unread HF tensor matching the pattern: the config.json field that should describe it
UNREAD_HINTS = ((r"\.mlp\.(gate|up|down)_proj\.", "mlp_only_layers"),
                (r"\.experts\.", "num_experts"), (r"\.mlp\.gate\.", "mlp_only_layers"))


def read_config(hf: Mapping[str, Any]):
    return hf_config(FAMILY, HF_DEFAULTS, HF_ALIASES, hf)


def layer_pattern(hf: Mapping[str, Any]) -> list[bool]:
    hf = read_config(hf)
    step, dense = hf["decoder_sparse_step"] or 1, set(hf["mlp_only_layers"] or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]


def _refuse_all_dense(hf: Mapping[str, Any]) -> None:
    """Name the field that leaves no MoE layer: decoder_sparse_step, mlp_only_layers or both."""
    L, step, dense = hf["num_hidden_layers"], hf["decoder_sparse_step"] or 1, hf["mlp_only_layers"]
    fix = "import a model with at least one MoE layer"
    if not any((i + 1) % step == 0 for i in range(L)):
        hf_fail(FAMILY, "decoder_sparse_step", step, f"with num_hidden_layers = {L} no layer i "
                f"has (i + 1) % {step} == 0, so it leaves no MoE layer",
                f"{fix} (decoder_sparse_step <= num_hidden_layers)")
    if step == 1:
        hf_fail(FAMILY, "mlp_only_layers", dense, "leaves no MoE layer", fix)
    hf_fail(FAMILY, "mlp_only_layers", dense, f"lists every layer decoder_sparse_step = {step} "
            f"makes MoE, so it leaves no MoE layer", fix)


def pattern_fields(pattern: list[bool]) -> dict:
    """first_k_dense for "k dense, then all MoE" (the common case), else an explicit layer_freq."""
    k = next((i for i, moe in enumerate(pattern) if moe), len(pattern))
    if all(pattern[k:]):
        return {"first_k_dense": k, "moe": {"layer_freq": 1}}
    return {"first_k_dense": 0, "moe": {"layer_freq": [int(v) for v in pattern]}}


def config_from_hf(hf: Mapping[str, Any]) -> dict:
    hf = read_config(hf)
    require(FAMILY, hf, "hidden_act", ("silu",), "moeplug experts are SwiGLU (silu)")
    require(FAMILY, hf, "attention_bias", (False,), "use a model without attention biases")
    if hf["use_sliding_window"]:
        hf_fail(FAMILY, "use_sliding_window", True, "moeplug attention is full causal",
                "set use_sliding_window=false")
    check_sizes(FAMILY, hf, "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "moe_intermediate_size", "max_position_embeddings", "num_experts",
                "num_experts_per_tok")
    norm_topk = bool(hf["norm_topk_prob"])
    if norm_topk and hf["num_experts_per_tok"] == 1:
        hf_fail(FAMILY, "norm_topk_prob", True, "with num_experts_per_tok = 1 the weight is always "
                "1.0 and moeplug's topk router refuses it (no gate gradient)",
                "set norm_topk_prob=false or num_experts_per_tok >= 2")
    pattern = layer_pattern(hf)
    if not any(pattern):
        _refuse_all_dense(hf)
    H, D = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf["head_dim"] or D // H
    fields = pattern_fields(pattern)
    return {
        "model": dict(
            vocab_size=hf["vocab_size"], hidden_size=D, num_layers=hf["num_hidden_layers"],
            num_heads=H, num_kv_heads=hf["num_key_value_heads"],
            kv_channels=0 if head_dim * H == D else head_dim, qk_norm=True,
            max_seq_len=hf["max_position_embeddings"], rope_theta=rope_theta(FAMILY, hf),
            norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
            first_k_dense=fields["first_k_dense"], dense_ffn_hidden_size=hf["intermediate_size"],
            init_std=hf["initializer_range"],
            moe=dict(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                     ffn_hidden_size=hf["moe_intermediate_size"],
                     aux_loss_coeff=hf["router_aux_loss_coef"] or 0.0, **fields["moe"])),
        "plugins": {"router": "topk", "router_options": {"renormalize": norm_topk}},
    }


def config_to_hf(cfg: RootConfig, vocab_size: int) -> dict:
    m, moe = cfg.model, cfg.model.moe
    checks = [("model.attention", m.attention, "gqa"),
              ("model.moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, 0),
              ("model.mtp_num_layers", m.mtp_num_layers, 0),
              ("model.moe.activation", moe.activation, "swiglu")]
    for name, value, want in checks:
        if value != want:
            hf_fail(FAMILY, name, value, f"Qwen3-MoE has no such feature (needs {want!r})",
                    "export as deepseek_v3 or change the model")
    if not m.qk_norm:
        hf_fail(FAMILY, "model.qk_norm", False, "Qwen3-MoE always normalises q and k",
                "export as mixtral, or train with qk_norm: true")
    check_moe_forward(cfg, FAMILY)
    sem = router_semantics(cfg, FAMILY)
    check_router(FAMILY, sem, {"renormalize": (True, False)},
                 "export a model trained with a softmax top-k router (renormalised or not), no "
                 "expert bias, groups, scaling or capacity")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": MODEL_TYPE, "dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim, "intermediate_size": m.dense_ffn_hidden_size,
        "moe_intermediate_size": moe.ffn_hidden_size, "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": sem["renormalize"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe_layer in enumerate(m.moe_layer_pattern) if not moe_layer],
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "router_aux_loss_coef": moe.aux_loss_coeff, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, **hf_rope(m.rope_theta),
    }


def state_from_hf(hf_sd: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    return convert_model_weights(hf_sd, m, MOE_NAME, EXPERT_NAMES, to_ours=True)


def state_to_hf(sd: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    return convert_model_weights(sd, m, MOE_NAME, EXPERT_NAMES, to_ours=False)
