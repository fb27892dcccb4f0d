"""Hugging Face ``DeepseekV3ForCausalLM`` <-> moeplug (config + weights).

DeepSeek-V3: multi-head latent attention with interleaved RoPE on the rope dims, the first
``first_k_dense_replace`` layers dense, then MoE layers with ``n_shared_experts`` shared experts
(one SwiGLU of n_shared_experts x moe_intermediate_size) and a sigmoid router: group-limited
top-k (``n_group``, ``topk_group``; a group scores by its top-2 experts), selection biased by
``e_score_correction_bias`` (our router's ``expert_bias``), weights renormalised when
``norm_topk_prob`` and scaled by ``routed_scaling_factor``. Router options map to our ``topk``
router: score_function sigmoid, num_groups, group_topk, group_score top2_sum, enable_expert_bias,
renormalize, topk_scaling_factor; the balance loss is the paper's sequence-wise loss
(alpha = 1e-4). Megatron's group score (group_score topk_share, the sum of the top
top_k // group_topk) equals HF's only when that share is 2, so export refuses it otherwise.

Multi-token prediction: HF has no MTP forward and ``save_pretrained`` drops those weights; the
original checkpoint stores MTP module k as decoder layer ``num_hidden_layers + k`` with extra
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (and copies of the embedding and head).
Import reads them when present (else ``mtp_num_layers = 0``); export writes them that way.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moeplug import routing as R
from moeplug.config import ModelConfig, RootConfig
from moeplug.convert.common import (
    check_moe_forward, check_router, check_sizes, convert_model_weights, hf_config, hf_fail,
    hf_rope, main_blocks, require, rope_theta, router_semantics, take)

FAMILY = "DeepseekV3Config"
MODEL_TYPE = "deepseek_v3"
MOE_NAME = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
GROUP_SCORE = "top2_sum"  # HF/DeepSeek score a group by the sum of its 2 best experts
# DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not
# rms_norm_eps (as DeepSeek's reference inference code does)
HF_LATENT_NORM_EPS = 1e-6
SEQ_AUX_LOSS_COEFF = 1e-4  # DeepSeek-V3 paper, section 4.2 (alpha)
# transformers' DeepseekV3Config defaults for every key read here (see
# moeplug.convert.common.hf_config) and its attribute_map: the real DeepSeek-V3's layout, so a
# config.json without e.g. n_group means 8 groups, not none.
HF_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 1,
    "rope_theta": 10000.0}
HF_ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
# an unread HF tensor matching the pattern: the config.json field that should describe it
UNREAD_HINTS = ((r"\.shared_experts\.", "n_shared_experts"),
                (r"\.self_attn\.(q_a_proj|q_b_proj|q_a_layernorm)\.", "q_lora_rank"),
                (r"\.self_attn\.q_proj\.", "q_lora_rank"),
                (r"\.mlp\.(gate|up|down)_proj\.", "first_k_dense_replace"),
                (r"\.experts\.", "n_routed_experts"),
                (r"\.mlp\.gate\.", "first_k_dense_replace"))


def read_config(hf: Mapping[str, Any]):
    return hf_config(FAMILY, HF_DEFAULTS, HF_ALIASES, hf)


def config_from_hf(hf: Mapping[str, Any], hf_sd: Mapping[str, torch.Tensor] = ()) -> dict:
    hf = read_config(hf)
    require(FAMILY, hf, "hidden_act", ("silu",), "moeplug experts are SwiGLU (silu)")
    require(FAMILY, hf, "attention_bias", (False,), "use a model without attention biases")
    check_sizes(FAMILY, hf, "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "intermediate_size", "moe_intermediate_size",
                "max_position_embeddings", "n_routed_experts", "num_experts_per_tok",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if hf["qk_rope_head_dim"] % 2:
        hf_fail(FAMILY, "qk_rope_head_dim", hf["qk_rope_head_dim"], "is odd; RoPE rotates pairs "
                "of dimensions", "import a model with an even qk_rope_head_dim")
    L, K = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    E = hf["n_routed_experts"]
    first_dense = hf["first_k_dense_replace"] or 0
    if first_dense >= L:
        hf_fail(FAMILY, "first_k_dense_replace", first_dense, f"makes all num_hidden_layers = {L} "
                f"layers dense, so it leaves no MoE layer", "import a model with at least one "
                "MoE layer (first_k_dense_replace < num_hidden_layers)")
    groups, group_topk = hf["n_group"] or 1, hf["topk_group"] or 1
    if K == 1 and hf["norm_topk_prob"]:
        hf_fail(FAMILY, "norm_topk_prob", True, "with num_experts_per_tok = 1 HF divides the one "
                "score by itself (a weight of routed_scaling_factor, no gate gradient); "
                "Megatron's sigmoid router, and moeplug's, renormalise only when top_k > 1",
                "set norm_topk_prob=false or num_experts_per_tok >= 2")
    router: dict = {"score_function": "sigmoid", "enable_expert_bias": True,
                    "renormalize": bool(hf["norm_topk_prob"]),
                    "topk_scaling_factor": float(hf["routed_scaling_factor"]),
                    "load_balancing_type": "seq_aux_loss", "aux_loss_coeff": SEQ_AUX_LOSS_COEFF}
    if 1 < groups <= group_topk:
        groups = 1  # every group kept: HF's group limit masks nothing, plain top-k is the same
    if groups > 1:
        if group_topk * (E // groups) < K:
            hf_fail(FAMILY, "topk_group", group_topk, f"the {group_topk} kept groups of "
                    f"n_routed_experts / n_group = {E} / {groups} experts hold fewer than "
                    f"num_experts_per_tok = {K}, so HF would also route to experts of the groups "
                    f"it masked out (at score 0)", "import a model with topk_group x "
                    "n_routed_experts / n_group >= num_experts_per_tok")
        router.update(num_groups=groups, group_topk=group_topk, group_score=GROUP_SCORE)
    mtp = hf["num_nextn_predict_layers"] or 0
    if mtp and f"model.layers.{L}.eh_proj.weight" not in hf_sd:
        mtp = 0  # config promises MTP modules the weights do not hold (save_pretrained drops them)
    nh = hf["num_attention_heads"]
    return {
        "model": dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=L,
            num_heads=nh, num_kv_heads=nh, attention="mla",
            mla=dict(q_lora_rank=hf["q_lora_rank"] or 0, kv_lora_rank=hf["kv_lora_rank"],
                     qk_nope_head_dim=hf["qk_nope_head_dim"],
                     qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                     rope_interleave=bool(hf["rope_interleave"]),
                     latent_norm_eps=HF_LATENT_NORM_EPS),
            max_seq_len=hf["max_position_embeddings"], rope_theta=rope_theta(FAMILY, hf),
            norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
            first_k_dense=first_dense, dense_ffn_hidden_size=hf["intermediate_size"],
            init_std=hf["initializer_range"], mtp_num_layers=mtp,
            moe=dict(num_experts=E, top_k=K, ffn_hidden_size=hf["moe_intermediate_size"],
                     shared_expert_ffn_hidden_size=(hf["n_shared_experts"] or 0)
                     * hf["moe_intermediate_size"], aux_loss_coeff=SEQ_AUX_LOSS_COEFF)),
        "plugins": {"router": "topk", "router_options": router},
    }


def config_to_hf(cfg: RootConfig, vocab_size: int) -> dict:
    m, moe = cfg.model, cfg.model.moe
    if m.attention != "mla":
        hf_fail(FAMILY, "model.attention", m.attention, "DeepSeek-V3 uses multi-head latent "
                "attention", "export as mixtral or qwen3_moe, or train with attention: mla")
    if m.mla_latent_norm_eps != HF_LATENT_NORM_EPS:
        hf_fail(FAMILY, "model.mla.latent_norm_eps", m.mla_latent_norm_eps, f"HF's DeepSeek-V3 fixes the "
                f"q/kv latent norms' eps at {HF_LATENT_NORM_EPS} (None here means model.norm_eps)",
                f"export a model trained with mla.latent_norm_eps: {HF_LATENT_NORM_EPS}")
    if moe.activation != "swiglu" or moe.shared_expert_gate:
        hf_fail(FAMILY, "model.moe", (moe.activation, moe.shared_expert_gate), "DeepSeek-V3 has "
                "SwiGLU experts and an ungated shared expert", "use activation: swiglu and "
                "shared_expert_gate: false")
    pattern = m.moe_layer_pattern
    k = m.first_k_dense
    if list(pattern) != [i >= k for i in range(m.num_layers)]:
        hf_fail(FAMILY, "model.moe.layer_freq", moe.layer_freq, "DeepSeek-V3 has k dense layers "
                "then only MoE layers", "use first_k_dense for the dense layers, layer_freq: 1")
    F_shared = moe.shared_expert_ffn_hidden_size
    if F_shared % moe.ffn_hidden_size:
        hf_fail(FAMILY, "model.moe.shared_expert_ffn_hidden_size", F_shared,
                f"must be a multiple of moe.ffn_hidden_size ({moe.ffn_hidden_size}): HF stores "
                f"n_shared_experts", "use n x ffn_hidden_size")
    check_moe_forward(cfg, FAMILY)
    sem = router_semantics(cfg, FAMILY)
    # DeepSeek-V3's router: sigmoid scores, a selection bias, optional groups, renormalisation
    # and scaling; no capacity, no forced balance
    check_router(FAMILY, sem, {
        "score_function": "sigmoid", "enable_expert_bias": True,
        "renormalize": (True, False), "topk_scaling_factor": sem["topk_scaling_factor"],
        "num_groups": sem["num_groups"], "group_topk": sem["group_topk"],
        "group_score": sem.get("group_score")},
        "export a model trained with DeepSeek-V3's router: score_function: sigmoid, "
        "enable_expert_bias: true, no capacity_factor or force_load_balancing")
    groups, group_topk = sem["num_groups"] or 1, sem["group_topk"] or 1
    group_score = sem.get("group_score", "topk_share")
    if groups > 1 and (R.group_members(moe.top_k, group_topk, group_score)
                       != R.group_members(moe.top_k, group_topk, GROUP_SCORE)):
        hf_fail(FAMILY, "plugins.router_options.group_score", group_score,
                f"this router scores a group by its top top_k // group_topk = {moe.top_k} // "
                f"{group_topk} = {moe.top_k // group_topk} experts, HF by its top 2, so HF "
                f"would route differently", f"export a model trained with group_score: "
                f"{GROUP_SCORE} (or with group_topk = top_k / 2, where the two agree)")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE, "dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.mla.q_lora_rank or None, "kv_lora_rank": m.mla.kv_lora_rank,
        "qk_nope_head_dim": m.mla.qk_nope_head_dim, "qk_rope_head_dim": m.mla.qk_rope_head_dim,
        "v_head_dim": m.mla.v_head_dim, "rope_interleave": m.mla.rope_interleave,
        "intermediate_size": m.dense_ffn_hidden_size, "moe_intermediate_size": moe.ffn_hidden_size,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "n_shared_experts": F_shared // moe.ffn_hidden_size, "first_k_dense_replace": k,
        "n_group": groups, "topk_group": group_topk,
        # the sigmoid router renormalises only when top_k > 1 (Megatron), HF whenever asked
        "norm_topk_prob": moe.top_k > 1 and sem["renormalize"],
        "routed_scaling_factor": float(sem["topk_scaling_factor"]),
        "num_nextn_predict_layers": m.mtp_num_layers,
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "hidden_act": "silu", "attention_bias": False, **hf_rope(m.rope_theta),
    }


def _blocks_and_extras(m: ModelConfig) -> tuple[list, list]:
    blocks = main_blocks(m)
    mtp_moe = m.moe_layer_pattern[-1]
    for k in range(m.mtp_num_layers):
        blocks.append((f"model.layers.{m.num_layers + k}.", f"mtp.{k}.block.", mtp_moe))
    extras = [(f"{h}{MOE_NAME}.gate.e_score_correction_bias", f"{o}ffn.router.expert_bias")
              for h, o, moe in blocks if moe]
    for k in range(m.mtp_num_layers):
        h, o = f"model.layers.{m.num_layers + k}.", f"mtp.{k}."
        extras += [(f"{h}enorm.weight", f"{o}enorm.weight"), (f"{h}hnorm.weight", f"{o}hnorm.weight"),
                   (f"{h}eh_proj.weight", f"{o}eh_proj.weight"),
                   (f"{h}shared_head.norm.weight", f"{o}norm.weight")]
    return blocks, extras


def state_from_hf(hf_sd: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    blocks, extras = _blocks_and_extras(m)
    return convert_model_weights(hf_sd, m, MOE_NAME, EXPERT_NAMES, to_ours=True,
                                 extra_pairs=extras, blocks=blocks)


def state_to_hf(sd: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    blocks, extras = _blocks_and_extras(m)
    out = convert_model_weights(sd, m, MOE_NAME, EXPERT_NAMES, to_ours=False,
                                extra_pairs=extras, blocks=blocks)
    if not m.moe.shared_expert_ffn_hidden_size:
        # HF builds shared experts of n_shared_experts x moe_intermediate_size = 0 rows in every
        # MoE block anyway, and reports missing weights as "newly initialized": write them
        # empty, as HF's own save_pretrained does.
        D = m.hidden_size
        for h, _, moe in blocks:
            if moe:
                for p, shape in (("gate_proj", (0, D)), ("up_proj", (0, D)), ("down_proj", (D, 0))):
                    out[f"{h}{MOE_NAME}.shared_experts.{p}.weight"] = torch.zeros(shape)
    # The original checkpoint gives each MTP layer its own copy of the shared embedding/head.
    head = "embed.weight" if m.tie_embeddings else "head.weight"
    for k in range(m.mtp_num_layers):
        h = f"model.layers.{m.num_layers + k}."
        out[h + "embed_tokens.weight"] = take(sd, "embed.weight", "moeplug checkpoint")
        out[h + "shared_head.head.weight"] = take(sd, head, "moeplug checkpoint")
    return out


def ignored_weight(name: str, m: ModelConfig) -> bool:
    """The original checkpoint's per-MTP-layer copies of the embedding and head: import reads
    the main model's (export writes the copies back from them)."""
    return any(name in (f"model.layers.{m.num_layers + k}.embed_tokens.weight",
                        f"model.layers.{m.num_layers + k}.shared_head.head.weight")
               for k in range(m.mtp_num_layers))
