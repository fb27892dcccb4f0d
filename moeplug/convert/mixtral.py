"""Hugging Face ``MixtralForCausalLM`` <-> moeplug (config + weights).

Mixtral: GQA attention with the rotate-half RoPE, every layer MoE (no dense layers, no shared
experts), softmax router renormalised over the top-k (our ``topk`` router's default), SwiGLU
experts stored on disk as ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moeplug.config import ModelConfig, RootConfig
from moeplug.convert.common import (
    check_moe_forward, check_router, check_sizes, convert_model_weights, hf_config, hf_fail,
    hf_rope, require, rope_theta, router_semantics, topk_options)

FAMILY = "MixtralConfig"
MODEL_TYPE = "mixtral"
MOE_NAME = "block_sparse_moe"
EXPERT_NAMES = ("w1", "w3", "w2")
# transformers' MixtralConfig defaults for every key read here (a config.json without the key
# means this value; see moeplug.convert.common.hf_config), and its attribute_map.
HF_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
    "initializer_range": 0.02, "rms_norm_eps": 1e-5, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "sliding_window": None,
    "num_experts_per_tok": 2, "num_local_experts": 8, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "rope_theta": 1e6}
HF_ALIASES = {"num_experts": "num_local_experts"}
# an unread HF tensor matching the pattern: the config.json field that should describe it
UNREAD_HINTS = ((r"\.experts\.", "num_local_experts"),)


def read_config(hf: Mapping[str, Any]):
    return hf_config(FAMILY, HF_DEFAULTS, HF_ALIASES, hf)


def config_from_hf(hf: Mapping[str, Any]) -> dict:
    """A RootConfig-shaped dict (model + plugins sections) with Mixtral's architecture."""
    hf = read_config(hf)
    require(FAMILY, hf, "hidden_act", ("silu",), "moeplug experts are SwiGLU (silu)")
    if hf["sliding_window"] is not None:
        hf_fail(FAMILY, "sliding_window", hf["sliding_window"], "moeplug attention is full causal",
                "set sliding_window=None")
    check_sizes(FAMILY, hf, "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "intermediate_size", "max_position_embeddings",
                "num_local_experts", "num_experts_per_tok")
    H, D = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = hf["num_key_value_heads"] or H  # MixtralConfig: None means num_attention_heads
    head_dim = hf["head_dim"] or D // H
    if hf["num_experts_per_tok"] == 1:
        hf_fail(FAMILY, "num_experts_per_tok", 1, "Mixtral renormalises the top-1 weight to 1.0, "
                "which moeplug's topk router refuses (the gate would get no gradient)",
                "use num_experts_per_tok >= 2")
    jitter = float(hf["router_jitter_noise"] or 0.0)
    return {
        "model": dict(
            vocab_size=hf["vocab_size"], hidden_size=D, num_layers=hf["num_hidden_layers"],
            num_heads=H, num_kv_heads=kv_heads,
            kv_channels=0 if head_dim * H == D else head_dim,
            max_seq_len=hf["max_position_embeddings"], rope_theta=rope_theta(FAMILY, hf),
            norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
            first_k_dense=0, dense_ffn_hidden_size=hf["intermediate_size"],
            init_std=hf["initializer_range"],
            moe=dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                     ffn_hidden_size=hf["intermediate_size"],
                     aux_loss_coeff=hf["router_aux_loss_coef"] or 0.0)),
        "plugins": {"router": "topk", "router_options": {"input_jitter_eps": jitter} if jitter
                    else {}},
    }


def config_to_hf(cfg: RootConfig, vocab_size: int) -> dict:
    m, moe = cfg.model, cfg.model.moe
    checks = [("model.attention", m.attention, "gqa"), ("model.qk_norm", m.qk_norm, False),
              ("model.moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, 0),
              ("model.mtp_num_layers", m.mtp_num_layers, 0), ("model.moe.activation",
                                                               moe.activation, "swiglu")]
    for name, value, want in checks:
        if value != want:
            hf_fail(FAMILY, name, value, f"Mixtral has no such feature (needs {want!r})",
                    "export to a family that has it (qwen3_moe, deepseek_v3)")
    if not all(m.moe_layer_pattern):
        hf_fail(FAMILY, "model.first_k_dense / moe.layer_freq", (m.first_k_dense, moe.layer_freq),
                "Mixtral has only MoE layers", "export as qwen3_moe (mlp_only_layers)")
    check_moe_forward(cfg, FAMILY)
    # Mixtral's router: softmax over the top-k logits (renormalised; at top_k 1 a weight of 1)
    check_router(FAMILY, router_semantics(cfg, FAMILY), {"renormalize": True},
                 "export a model trained with Mixtral's router: softmax, renormalize: true "
                 "(top_k >= 2), no expert bias, groups, scaling or capacity")
    opts = topk_options(cfg, FAMILY)
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": MODEL_TYPE, "dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim, "intermediate_size": moe.ffn_hidden_size,
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "router_aux_loss_coef": moe.aux_loss_coeff, "hidden_act": "silu", "sliding_window": None,
        "router_jitter_noise": float(opts.get("input_jitter_eps", 0.0)), **hf_rope(m.rope_theta),
    }


def state_from_hf(hf_sd: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    # Files say "block_sparse_moe"; a live transformers-5 MixtralForCausalLM.state_dict() says
    # "mlp" (with fused experts). Accept both, so tests can map a model object directly.
    moe_name = "mlp" if any(".mlp.gate." in k for k in hf_sd) else MOE_NAME
    return convert_model_weights(hf_sd, m, moe_name, EXPERT_NAMES, to_ours=True)


def state_to_hf(sd: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    return convert_model_weights(sd, m, MOE_NAME, EXPERT_NAMES, to_ours=False)
