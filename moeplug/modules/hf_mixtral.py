"""Map between Hugging Face ``MixtralForCausalLM`` and MoETransformer (config + weights).

A small mapping used by the parity tests; it assumes the ``topk`` router (gate ``weight``) and an
experts backend with the shared Mixtral layout (``gate_up_proj`` [E, 2F, D], ``down_proj``
[E, D, F]) — see moeplug/interfaces.py. Mixtral has no dense layers, so ``first_k_dense = 0``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from moeplug.config import ModelConfig, MoEConfig

# HF name (after "model.layers.{i}.") -> ours (after "blocks.{i}.")
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn.router.weight",
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up_proj",
    "mlp.experts.down_proj": "ffn.experts.down_proj",
}


def model_config_from_mixtral(hf: Any, **overrides: Any) -> ModelConfig:
    """ModelConfig with Mixtral's architecture (rope theta, rms eps, GQA, tying, experts)."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(f"MixtralConfig.head_dim = {head_dim}: moeplug needs num_attention_heads * "
                         f"head_dim == hidden_size ({hf.hidden_size}). Fix: leave head_dim unset")
    if getattr(hf, "sliding_window", None) is not None:
        raise ValueError(f"MixtralConfig.sliding_window = {hf.sliding_window}: moeplug attention is "
                         f"full causal. Fix: set sliding_window=None")
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": getattr(hf, "rope_theta", 1e6)}
    kw = dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
              num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
              num_kv_heads=hf.num_key_value_heads, max_seq_len=hf.max_position_embeddings,
              rope_theta=float(rope["rope_theta"]), norm_eps=hf.rms_norm_eps,
              tie_embeddings=bool(hf.tie_word_embeddings), first_k_dense=0,
              init_std=hf.initializer_range,
              moe=MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                            ffn_hidden_size=hf.intermediate_size,
                            aux_loss_coeff=hf.router_aux_loss_coef))
    kw.update(overrides)
    return ModelConfig(**kw)


def state_dict_from_mixtral(hf_sd: Mapping[str, torch.Tensor], num_layers: int,
                            tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Rename a MixtralForCausalLM state dict to MoETransformer names (tensors are shared)."""
    out = {"embed.weight": hf_sd["model.embed_tokens.weight"], "norm.weight": hf_sd["model.norm.weight"]}
    if not tie_embeddings:
        out["head.weight"] = hf_sd["lm_head.weight"]
    for i in range(num_layers):
        for hf_name, ours in _LAYER_MAP.items():
            out[f"blocks.{i}.{ours}"] = hf_sd[f"model.layers.{i}.{hf_name}"]
    return out
