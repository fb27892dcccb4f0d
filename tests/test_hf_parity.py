"""Numerical parity with Hugging Face transformers' Mixtral, built in-process (no downloads).

Our attention, RoPE, RMSNorm, router (softmax -> top-k -> renormalise) and experts must
reproduce MixtralForCausalLM's math in fp32. HF runs with eager attention (explicit softmax), so
the reference shares no attention kernel with our SDPA path.

Legend: B batch, S sequence, D hidden, V vocab, E experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    MixtralSparseMoeBlock, load_balancing_loss_func)

from moeplug.config import PluginsConfig, RootConfig, TrainConfig, config_from_dict  # noqa: E402
from moeplug.convert.common import ConvertError  # noqa: E402
from moeplug.convert.mixtral import config_from_hf, state_from_hf  # noqa: E402
from moeplug.build import build_model  # noqa: E402
from moeplug.plugin_host import PluginHost  # noqa: E402

EXPERTS = ["sequential", "grouped"]


def hf_config(tie: bool = False) -> MixtralConfig:
    cfg = MixtralConfig(vocab_size=50, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                        tie_word_embeddings=tie, router_aux_loss_coef=0.02)
    cfg._attn_implementation = "eager"
    return cfg


def hf_model(tie: bool = False) -> MixtralForCausalLM:
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hf_config(tie)).eval()
    with torch.no_grad():
        # Non-trivial norm weights and larger matrices than the default init, so a wrong mapping,
        # a missing norm weight or a swapped gate/up half changes the logits far above tolerance.
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return hf


def model_config_from_mixtral(hf_config):
    return config_from_dict({"model": config_from_hf(hf_config.to_dict())["model"],
                             "train": {"seq_len": 16, "warmup_steps": 0}}).model


def state_dict_from_mixtral(hf_sd, num_layers, tie_embeddings, hf_config=None):
    return state_from_hf(hf_sd, model_config_from_mixtral(hf_config))


def root_cfg(hf: MixtralForCausalLM, experts: str) -> RootConfig:
    return RootConfig(model=model_config_from_mixtral(hf.config),
                      plugins=PluginsConfig(router="topk", dispatcher="alltoall", experts=experts),
                      train=TrainConfig(seq_len=16, warmup_steps=0))


def ours_from(hf: MixtralForCausalLM, experts: str):
    cfg = root_cfg(hf, experts)
    model = build_model(cfg, PluginHost.load(), hf.config.vocab_size)
    sd = state_dict_from_mixtral(hf.state_dict(), cfg.model.num_layers, cfg.model.tie_embeddings,
                                 hf.config)
    model.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True)
    return model


def tokens(B=2, S=16):
    return torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("tie", [False, True])
def test_logits_loss_and_grads_match_mixtral(experts, tie):
    hf = hf_model(tie)
    ours = ours_from(hf, experts)
    x_BS = tokens()

    hf_out = hf(input_ids=x_BS, labels=x_BS)  # HF shifts labels internally
    out = ours(x_BS[:, :-1], x_BS[:, 1:])
    torch.testing.assert_close(out.logits_BSV, hf_out.logits[:, :-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.lm_loss, hf_out.loss, rtol=1e-6, atol=1e-6)

    hf_out.loss.backward()
    out.lm_loss.backward()
    hf_grads = state_dict_from_mixtral({n: p.grad for n, p in hf.named_parameters()}
                                       | ({"lm_head.weight": None} if tie else {}),
                                       hf.config.num_hidden_layers, tie, hf.config)
    ours_grads = dict(ours.named_parameters())
    assert set(hf_grads) == set(ours_grads)
    for name, g in hf_grads.items():
        torch.testing.assert_close(ours_grads[name].grad, g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("experts", EXPERTS)
def test_moe_layer_matches_mixtral_sparse_moe_block(experts):
    hf = hf_model()
    block: MixtralSparseMoeBlock = hf.model.layers[0].mlp
    layer = ours_from(hf, experts).blocks[0].ffn

    torch.manual_seed(1)
    x_ref_BSD = torch.randn(3, 10, 32, requires_grad=True)
    x_BSD = x_ref_BSD.detach().clone().requires_grad_(True)
    y_ref_BSD = block(x_ref_BSD)
    y_BSD, aux_loss, counts_E = layer(x_BSD)
    torch.testing.assert_close(y_BSD, y_ref_BSD, rtol=1e-5, atol=1e-6)

    g_BSD = torch.randn_like(y_BSD)
    y_ref_BSD.backward(g_BSD)
    y_BSD.backward(g_BSD)
    torch.testing.assert_close(x_BSD.grad, x_ref_BSD.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, block.gate.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layer.experts.gate_up_proj.grad, block.experts.gate_up_proj.grad,
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layer.experts.down_proj.grad, block.experts.down_proj.grad,
                               rtol=1e-4, atol=1e-6)

    # Routing counts and the load-balancing loss. HF's Switch loss uses f_i = n_i / T (sums to K);
    # ours (Megatron) uses f_i = n_i / (T K) and already carries the coefficient.
    logits_TE, _, ids_TK = block.gate(x_ref_BSD.detach().reshape(-1, 32))
    assert torch.equal(counts_E, torch.bincount(ids_TK.reshape(-1), minlength=4))
    hf_aux = load_balancing_loss_func((logits_TE,), num_experts=4, top_k=2)
    torch.testing.assert_close(aux_loss / hf.config.router_aux_loss_coef * 2, hf_aux,
                               rtol=1e-5, atol=1e-7)


def test_mixtral_config_errors_name_field_and_fix():
    cfg = hf_config()
    cfg.sliding_window = 8
    with pytest.raises(ConvertError, match=r"MixtralConfig.sliding_window = 8: .*Fix: set sliding_window=None"):
        model_config_from_mixtral(cfg)
    # A head dim other than hidden / heads is now supported: it becomes kv_channels.
    cfg = hf_config()
    cfg.head_dim = 16
    assert model_config_from_mixtral(cfg).head_dim == 16
