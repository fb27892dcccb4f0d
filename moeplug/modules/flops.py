"""Megatron model-FLOPs count per training token (reference: megatron_moe.md section 5).

Megatron's ``num_floating_point_operations`` counts only the matrix multiplies on the active path
of a forward pass, in multiply-adds, then multiplies by 6 (2 FLOPs per multiply-add x 3 for
forward + data-grad + weight-grad). Routers, norms, activations, softmax and the embedding lookup
are not counted (nor the shared-expert gate, a [1, D] vector); routed experts count exactly K per
token, a shared expert once. Using the same count makes our TFLOP/s comparable with
published Megatron-Core numbers.

Everything here is a pure function of the ModelConfig (no model needed), so the count for a
671B-parameter preset can be checked on a laptop. Per token, in multiply-adds (h = hidden_size,
V = padded vocabulary, s = sequence length, N = num_layers + mtp_num_layers):
    ffn(h) + N * (attn_linear + s * attn_core) + mtp_num_layers * (3h + 2h^2) + h * V * (1 + mtp)
"""

from __future__ import annotations

from moeplug.config import GATED_ACTIVATIONS, ModelConfig

SWIGLU_GEMMS = 3  # g for gated activations: gate, up and down projections
PLAIN_GEMMS = 2   # g for gelu / squared_relu: up and down projections


def attention_macs(cfg: ModelConfig) -> tuple[float, float]:
    """(A_lin, A_core): per-token multiply-adds of one attention layer's projections, and of
    its core (QK^T and PV) per unit of sequence length, causal-halved as Megatron counts it."""
    h, n = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        # Megatron keeps the "+ 1" of each LoRA rank (its norm's scale) in the count; we do too
        # so the numbers stay comparable with published TFLOP/s.
        q_term = (m.q_lora_rank * (h + n * qk + 1) if m.q_lora_rank else h * n * qk)
        linear = (q_term
                  + m.kv_lora_rank * (h + n * (m.qk_nope_head_dim + m.v_head_dim) + 1)
                  + h * m.qk_rope_head_dim        # the shared rope key
                  + n * m.v_head_dim * h)         # output projection
        core = n * qk / 2 + n * m.v_head_dim / 2
        return float(linear), core
    d, n_kv = cfg.head_dim, cfg.num_kv_heads
    # q, k, v and output projections.
    linear = h * (n * d + 2 * n_kv * d) + n * d * h
    # QK^T and PV are n*d*s multiply-adds each, halved because the causal mask skips half of the
    # score matrix. Megatron multiplies it by sum(s^2) over sequences, i.e. by s per token.
    return float(linear), float(n * d)


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token for unpadded sequences of length ``seq_len``.

    V is ``cfg.vocab_size`` when set (the padded embedding the model builds) else ``vocab_size``
    (the tokenizer's), exactly as build_model sizes the output head.
    """
    h = cfg.hidden_size
    V = cfg.vocab_size or vocab_size
    pattern = cfg.moe_layer_pattern
    num_mtp = cfg.mtp_num_layers
    # Each MTP layer is one more transformer layer of the last layer's kind (Megatron, and how
    # build_model makes them).
    num_moe = sum(pattern) + (num_mtp if pattern[-1] else 0)
    num_dense = cfg.num_layers + num_mtp - num_moe
    moe = cfg.moe
    # Dense layers are always SwiGLU (SwiGLUMLP); routed and shared experts use moe.activation.
    g = SWIGLU_GEMMS if moe.activation in GATED_ACTIVATIONS else PLAIN_GEMMS
    ffn_macs = h * (SWIGLU_GEMMS * cfg.dense_ffn_hidden_size * num_dense
                    + (g * moe.top_k * moe.ffn_hidden_size
                       + g * moe.shared_expert_ffn_hidden_size) * num_moe)
    attn_linear, attn_core = attention_macs(cfg)
    num_blocks = cfg.num_layers + num_mtp
    # MTP extras per depth: enorm, hnorm and the block's final norm (3h, kept as Megatron
    # counts them), the [h, 2h] eh_proj, and one more logits GEMM through the shared head.
    mtp_macs = num_mtp * (3 * h + 2 * h * h)
    logits_macs = h * V * (num_mtp + 1)
    per_token_macs = (ffn_macs + num_blocks * (attn_linear + seq_len * attn_core)
                      + mtp_macs + logits_macs)
    return 6.0 * per_token_macs
