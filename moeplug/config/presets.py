"""Named model presets: Mixtral, Qwen3-MoE and DeepSeek-V3 at full size, plus ``*_tiny``
variants (a few M parameters) with the same architecture that train on one CPU core.

A preset is a RootConfig-shaped dict (``model`` and ``plugins`` sections, plus its own run
directory ``train.out_dir = runs/<name>``, so runs of different presets never share one) merged
*under* the user's config: dataclass defaults <- preset <- ``--config`` YAML <- ``--set`` / flags.
Full-size dimensions are the published ones (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 671B with
its default-RoPE 4K context); their ``vocab_size`` pads the local tokenizer's vocabulary.
"""

from __future__ import annotations

import copy

from moeplug.config import ConfigError

# DeepSeek-V3's router as our topk router's options (see moeplug.convert.deepseek_v3); its
# group score is HF/DeepSeek's top-2 sum, so it stays theirs if top_k or group_topk is changed.
_DSV3_ROUTER = {"score_function": "sigmoid", "enable_expert_bias": True, "bias_update_rate": 1e-3,
                "renormalize": True, "topk_scaling_factor": 2.5, "num_groups": 8, "group_topk": 4,
                "group_score": "top2_sum", "load_balancing_type": "seq_aux_loss",
                "aux_loss_coeff": 1e-4}

PRESETS: dict[str, dict] = {
    "mixtral": {  # Mixtral-8x7B
        "model": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                      first_k_dense=0, dense_ffn_hidden_size=14336,
                      moe=dict(num_experts=8, top_k=2, ffn_hidden_size=14336, aux_loss_coeff=0.02)),
        "plugins": {"router": "topk", "router_options": {}},
    },
    "qwen3_moe": {  # Qwen3-30B-A3B
        "model": dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                      num_kv_heads=4, kv_channels=128, qk_norm=True, max_seq_len=40960,
                      rope_theta=1e6, norm_eps=1e-6, first_k_dense=0, dense_ffn_hidden_size=6144,
                      moe=dict(num_experts=128, top_k=8, ffn_hidden_size=768, aux_loss_coeff=1e-3)),
        "plugins": {"router": "topk", "router_options": {"renormalize": True}},
    },
    "deepseek_v3": {  # DeepSeek-V3 (671B total, 37B active), 1 MTP module with loss scale 0.1
        "model": dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                      num_kv_heads=128, attention="mla", max_seq_len=4096, rope_theta=10000.0,
                      norm_eps=1e-6, first_k_dense=3, dense_ffn_hidden_size=18432,
                      mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True),
                      mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
                      moe=dict(num_experts=256, top_k=8, ffn_hidden_size=2048,
                               shared_expert_ffn_hidden_size=2048, aux_loss_coeff=1e-4)),
        "plugins": {"router": "topk", "router_options": dict(_DSV3_ROUTER)},
    },
    # Tiny variants: same architecture features, hidden 128, 4 layers, vocab from the tokenizer.
    "mixtral_tiny": {
        "model": dict(vocab_size=0, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      max_seq_len=256, rope_theta=1e6, norm_eps=1e-5, first_k_dense=0,
                      dense_ffn_hidden_size=256,
                      moe=dict(num_experts=8, top_k=2, ffn_hidden_size=128, aux_loss_coeff=0.02)),
        "plugins": {"router": "topk", "router_options": {}},
    },
    "qwen3_moe_tiny": {
        "model": dict(vocab_size=0, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      kv_channels=48, qk_norm=True, max_seq_len=256, rope_theta=1e6,
                      norm_eps=1e-6, first_k_dense=0, dense_ffn_hidden_size=256,
                      moe=dict(num_experts=8, top_k=2, ffn_hidden_size=96, aux_loss_coeff=1e-3)),
        "plugins": {"router": "topk", "router_options": {"renormalize": True}},
    },
    "deepseek_v3_tiny": {
        "model": dict(vocab_size=0, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                      attention="mla", max_seq_len=256, rope_theta=10000.0, norm_eps=1e-6,
                      first_k_dense=1, dense_ffn_hidden_size=256,
                      mla=dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                               qk_rope_head_dim=16, v_head_dim=32, rope_interleave=True),
                      mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
                      moe=dict(num_experts=8, top_k=4, ffn_hidden_size=64,
                               shared_expert_ffn_hidden_size=64, aux_loss_coeff=1e-4)),
        "plugins": {"router": "topk",
                    "router_options": dict(_DSV3_ROUTER, num_groups=4, group_topk=2)},
    },
}


def preset(name: str) -> dict:
    """A fresh copy of preset ``name`` with its default run directory (callers may merge into
    it)."""
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r}: unknown preset. Fix: use one of "
                          f"{', '.join(sorted(PRESETS))}")
    return {**copy.deepcopy(PRESETS[name]), "train": {"out_dir": f"runs/{name}"}}
