"""``convert import`` reads config.json as transformers does: a missing key takes the default of
the family's transformers config class, not moeplug's own (a sweep found DeepSeek-V3 imported
with routed_scaling_factor 1.0, no shared expert and no groups, Mixtral with rope_theta 1e4, and
raw KeyError tracebacks for rms_norm_eps, max_position_embeddings, num_experts_per_tok, ...).

The defaults live in a table per family (moeplug.convert.*.HF_DEFAULTS, so import needs no
transformers); the first tests pin every entry to the installed transformers' classes, the
others import tiny models whose config.json lost those keys and compare the logits with
transformers' from_pretrained of the same directory.

Legend: B batch, S sequence, V vocab.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from moeplug.convert import FAMILIES, import_hf, root_config_from_hf  # noqa: E402
from moeplug.convert.common import ConvertError, HFConfig  # noqa: E402
from test_hf_interop import (  # noqa: E402
    ATOL, deepseek_v3, logits_and_loss, mixtral, qwen3_moe, randomised, rebuilt_from_checkpoint,
    tokens)


def _from_config_json(tmp_path, data: dict):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_defaults_table_matches_the_installed_transformers(model_type, tmp_path):
    """Every default the importer assumes is what transformers reads for a missing key, and
    every alias (attribute_map) names the same field there."""
    fam = FAMILIES[model_type]
    assert type(_from_config_json(tmp_path, {"model_type": model_type})).__name__ == fam.FAMILY
    hf = _from_config_json(tmp_path, {"model_type": model_type})
    for key, value in fam.HF_DEFAULTS.items():
        if key == "rope_theta":  # transformers 5 keeps it in rope_parameters
            assert hf.rope_parameters["rope_theta"] == value, key
        elif key == "mlp_only_layers":  # Qwen3MoeConfig turns None into []
            assert (getattr(hf, key) or None) == value, key
        else:
            assert getattr(hf, key, None) == value, (key, getattr(hf, key, None), value)
    for alias, name in fam.HF_ALIASES.items():
        hf = _from_config_json(tmp_path, {"model_type": model_type, alias: 7})
        assert getattr(hf, name) == 7, alias
    # every key the importer reads has a default: a config.json of model_type alone imports
    root_config_from_hf({"model_type": model_type})


def test_a_key_without_a_default_is_one_line_naming_it():
    hf = HFConfig("MixtralConfig", {})
    with pytest.raises(ConvertError, match=r"^config.json lacks 'rope_scaling_x', which "
                                           r"MixtralConfig has no default for. Fix: add"):
        hf["rope_scaling_x"]
    with pytest.raises(ConvertError, match=r"^config.json has no model_type .*Fix: add "
                                           r"\"model_type\": one of deepseek_v3, mixtral"):
        root_config_from_hf({"hidden_size": 32})


# Each family's tiny model, with the keys that are stripped from its config.json set to
# transformers' defaults (so from_pretrained of the stripped directory builds the same model),
# and those keys. Only keys that do not set a tensor's shape are stripped.
STRIPPED = {
    "mixtral": (lambda: mixtral(rope_parameters=None, num_attention_heads=8,
                                num_key_value_heads=8, max_position_embeddings=4096 * 32,
                                rms_norm_eps=1e-5, router_aux_loss_coef=0.001),
                ["rope_parameters", "rope_theta", "rms_norm_eps", "max_position_embeddings",
                 "num_experts_per_tok", "num_key_value_heads", "head_dim", "sliding_window",
                 "router_jitter_noise", "router_aux_loss_coef", "tie_word_embeddings",
                 "hidden_act", "initializer_range", "bos_token_id", "eos_token_id",
                 "pad_token_id"]),
    "qwen3_moe": (lambda: qwen3_moe(num_experts=8, num_experts_per_tok=8, mlp_only_layers=None,
                                    norm_topk_prob=False, num_key_value_heads=4,
                                    max_position_embeddings=32768, rms_norm_eps=1e-6),
                  ["rope_parameters", "rope_theta", "rms_norm_eps", "max_position_embeddings",
                   "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
                   "mlp_only_layers", "num_key_value_heads", "use_sliding_window",
                   "sliding_window", "attention_bias", "hidden_act", "router_aux_loss_coef",
                   "tie_word_embeddings", "initializer_range"]),
    # 16 experts: n_group 8 x 2, top-8 from topk_group 4; layers 0-2 dense (first_k 3)
    "deepseek_v3": (lambda: deepseek_v3(n_routed_experts=16, num_experts_per_tok=8, n_group=8,
                                        topk_group=4, first_k_dense_replace=3,
                                        num_hidden_layers=4, n_shared_experts=1,
                                        routed_scaling_factor=2.5, max_position_embeddings=4096,
                                        rms_norm_eps=1e-6),
                    ["routed_scaling_factor", "n_shared_experts", "n_group", "topk_group",
                     "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
                     "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
                     "rope_interleave", "hidden_act", "attention_bias", "tie_word_embeddings",
                     "initializer_range", "num_nextn_predict_layers", "bos_token_id",
                     "eos_token_id", "pad_token_id"]),
}


@pytest.mark.parametrize("model_type", sorted(STRIPPED))
def test_import_without_optional_keys_matches_from_pretrained(model_type, tmp_path):
    build, keys = STRIPPED[model_type]
    hf_dir = tmp_path / "hf"
    randomised(build()).save_pretrained(hf_dir)
    cfg_path = hf_dir / "config.json"
    data = json.loads(cfg_path.read_text())
    data = {k: v for k, v in data.items() if k not in keys}
    if model_type == "mixtral":  # MixtralConfig's alias of num_local_experts
        data["num_experts"] = data.pop("num_local_experts")
    cfg_path.write_text(json.dumps(data))
    (hf_dir / "generation_config.json").unlink()
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    x_BS = tokens()
    with torch.no_grad():
        want = ref(input_ids=x_BS, labels=x_BS)
    ckpt = import_hf(str(hf_dir), str(tmp_path / "ckpt"))
    ours = rebuilt_from_checkpoint(ckpt)
    with torch.no_grad():
        logits_BSV, loss = logits_and_loss(ours, x_BS)
    torch.testing.assert_close(logits_BSV, want.logits[:, :-1], rtol=0, atol=ATOL)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=ATOL)
    meta = json.loads((tmp_path / "ckpt" / "step_000000" / "meta.json").read_text())
    m = meta["config"]["model"]
    assert m["max_seq_len"] == ref.config.max_position_embeddings
    assert m["norm_eps"] == ref.config.rms_norm_eps
    assert m["rope_theta"] == ref.config.rope_parameters["rope_theta"]
    if model_type != "deepseek_v3":  # the balance loss's weight, which logits do not show
        assert m["moe"]["aux_loss_coeff"] == ref.config.router_aux_loss_coef == 0.001
    assert meta["hf"]["token_ids"] == {k: getattr(ref.config, k) for k in
                                       ("bos_token_id", "eos_token_id", "pad_token_id")}
