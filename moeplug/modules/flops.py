"""Megatron model-FLOPs count per training token (reference: megatron_moe.md section 5).

Megatron's ``num_floating_point_operations`` counts only the matrix multiplies on the active path
of a forward pass, in multiply-adds, then multiplies by 6 (2 FLOPs per multiply-add x 3 for
forward + data-grad + weight-grad). Routers, norms, activations, softmax and the embedding lookup
are not counted (nor the shared-expert gate, a [1, D] vector); routed experts count exactly K per
token, a shared expert once. Using the same count makes our TFLOP/s comparable with
published Megatron-Core numbers.
"""

from __future__ import annotations

from moeplug.config import GATED_ACTIVATIONS, ModelConfig

SWIGLU_GEMMS = 3  # g for gated activations: gate, up and down projections
PLAIN_GEMMS = 2   # g for gelu / squared_relu: up and down projections


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token for unpadded sequences of length ``seq_len``."""
    h = cfg.hidden_size
    d = cfg.head_dim
    n_q, n_kv = cfg.num_heads, cfg.num_kv_heads
    num_moe = sum(cfg.moe_layer_pattern)
    num_dense = cfg.num_layers - num_moe
    moe = cfg.moe
    # Dense layers are always SwiGLU (SwiGLUMLP); routed and shared experts use moe.activation.
    g = SWIGLU_GEMMS if moe.activation in GATED_ACTIVATIONS else PLAIN_GEMMS
    ffn_macs = h * (SWIGLU_GEMMS * cfg.dense_ffn_hidden_size * num_dense
                    + (g * moe.top_k * moe.ffn_hidden_size
                       + g * moe.shared_expert_ffn_hidden_size) * num_moe)
    # A_lin: q, k, v and output projections.
    attn_linear_macs = h * (n_q * d + 2 * n_kv * d) + n_q * d * h
    logits_macs = h * vocab_size
    # A_core = n_q*d per token per unit of sequence length: QK^T and PV are n_q*d*s multiply-adds
    # each, halved because the causal mask skips half of the score matrix. Megatron multiplies it
    # by sum(s^2) over sequences, i.e. by s per token.
    attn_core_macs = n_q * d * seq_len
    per_token_macs = (ffn_macs + cfg.num_layers * attn_linear_macs + logits_macs
                      + cfg.num_layers * attn_core_macs)
    return 6.0 * per_token_macs
