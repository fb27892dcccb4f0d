"""The aux-loss convention of an import, measured against transformers itself.

moeplug's ``aux_loss`` is Megatron's: a Switch loss per MoE layer, summed over the layers.
transformers' Mixtral/Qwen3-MoE pool every layer's router logits into one loss
(``load_balancing_loss_func``, applied only with ``output_router_logits``). The router option
``load_balancing_type: hf_aux_loss`` computes transformers' formula; here a random Qwen3-MoE is
imported and, on the very same router logits, moeplug's aux term and its gradient equal
transformers' own (the loss the HF model adds with ``output_router_logits=True``) at several
layer counts and top-k; and the ratio of the two conventions is what README says (~ L / K).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from moeplug.config import ConfigError, ParallelConfig, config_from_dict  # noqa: E402
from moeplug.convert import load_hf_into_moeplug  # noqa: E402
from moeplug.build import build_model  # noqa: E402
from moeplug.plugin_host import PluginError, PluginHost  # noqa: E402
from moeplug.routing.pooled import pooled_aux_loss, pooled_aux_stats  # noqa: E402

V, COEF = 64, 0.02


def _hf(layers: int, top_k: int):
    torch.manual_seed(layers * 10 + top_k)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=top_k > 1,
        max_position_embeddings=64, router_aux_loss_coef=COEF))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.3)
    hf.config._attn_implementation = "eager"
    return hf.train()


def _imported(hf, tmp_path, load_balancing_type: str):
    hf.save_pretrained(tmp_path / "hf")
    cfg, model, _ = load_hf_into_moeplug(str(tmp_path / "hf"))
    data = cfg.to_dict()
    data["plugins"]["router_options"]["load_balancing_type"] = load_balancing_type
    cfg = config_from_dict(data)
    ours = build_model(cfg, PluginHost.load(), cfg.model.vocab_size)
    ours.load_state_dict(model.state_dict())
    return cfg, ours.train()


@pytest.mark.parametrize("layers, top_k", [(1, 2), (2, 1), (2, 2), (4, 2), (4, 4), (3, 3)])
def test_hf_aux_loss_equals_transformers_load_balancing_loss(layers, top_k, tmp_path):
    hf = _hf(layers, top_k)
    _, ours = _imported(hf, tmp_path, "hf_aux_loss")
    x_BS = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = hf(input_ids=x_BS, output_router_logits=True)
    out = ours(x_BS)
    # transformers adds router_aux_loss_coef * aux_loss to its loss
    torch.testing.assert_close(out.aux_loss, COEF * ref.aux_loss, rtol=1e-6, atol=1e-9)
    # and its own function on the router logits it recorded says the same
    direct = load_balancing_loss_func(ref.router_logits, 8, top_k)
    torch.testing.assert_close(ref.aux_loss, direct, rtol=0, atol=0)
    # the gradient reaches every layer's gate as transformers' does
    (COEF * ref.aux_loss).backward()
    out.aux_loss.backward()
    for i in range(layers):
        torch.testing.assert_close(ours.blocks[i].ffn.router.weight.grad,
                                   hf.model.layers[i].mlp.gate.weight.grad, rtol=1e-4, atol=1e-8)


def test_pooled_formula_on_given_logits_equals_transformers_function():
    """The formula alone, on random logits of uneven layers, with and without grad."""
    gen = torch.Generator().manual_seed(0)
    for layers, top_k in ((2, 2), (5, 3), (8, 1)):
        logits = tuple(torch.randn(20, 6, generator=gen, requires_grad=True)
                       for _ in range(layers))
        ours = pooled_aux_loss([pooled_aux_stats(t, top_k, 1.0) for t in logits])
        ref = load_balancing_loss_func(logits, 6, top_k)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
        g_ours = torch.autograd.grad(ours, logits)
        g_ref = torch.autograd.grad(load_balancing_loss_func(logits, 6, top_k), logits)
        for a, b in zip(g_ours, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


def conventions_ratio(layers: int, top_k: int, folder) -> float:
    """moeplug's default aux loss (Megatron's per-layer sum) over transformers' pooled one, at
    the same coefficient, on one batch of an imported random Qwen3-MoE."""
    hf = _hf(layers, top_k)
    x_BS = torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(5))
    _, megatron = _imported(hf, folder / "a", "aux_loss")
    _, pooled = _imported(hf, folder / "b", "hf_aux_loss")
    with torch.no_grad():
        return float(megatron(x_BS).aux_loss / pooled(x_BS).aux_loss)


@pytest.mark.parametrize("layers, top_k", [(2, 2), (4, 2)])
def test_per_layer_sum_is_about_layers_over_top_k_times_hf(layers, top_k, tmp_path):
    """What README and ``convert import`` say: at the same coefficient moeplug's default aux
    loss (Megatron's per-layer sum) is ~L/K times transformers' pooled one."""
    ratio = conventions_ratio(layers, top_k, tmp_path)
    assert 0.7 * layers / top_k < ratio < 1.4 * layers / top_k, ratio


def test_hf_aux_loss_is_refused_where_a_rank_holds_part_of_the_layers_or_tokens(tiny_cfg):
    host = PluginHost.load()
    opts = {"load_balancing_type": "hf_aux_loss"}
    for degree in ("tp", "cp", "pp"):
        with pytest.raises(PluginError, match=rf"parallel\.{degree} = 2.*Fix:"):
            host.check_parallel("router", "topk", opts, ParallelConfig(**{degree: 2}))
    host.check_parallel("router", "topk", opts, ParallelConfig(dp=2, ep=2))  # fine
    cfg = tiny_cfg("plugins.router_options.load_balancing_type=hf_aux_loss",
                   "model.mtp_num_layers=1")
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        build_model(cfg, host, 256)


def test_training_only_router_options_are_no_model_difference(tiny_cfg):
    """A resume may change the losses and rates a router trains with, not how it routes."""
    from moeplug.config import model_differences
    host = PluginHost.load()
    saved = tiny_cfg()
    changed = tiny_cfg("plugins.router_options.load_balancing_type=[aux_loss, hf_aux_loss]",
                       "plugins.router_options.aux_loss_coeff=[0.1, 0.2]",
                       "plugins.router_options.z_loss_coeff=0.001",
                       "plugins.router_options.bias_update_rate=0.01",
                       "plugins.router_options.input_jitter_eps=0.01",
                       "model.moe.aux_loss_coeff=0.5", "model.mtp_loss_scaling_factor=0.3")
    options = lambda name, opts: host.defining_options("router", name, opts)  # noqa: E731
    assert model_differences(saved, changed, options) == []
    routing = tiny_cfg("plugins.router_options.score_function=sigmoid")
    assert [d[0] for d in model_differences(saved, routing, options)] == [
        "plugins.router_options.score_function"]


def test_convert_import_says_the_convention_it_trains_with(tmp_path):
    from moeplug.convert import import_hf, import_notes
    from tests.test_hf_interop import deepseek_v3
    hf = _hf(4, 2)
    hf.save_pretrained(tmp_path / "qwen")
    ckpt = import_hf(str(tmp_path / "qwen"), str(tmp_path / "q"))
    notes = " ".join(import_notes(str(tmp_path / "qwen"), ckpt))
    assert "summed over the 4 layers, coefficient 0.02" in notes
    assert "top_k / layers = 2/4" in notes and "output_router_logits (config.json: false)" in notes
    assert "load_balancing_type=none" in notes and "tokenizer: none imported" in notes
    deepseek_v3().save_pretrained(tmp_path / "ds")
    ckpt = import_hf(str(tmp_path / "ds"), str(tmp_path / "d"))
    notes = " ".join(import_notes(str(tmp_path / "ds"), ckpt))
    assert "seq_aux_loss, coefficient 0.0001" in notes and "bias_update_rate 0.001" in notes
    assert "trains with neither" in notes


if __name__ == "__main__":  # `python tests/test_hf_aux_loss.py`: the ratios README quotes
    import sys
    import tempfile
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    for layers, top_k in ((2, 2), (4, 2), (8, 2), (4, 1)):
        ratio = conventions_ratio(layers, top_k, Path(tempfile.mkdtemp()))
        print(f"{layers} MoE layers, top-{top_k}: moeplug aux_loss / transformers' = "
              f"{ratio:.2f} (layers / top-k = {layers / top_k:.2f})")
