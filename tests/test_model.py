"""Model tests: shapes, causality, tying, overfitting, determinism, routing counts, FLOPs.

Legend: B batch, S sequence, V vocab, T = B*S tokens, D hidden, K top-k, E experts, F FFN hidden.

The MoE components come from the real plugin host (built-in topk router, alltoall dispatcher,
grouped experts by default); the MoE glue is checked against a per-token loop written here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from moeplug.config import ConfigError, ModelConfig, MoEConfig, RootConfig, TrainConfig
from moeplug.build import build_model
from moeplug.modules import MoELayer, MoETransformer
from moeplug.plugin_host import PluginHost


def make_host() -> PluginHost:
    return PluginHost.load()


def tiny_cfg(**model_kw) -> RootConfig:
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=24, aux_loss_coeff=1e-2)
    kw = dict(vocab_size=0, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
              max_seq_len=32, first_k_dense=1, dense_ffn_hidden_size=48, moe=moe)
    kw.update(model_kw)
    seq_len = min(16, kw["max_seq_len"])
    return RootConfig(model=ModelConfig(**kw), train=TrainConfig(seq_len=seq_len, warmup_steps=0))


VOCAB = 40


def tiny_model(seed: int = 0, **model_kw) -> MoETransformer:
    torch.manual_seed(seed)
    return build_model(tiny_cfg(**model_kw), make_host(), VOCAB)


def tokens(B=2, S=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)


# ------------------------------------------------------------------------------------------------
# Forward contract
# ------------------------------------------------------------------------------------------------

def test_shapes_and_loss_composition():
    model = tiny_model()
    x_BS, y_BS = tokens()
    out = model(x_BS, y_BS)
    assert out.logits_BSV.shape == (2, 16, VOCAB)
    assert out.loss.shape == out.lm_loss.shape == out.aux_loss.shape == ()
    # lm_loss is the plain fp32 mean cross-entropy, recomputed here independently.
    ref = -torch.log_softmax(out.logits_BSV.double(), -1).gather(-1, y_BS[..., None]).mean()
    torch.testing.assert_close(out.lm_loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)
    assert out.aux_loss > 0
    assert len(out.expert_counts) == 2  # 3 layers, first_k_dense = 1
    no_targets = model(x_BS)
    assert no_targets.loss is None and no_targets.lm_loss is None
    torch.testing.assert_close(no_targets.logits_BSV, out.logits_BSV)


def test_expert_counts_sum_to_tokens_times_topk():
    model = tiny_model()
    x_BS, _ = tokens(B=3, S=10)
    out = model(x_BS)
    for counts_E in out.expert_counts:
        assert counts_E.dtype == torch.int64 and counts_E.shape == (4,)
        assert int(counts_E.sum()) == 3 * 10 * 2


def test_aux_loss_is_sum_of_layer_router_losses():
    model = tiny_model()
    x_BS, _ = tokens()
    # Hook each router and add up what the routers themselves report.
    seen = []
    hooks = [blk.ffn.router.register_forward_hook(lambda m, i, o: seen.append(o.aux_loss))
             for blk in model.blocks if isinstance(blk.ffn, MoELayer)]
    out = model(x_BS)
    for h in hooks:
        h.remove()
    assert len(seen) == 2
    torch.testing.assert_close(out.aux_loss, seen[0].float() + seen[1].float())


def test_moe_layer_matches_per_token_loop():
    """MoELayer glue vs a direct per-token sum over the chosen experts with the same weights."""
    model = tiny_model()
    layer = model.blocks[1].ffn
    torch.manual_seed(3)
    x_TD = torch.randn(12, 32)
    y_TD, _, counts_E = layer(x_TD)
    r = layer.router(x_TD)
    w_up, w_down = layer.experts.gate_up_proj, layer.experts.down_proj
    ref_TD = torch.zeros_like(x_TD)
    for t in range(12):
        for k in range(2):
            e = int(r.ids_TK[t, k])
            g, u = (w_up[e] @ x_TD[t]).chunk(2)
            ref_TD[t] += r.probs_TK[t, k] * (w_down[e] @ (F.silu(g) * u))
    torch.testing.assert_close(y_TD, ref_TD, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts_E, torch.bincount(r.ids_TK.reshape(-1), minlength=4))


def test_causality():
    model = tiny_model()
    x_BS, _ = tokens(B=1, S=16)
    base = model(x_BS).logits_BSV
    j = 9
    x2_BS = x_BS.clone()
    x2_BS[0, j] = (x2_BS[0, j] + 1) % VOCAB
    changed = model(x2_BS).logits_BSV
    torch.testing.assert_close(changed[:, :j], base[:, :j], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:, j:], base[:, j:])


@pytest.mark.parametrize("tie", [True, False])
def test_tied_embeddings_share_storage(tie):
    model = tiny_model(tie_embeddings=tie)
    shared = model.output_weight().data_ptr() == model.embed.weight.data_ptr()
    assert shared == tie
    n_params = sum(p.numel() for p in model.parameters())
    untied_extra = 0 if tie else VOCAB * 32
    assert n_params == sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head")) + untied_extra
    if tie:
        # A gradient through the head lands on the embedding matrix.
        x_BS, y_BS = tokens()
        model(x_BS, y_BS).loss.backward()
        assert model.embed.weight.grad is not None and model.head is None


def test_deterministic_with_seed():
    x_BS, y_BS = tokens()
    a, b, c = tiny_model(seed=5), tiny_model(seed=5), tiny_model(seed=6)
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), na
    assert torch.equal(a(x_BS, y_BS).logits_BSV, b(x_BS, y_BS).logits_BSV)
    assert not torch.equal(a(x_BS).logits_BSV, c(x_BS).logits_BSV)


def test_init_std_scaled_for_output_projections():
    torch.manual_seed(0)
    cfg = tiny_cfg(hidden_size=128, num_heads=4, num_kv_heads=2, dense_ffn_hidden_size=256,
                   num_layers=8, first_k_dense=8, init_std=0.05)
    model = build_model(cfg, make_host(), VOCAB)
    out_std = 0.05 / math.sqrt(16)
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif "o_proj" in name or "down_proj" in name:
            assert abs(p.std().item() - out_std) < 0.1 * out_std, name
        else:
            assert abs(p.std().item() - 0.05) < 0.1 * 0.05, name


def test_tiny_model_overfits_one_batch():
    model = tiny_model(seed=0)
    x_BS, y_BS = tokens(B=4, S=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(x_BS, y_BS).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = model(x_BS, y_BS).lm_loss.item()
    assert first > math.log(VOCAB) - 0.5  # starts near chance
    assert last < 0.25 * first, (first, last)


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------

def test_flops_per_token_hand_computation():
    # hidden 32, 4 heads of 8, 2 kv heads, 3 layers (1 dense F=48, 2 MoE top-2 of F=24), V=40, s=16.
    # Per layer attention projections (multiply-adds per token):
    #   q 32*32 + k 32*16 + v 32*16 + o 32*32 = 1024 + 512 + 512 + 1024 = 3072
    # Causal core: (QK^T + PV) = 2 * 32 * 16 macs, halved -> 512
    # Dense FFN: 3 * 32 * 48 = 4608; MoE FFN: 2 experts * 3 * 32 * 24 = 4608; logits 32*40 = 1280.
    per_token_macs = 3 * (3072 + 512) + 4608 + 2 * 4608 + 1280
    model = tiny_model()
    assert model.flops_per_token(16) == 6 * per_token_macs


def test_flops_match_flop_counter_for_dense_model():
    """Linear layers: FlopCounterMode over one real fwd+bwd. Attention core: the counter over an
    explicit QK^T / softmax / PV of the same shapes (it does not see CPU SDPA kernels)."""
    cfg = tiny_cfg(num_layers=2, first_k_dense=2)
    m = cfg.model
    torch.manual_seed(0)
    model = build_model(cfg, make_host(), VOCAB)
    B, S = 2, 16
    x_BS, y_BS = tokens(B, S)
    with FlopCounterMode(display=False) as counter:
        model(x_BS, y_BS).loss.backward()
    gemm_ops = {torch.ops.aten.mm, torch.ops.aten.addmm}
    measured_gemm = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                        if op in gemm_ops)
    core_per_token = 6 * m.num_layers * m.num_heads * m.head_dim * S  # causal-halved core term
    assert measured_gemm == (model.flops_per_token(S) - core_per_token) * B * S

    q_BHSd = torch.randn(B, m.num_heads, S, m.head_dim, requires_grad=True)
    k_BHSd = torch.randn(B, m.num_heads, S, m.head_dim, requires_grad=True)
    v_BHSd = torch.randn(B, m.num_heads, S, m.head_dim, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        scores_BHSS = (q_BHSd @ k_BHSd.transpose(-1, -2)).softmax(-1)
        (scores_BHSS @ v_BHSd).sum().backward()
    full_core = counter.get_total_flops()  # one layer, full S x S (no causal saving)
    assert core_per_token * B * S == m.num_layers * full_core / 2


# ------------------------------------------------------------------------------------------------
# Errors name the field, the value and the fix
# ------------------------------------------------------------------------------------------------

def test_error_vocab_smaller_than_tokenizer():
    with pytest.raises(ConfigError, match=r"ModelConfig.vocab_size = 16 .*\(40\).*Fix: set model.vocab_size=0"):
        build_model(tiny_cfg(vocab_size=16), make_host(), VOCAB)


def test_padded_vocab_is_used():
    torch.manual_seed(0)
    model = build_model(tiny_cfg(vocab_size=64), make_host(), VOCAB)
    assert model(tokens()[0]).logits_BSV.shape[-1] == 64


def test_error_wrong_number_of_moe_layers():
    with pytest.raises(ValueError, match=r"got 0 MoE layers .*first_k_dense = 1\) has 2\b.*Fix: build one MoELayer"):
        MoETransformer(tiny_cfg().model, VOCAB, [])


def test_error_sequence_longer_than_rope_table():
    model = tiny_model(max_seq_len=8)
    with pytest.raises(ValueError, match=r"sequence length 16 exceeds ModelConfig.max_seq_len = 8\. Fix: raise"):
        model(tokens(S=16)[0])


def test_error_moe_layer_local_expert_mismatch():
    cfg = tiny_cfg().model
    host = make_host()
    router = host.create("router", "topk", {}, cfg)
    dispatcher = host.create("dispatcher", "alltoall", {}, cfg, None)
    experts = host.create("experts", "sequential", {}, cfg, 3)
    with pytest.raises(ValueError, match=r"num_local_experts = 4 but experts.num_local_experts = 3\. Fix"):
        MoELayer(router, dispatcher, experts)


def test_config_rejects_odd_head_dim():
    with pytest.raises(ConfigError, match="head dim 5 is odd"):
        ModelConfig(hidden_size=20, num_heads=4, num_kv_heads=2)
