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
    check_moe_forward, check_router, convert_model_weights, hf_fail, hf_rope, require,
    rope_theta, router_semantics)

FAMILY = "Qwen3MoeConfig"
MODEL_TYPE = "qwen3_moe"
MOE_NAME = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def layer_pattern(hf: Mapping[str, Any]) -> list[bool]:
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]


def pattern_fields(pattern: list[bool]) -> dict:
    """first_k_dense for "k dense, then all MoE" (the common case), else an explicit layer_freq."""
    k = next((i for i, moe in enumerate(pattern) if moe), len(pattern))
    if all(pattern[k:]):
        return {"first_k_dense": k, "moe": {"layer_freq": 1}}
    return {"first_k_dense": 0, "moe": {"layer_freq": [int(v) for v in pattern]}}


def config_from_hf(hf: Mapping[str, Any]) -> dict:
    require(FAMILY, hf, "hidden_act", ("silu",), "moeplug experts are SwiGLU (silu)")
    require(FAMILY, hf, "attention_bias", (False,), "use a model without attention biases")
    if hf.get("use_sliding_window"):
        hf_fail(FAMILY, "use_sliding_window", True, "moeplug attention is full causal",
                "set use_sliding_window=false")
    norm_topk = bool(hf.get("norm_topk_prob", False))
    if norm_topk and hf["num_experts_per_tok"] == 1:
        hf_fail(FAMILY, "norm_topk_prob", True, "with num_experts_per_tok = 1 the weight is always "
                "1.0 and moeplug's topk router refuses it (no gate gradient)",
                "set norm_topk_prob=false or num_experts_per_tok >= 2")
    pattern = layer_pattern(hf)
    if not any(pattern):
        hf_fail(FAMILY, "mlp_only_layers", hf.get("mlp_only_layers"), "leaves no MoE layer",
                "import a model with at least one MoE layer")
    H, D = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or D // H
    fields = pattern_fields(pattern)
    return {
        "model": dict(
            vocab_size=hf["vocab_size"], hidden_size=D, num_layers=hf["num_hidden_layers"],
            num_heads=H, num_kv_heads=hf["num_key_value_heads"],
            kv_channels=0 if head_dim * H == D else head_dim, qk_norm=True,
            max_seq_len=hf["max_position_embeddings"], rope_theta=rope_theta(FAMILY, hf),
            norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings")),
            first_k_dense=fields["first_k_dense"], dense_ffn_hidden_size=hf["intermediate_size"],
            init_std=hf.get("initializer_range", 0.02),
            # transformers 5 writes num_local_experts (an alias of num_experts) to config.json
            moe=dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")), top_k=hf["num_experts_per_tok"],
                     ffn_hidden_size=hf["moe_intermediate_size"],
                     aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0), **fields["moe"])),
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
