"""Megatron model-FLOPs count (moeplug.modules.flops): published numbers and the built model.

Legend: B batch, H heads, S sequence, Q q/k head width, W v head width.

1. The reference's own check (megatron_moe.md section 5, s = 4096): DeepSeek-V3 with one MTP
   layer, Qwen3-235B-A22B, Mixtral-8x22B and Qwen2-57B-A14B, from their published configs.
2. Tiny GQA (dense, MoE, shared experts, gated and plain activations) and MLA / MTP models: the
   count equals multiply-adds read off the built modules' weights.
3. MLA's causal core term equals FlopCounterMode over an explicit QK^T / PV with MLA widths.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moeplug.config import config_from_dict
from moeplug.build import build_model
from moeplug.modules import MoELayer
from moeplug.modules.flops import attention_macs, flops_per_token
from moeplug.plugin_host import PluginHost
from moeplug.config.presets import preset

HOST = PluginHost.load()
VOCAB = 40
SEQ = 4096

# Published configs (Hugging Face config.json of each checkpoint); vocabularies are already
# multiples of 128, i.e. Megatron's padded V.
QWEN3_235B = dict(vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64,
                  num_kv_heads=4, kv_channels=128, qk_norm=True, max_seq_len=40960,
                  first_k_dense=0, dense_ffn_hidden_size=12288,
                  moe=dict(num_experts=128, top_k=8, ffn_hidden_size=1536))
MIXTRAL_8X22B = dict(vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48,
                     num_kv_heads=8, max_seq_len=65536, first_k_dense=0,
                     dense_ffn_hidden_size=16384,
                     moe=dict(num_experts=8, top_k=2, ffn_hidden_size=16384))
QWEN2_57B = dict(vocab_size=151936, hidden_size=3584, num_layers=28, num_heads=28,
                 num_kv_heads=4, max_seq_len=65536, first_k_dense=0, dense_ffn_hidden_size=18944,
                 moe=dict(num_experts=64, top_k=8, ffn_hidden_size=2560,
                          shared_expert_ffn_hidden_size=20480))


@pytest.mark.parametrize("model, gflop", [
    (preset("deepseek_v3")["model"], 260.0),  # MLA with q-LoRA, 3 dense + 58 MoE, 1 MTP
    (QWEN3_235B, 148.0),
    (MIXTRAL_8X22B, 242.2),
    (QWEN2_57B, 84.7),
], ids=["deepseek_v3_mtp1", "qwen3_235b_a22b", "mixtral_8x22b", "qwen2_57b_a14b"])
def test_published_gflop_per_token(model, gflop):
    cfg = config_from_dict({"model": model}).model
    assert flops_per_token(cfg, 0, SEQ) / 1e9 == pytest.approx(gflop, rel=1e-3)


def _macs_from_parameters(model, seq_len):
    """Multiply-adds per token read off the built model's weights: every attention weight
    matrix, MLA's two latent norms (Megatron's "+ 1" per LoRA rank), K/E of the routed experts,
    the shared expert, dense MLPs, each MTP layer's enorm/hnorm/norm (3h) and eh_proj (2h^2), and
    one output-head GEMM for the main model plus one per MTP layer. The causal core is the one
    term not carried by a weight; test_mla_core_matches_flop_counter checks it separately."""
    cfg = model.cfg
    _, core = attention_macs(cfg)

    def block_macs(b):
        macs = sum(m.weight.numel() for m in b.attn.modules() if isinstance(m, torch.nn.Linear))
        if cfg.attention == "mla":
            macs += b.attn.kv_a_norm.weight.numel()
            if cfg.mla.q_lora_rank:
                macs += b.attn.q_a_norm.weight.numel()
        macs += core * seq_len
        if isinstance(b.ffn, MoELayer):
            ex = b.ffn.experts
            macs += (ex.gate_up_proj.numel() + ex.down_proj.numel()) * cfg.moe.top_k \
                / cfg.moe.num_experts
            if b.ffn.shared is not None:
                sh = b.ffn.shared
                macs += sum(m.weight.numel() for m in (sh.gate_proj, sh.up_proj, sh.down_proj)
                            if m is not None)
        else:
            macs += sum(p.numel() for p in b.ffn.parameters())
        return macs

    macs = model.output_weight().numel() * (1 + len(model.mtp))
    macs += sum(block_macs(b) for b in model.blocks)
    for layer in model.mtp:
        macs += block_macs(layer.block) + layer.eh_proj.weight.numel()
        macs += sum(n.weight.numel() for n in (layer.enorm, layer.hnorm, layer.norm))
    return macs


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("freq, first_k, shared", [(1, 1, 0), (2, 0, 12), ([0, 1, 0, 1], 0, 12)])
def test_gqa_dense_moe_shared_and_plain_activations_match_built_model(activation, freq, first_k,
                                                                     shared):
    moe = dict(num_experts=4, top_k=2, ffn_hidden_size=8, activation=activation, layer_freq=freq,
               shared_expert_ffn_hidden_size=shared, shared_expert_gate=bool(shared))
    cfg = config_from_dict({"model": dict(hidden_size=16, num_heads=4, num_kv_heads=2,
                                          num_layers=4, first_k_dense=first_k,
                                          dense_ffn_hidden_size=24, max_seq_len=16, moe=moe),
                            "train": dict(seq_len=8, warmup_steps=0)})
    model = build_model(cfg, HOST, VOCAB)
    assert model.flops_per_token(8) == pytest.approx(6.0 * _macs_from_parameters(model, 8),
                                                     rel=1e-12)


@pytest.mark.parametrize("q_lora_rank", [64, 0])
@pytest.mark.parametrize("mtp, last_moe", [(1, True), (2, True), (1, False), (0, True)])
def test_mla_and_mtp_count_matches_built_model(q_lora_rank, mtp, last_moe):
    data = preset("deepseek_v3_tiny")
    m = data["model"]
    m["mla"]["q_lora_rank"] = q_lora_rank
    m["mtp_num_layers"] = mtp
    m["num_layers"] = 3
    # layer_freq [.., 0] makes the last layer (and so every MTP block) dense.
    m["moe"]["layer_freq"] = 1 if last_moe else [0, 1, 0]
    cfg = config_from_dict(data)
    model = build_model(cfg, HOST, VOCAB)
    assert len(model.mtp) == mtp
    S = 8
    got = model.flops_per_token(S)
    assert got == flops_per_token(cfg.model, VOCAB, S)  # the method is the pure function
    assert got == pytest.approx(6.0 * _macs_from_parameters(model, S), rel=1e-12)


def test_mla_core_matches_flop_counter():
    """A_core = H*Q/2 + H*W/2 per unit of s: QK^T over the full q/k width Q = nope + rope and PV
    over the value width W, halved for the causal mask. FlopCounterMode counts the full S x S."""
    data = preset("deepseek_v3_tiny")
    cfg = config_from_dict(data).model
    mla = cfg.mla
    B, H, S = 2, cfg.num_heads, 16
    Q, W = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    assert Q != W  # so a mix-up of the two widths would show
    q_BHSQ = torch.randn(B, H, S, Q, requires_grad=True)
    k_BHSQ = torch.randn(B, H, S, Q, requires_grad=True)
    v_BHSW = torch.randn(B, H, S, W, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        scores_BHSS = (q_BHSQ @ k_BHSQ.transpose(-1, -2)).softmax(-1)
        (scores_BHSS @ v_BHSW).sum().backward()
    full_flops = counter.get_total_flops()  # fwd + bwd, 2 FLOPs per multiply-add, no causal cut
    _, core = attention_macs(cfg)
    assert 6.0 * core * S * B * S == full_flops / 2


def test_padded_vocab_counts_for_logits():
    """model.vocab_size pads the tokenizer's vocabulary; the logits GEMM is the padded one, so the
    trainer (which passes the tokenizer's size) and the model agree."""
    data = preset("mixtral_tiny")
    data["model"]["vocab_size"] = 64
    cfg = config_from_dict(data).model
    h = cfg.hidden_size
    assert flops_per_token(cfg, VOCAB, 8) - flops_per_token(cfg, 64, 8) == 0
    data["model"]["vocab_size"] = 0
    unpadded = config_from_dict(data).model
    assert flops_per_token(cfg, VOCAB, 8) - flops_per_token(unpadded, VOCAB, 8) == \
        6.0 * h * (64 - VOCAB)
