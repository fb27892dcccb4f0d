"""Every config error path names the field, the value and the fix — and fires before training.

The in-process tests cover each validation rule; the subprocess tests prove that the CLI turns
any of them into exit status 2 with one readable paragraph and no traceback, before any data is
prepared (the cache directory stays empty).
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from moeplug.config import (ConfigError, DataConfig, ModelConfig, MoEConfig, ParallelConfig,
                            PluginsConfig, RootConfig, TrainConfig, apply_overrides,
                            config_from_dict, load_config)


def assert_names(err: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(err.value)
    for part in parts:
        assert part in msg, f"{part!r} missing from error message: {msg}"
    assert "Fix:" in msg, f"no fix in error message: {msg}"


@pytest.mark.parametrize("cls, kwargs, parts", [
    (MoEConfig, {"num_experts": 4, "top_k": 5}, ["top_k", "5", "num_experts (4)", "top_k <= 4"]),
    (MoEConfig, {"num_experts": 0}, ["num_experts", "0", "positive integer"]),
    (MoEConfig, {"aux_loss_coeff": -1.0}, ["aux_loss_coeff", "-1.0", ">= 0"]),
    (MoEConfig, {"activation": "relu"}, ["activation", "'relu'", "'swiglu'", "'gelu'"]),
    (ModelConfig, {"hidden_size": 30, "num_heads": 4},
     ["hidden_size", "30", "num_heads (4)", "30 % 4 = 2", "multiple of num_heads"]),
    (ModelConfig, {"num_heads": 8, "num_kv_heads": 3}, ["num_kv_heads", "3", "num_heads (8)", "divisor"]),
    (ModelConfig, {"hidden_size": 36, "num_heads": 4}, ["hidden_size", "36", "head dim 9", "even"]),
    (ModelConfig, {"num_layers": 2, "first_k_dense": 3}, ["first_k_dense", "3", "num_layers (2)"]),
    (ModelConfig, {"hidden_size": "big"}, ["hidden_size", "'big'", "integer"]),
    (TrainConfig, {"lr": 1e-3, "min_lr": 1e-2}, ["min_lr", "0.01", "lr (0.001)", "min_lr <= lr"]),
    (TrainConfig, {"beta2": 1.0}, ["beta2", "1.0", "[0, 1)"]),
    (TrainConfig, {"micro_batch_size": 0}, ["micro_batch_size", "0", "positive integer"]),
    (TrainConfig, {"grad_clip": -1}, ["grad_clip", "-1", ">= 0"]),
    (DataConfig, {"tokenizer": "wordpiece"}, ["tokenizer", "'wordpiece'", "'bpe', 'bytes' nor an existing path"]),
    (DataConfig, {"vocab_size": 100}, ["vocab_size", "100", "(256, 65536]"]),
    (DataConfig, {"corpus": "/no/such/dir"}, ["corpus", "'/no/such/dir'", "no such file or folder"]),
    (PluginsConfig, {"router": ""}, ["router", "''", "moeplug plugins"]),
    (PluginsConfig, {"router_options": [1]}, ["router_options", "[1]", "mapping"]),
    (PluginsConfig, {"block": 3}, ["block", "3", "must be a list"]),
])
def test_field_errors_name_field_value_and_fix(cls, kwargs, parts):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert_names(err, cls.__name__, *parts)


def test_warmup_longer_than_a_short_run_is_clamped_not_refused():
    # `--steps 10` with the default 30 warmup steps: the run warms up over its 10 steps.
    from moeplug.training.optim import lr_at
    cfg = TrainConfig(steps=10, warmup_steps=30, lr=1e-3, min_lr=1e-4)
    assert cfg.warmup_steps == 30 and cfg.effective_warmup_steps == 10
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert TrainConfig(steps=100, warmup_steps=30).effective_warmup_steps == 30


def test_every_problem_of_a_config_is_reported_at_once():
    # Two fields of one section, another section, an unknown key and a cross-section check
    # (heads vs TP): one ConfigError holding each message, not just the first.
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.min_lr=1", "train.beta1=2", "model.moe.top_k=99",
                           "model.hidden_sise=64", "parallel.tp=3", "train.steps=5"])
    assert len(err.value.errors) == 5, err.value.errors
    for part in ["TrainConfig.min_lr = 1.0", "TrainConfig.beta1 = 2.0", "MoEConfig.top_k = 99",
                 "did you mean 'hidden_size'", "num_heads 8 not divisible by TP 3"]:
        assert part in str(err.value), str(err.value)
    # A value that breaks later checks (a string, a zero) is reported, not a traceback.
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.num_heads=0", "train.steps=abc", "data.tokenizer=x"])
    assert sorted(e.split(" = ")[0] for e in err.value.errors) == [
        "DataConfig.tokenizer", "ModelConfig.num_heads", "TrainConfig.steps"]
    # No follow-on error from a bad count: a zero num_experts is one error, not also a top_k
    # "exceeding" it with the fix "set top_k <= 0".
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.moe.num_experts=0"])
    assert [e.split(" = ")[0] for e in err.value.errors] == ["MoEConfig.num_experts"], \
        err.value.errors


def test_seq_len_longer_than_model_context_is_a_cross_check():
    with pytest.raises(ConfigError) as err:
        RootConfig(model=ModelConfig(max_seq_len=64), train=TrainConfig(seq_len=128))
    assert_names(err, "TrainConfig.seq_len", "128", "model.max_seq_len (64)", "train.seq_len <= 64")


def test_unknown_key_suggests_the_closest_name():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"hiden_size": 64}})
    assert_names(err, "ModelConfig", "model.hiden_size", "did you mean 'hidden_size'")


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"train": {"zzz": 1}})
    assert_names(err, "train.zzz", "valid keys:", "micro_batch_size")


def test_section_that_is_not_a_mapping():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model=5"])
    assert_names(err, "model = 5", "must be a mapping (the ModelConfig section)")


def test_override_without_equals_sign():
    with pytest.raises(ConfigError) as err:
        apply_overrides({}, ["model.hidden_size"])
    assert_names(err, "'model.hidden_size'", "KEY=VALUE", "--set model.moe.num_experts=8")


def test_override_through_a_scalar(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 5\n  warmup_steps: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), ["train.steps.x=1"])
    assert_names(err, "'train.steps.x=1'", "'steps' is not a section")


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert_names(err, str(path), "top level must be a mapping", "model:")


def test_overrides_are_typed_and_applied_after_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  moe:\n    num_experts: 4\n    top_k: 1\n")
    cfg = load_config(str(path), ["model.moe.num_experts=16", "train.lr=1e-3", "plugins.block=a,b"])
    assert cfg.model.moe.num_experts == 16 and cfg.model.moe.top_k == 1
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.plugins.block == ["a", "b"]


def test_a_section_set_as_a_mapping_merges_into_it():
    # --set model.moe={num_experts: 4} once replaced the whole section: default.yaml's
    # ffn_hidden_size went back to the dataclass default without a word
    from moeplug.cli import default_config_path
    cfg = load_config(default_config_path(), ["model.moe={num_experts: 4}"])
    default = load_config(default_config_path())
    assert cfg.model.moe.num_experts == 4
    assert cfg.model.moe.ffn_hidden_size == default.model.moe.ffn_hidden_size != 384


def test_a_key_given_twice_in_a_yaml_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden_size: 128\nmodel:\n  num_layers: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert_names(err, str(path), "key 'model' appears twice", "lines 1 and 3", "merge the two")


def test_a_config_path_that_is_no_regular_file_says_so():
    with pytest.raises(ConfigError) as err:
        load_config("/dev/null")
    assert_names(err, "'/dev/null' is not a regular file", "--config")


@pytest.mark.parametrize("override, parts", [
    ("train.seed=-1", ["TrainConfig.seed", "-1", "[0, 2**63)"]),
    (f"train.seed={2 ** 64}", ["TrainConfig.seed", str(2 ** 64), "[0, 2**63)"]),
])
def test_a_seed_the_generators_cannot_take_is_refused(override, parts):
    # both once passed, and the run died in a traceback after the model was built
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert_names(err, *parts)


@pytest.mark.parametrize("overrides, parts", [
    (["parallel.tp=2", "model.dense_ffn_hidden_size=255"],
     ["ModelConfig.dense_ffn_hidden_size = 255", "parallel.tp = 2", "multiple of 2"]),
    (["parallel.tp=2", "model.vocab_size=2049"],
     ["ModelConfig.vocab_size = 2049", "parallel.tp = 2", "e.g. 2050"]),
    # the field's own value after the product (it once printed cp = 4 for cp 2)
    (["parallel.cp=2", "train.seq_len=30"],
     ["seq_len 30 not divisible by 2·CP = 4", "(ParallelConfig.cp = 2)"]),
])
def test_tensor_parallel_splits_are_checked_before_any_rank(overrides, parts):
    # both TP splits once passed, and every rank's model build raised a traceback
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert_names(err, *parts)


def test_the_tokenizers_vocabulary_is_padded_and_checked_against_tp_before_the_ranks_start():
    """model.vocab_size 0: the tokenizer's ids padded up to a multiple of
    make_vocab_size_divisible_by (Megatron's; 128), whatever the layout; rows that do not split
    over TP, and ids past an explicit vocab_size, are refused naming the field and the fix."""
    cfg = load_config(None, ["parallel.tp=2"])
    assert cfg.model_vocab_size(2048) == 2048
    assert cfg.model_vocab_size(2049) == 2176  # 17 x 128
    assert load_config(None, []).model_vocab_size(2049) == 2176  # the same model at TP 1
    assert load_config(None, ["model.make_vocab_size_divisible_by=1"]).model_vocab_size(2049) \
        == 2049
    odd = load_config(None, ["parallel.tp=2", "model.make_vocab_size_divisible_by=3"])
    with pytest.raises(ConfigError) as err:
        odd.model_vocab_size(2049)
    assert_names(err, "ModelConfig.make_vocab_size_divisible_by = 3", "2049 ids padded to 2049",
                 "parallel.tp = 2", "multiple of 2")
    assert load_config(None, ["parallel.tp=2", "model.vocab_size=4096"]).model_vocab_size(
        2049) == 4096
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.vocab_size=1024"]).model_vocab_size(2049)
    assert_names(err, "ModelConfig.vocab_size = 1024", "2049 ids", "data.tokenizer = 'bpe'",
                 "Fix:")


def test_optional_float_fields_read_yaml_exponents_too():
    # YAML 1.1 reads 1e-6 as a string; latent_norm_eps (float or null) refused it
    assert load_config(None, ["model.mla.latent_norm_eps=1e-6"]).model.mla.latent_norm_eps \
        == 1e-6


def test_packaged_default_config_is_valid_and_self_consistent():
    from moeplug.cli import default_config_path
    cfg = load_config(default_config_path())
    assert cfg.train.seq_len <= cfg.model.max_seq_len
    assert cfg.data.corpus == "shakespeare"


# --------------------------------------------------------------------------------------------
# Plugins: unknown / blocked names and bad options are config errors too
# --------------------------------------------------------------------------------------------

def test_unknown_plugin_lists_what_exists(tiny_cfg):
    from moeplug.cli import check_plugins
    from moeplug.plugin_host import PluginHost
    cfg = tiny_cfg("plugins.router=topkk")
    with pytest.raises(ConfigError) as err:
        check_plugins(PluginHost.load(block=cfg.plugins.block), cfg)
    assert_names(err, "router", "'topkk'", "did you mean 'topk'")


def test_blocked_plugin_says_who_blocked_it(tiny_cfg):
    from moeplug.cli import check_plugins
    from moeplug.plugin_host import PluginHost
    cfg = tiny_cfg("plugins.block=[topk]")
    with pytest.raises(ConfigError) as err:
        check_plugins(PluginHost.load(block=cfg.plugins.block), cfg)
    assert_names(err, "router", "'topk'", "blocked by plugins.block", "remove 'topk' from plugins.block")


def test_bad_plugin_option_names_the_option(tiny_cfg):
    from moeplug.cli import check_plugins
    from moeplug.plugin_host import PluginHost
    cfg = tiny_cfg("plugins.router_options={no_such_option: 1}")
    with pytest.raises(ConfigError) as err:
        check_plugins(PluginHost.load(), cfg)
    assert_names(err, "router", "plugins.router_options.no_such_option", "1")


def test_every_plugins_problem_is_reported_at_once(tiny_cfg):
    # the first unknown name once hid the others (and a bad router option the dispatcher's)
    from moeplug.cli import check_plugins
    from moeplug.plugin_host import PluginHost
    cfg = tiny_cfg("plugins.dispatcher=all2all", "plugins.experts=groupd",
                   "plugins.precision=fp16", "plugins.router_options={nosuch: 1}")
    with pytest.raises(ConfigError) as err:
        check_plugins(PluginHost.load(), cfg)
    assert len(err.value.errors) == 4, err.value.errors
    assert_names(err, "unknown dispatcher 'all2all'", "unknown experts 'groupd'",
                 "unknown precision 'fp16'", "plugins.router_options.nosuch")


@pytest.mark.parametrize("overrides, want, not_want", [
    (["model.num_layers=0"], "num_layers = 0", "first_k_dense"),
    (["model.kv_channels=7"], "kv_channels = 7", "ModelConfig.hidden_size"),
])
def test_an_invalid_field_brings_no_follow_on_error_with_an_impossible_fix(overrides, want,
                                                                          not_want):
    # "first_k_dense = 1: exceeds num_layers (0). Fix: set first_k_dense <= 0", and an odd
    # kv_channels blamed on hidden_size too
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert len(err.value.errors) == 1 and want in str(err.value), err.value.errors
    assert not_want not in str(err.value)


# --------------------------------------------------------------------------------------------
# The CLI: exit 2, one paragraph, no traceback, nothing prepared
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, parts", [
    (["--set", "model.moe.top_k=99"], ["MoEConfig.top_k = 99", "num_experts"]),
    (["--set", "train.min_lr=1"], ["TrainConfig.min_lr = 1", "min_lr <= lr"]),
    (["--set", "model.hidden_sise=64"], ["model.hidden_sise", "did you mean 'hidden_size'"]),
    (["--set", "model.moe.top_k"], ["'model.moe.top_k'", "KEY=VALUE"]),
    (["--router", "no_such_router"], ["unknown router 'no_such_router'", "topk"]),
    (["--set", "plugins.block=[topk]"], ["router 'topk'", "blocked by plugins.block"]),
    (["--resume", "/no/such/checkpoint"], ["TrainConfig.resume = '/no/such/checkpoint'", "'auto'"]),
    (["--config", "/no/such.yaml"], ["'/no/such.yaml' does not exist"]),
])
def test_cli_config_errors_exit_2_before_any_work(run_cli, cli_env, tmp_path, args, parts):
    cache_dir = tmp_path / "cache"
    t0 = time.perf_counter()
    proc = run_cli("train", "--out", str(tmp_path / "run"), *args, timeout=120,
                   env=dict(cli_env, MOEPLUG_CACHE=str(cache_dir)))
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    for part in parts:
        assert part in proc.stderr, proc.stderr
    assert "Fix:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, "one paragraph, not a log"
    # Nothing heavy ran: no corpus was tokenised into the cache, no run directory was made.
    assert not os.path.exists(cache_dir) or not os.listdir(cache_dir)
    assert not (tmp_path / "run").exists()
    assert elapsed < 60


def test_cli_reports_all_problems_of_one_command(run_cli, cli_env, tmp_path):
    """`--steps 10` (under the default 30 warmup steps) is no longer an error, and every other
    mistake of the command, config and plugins alike, comes out in one go, a line each."""
    cache_dir = tmp_path / "cache"
    proc = run_cli("train", "--out", str(tmp_path / "run"), "--steps", "10",
                   "--set", "model.moe.top_k=9", "--set", "train.min_lr=1",
                   "--set", "parallel.tp=3", timeout=120,
                   env=dict(cli_env, MOEPLUG_CACHE=str(cache_dir)))
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert all(l.startswith("moeplug: configuration error: ") and "Fix:" in l for l in lines)
    for part, line in zip(["MoEConfig.top_k = 9", "TrainConfig.min_lr = 1.0",
                           "not divisible by TP 3"], lines):
        assert part in line, lines
    proc = run_cli("train", "--out", str(tmp_path / "run"), "--router", "topkk",
                   "--resume", str(tmp_path / "nothing"), timeout=120,
                   env=dict(cli_env, MOEPLUG_CACHE=str(cache_dir)))
    assert proc.returncode == 2
    assert "unknown router 'topkk'" in proc.stderr and "TrainConfig.resume" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr
    # a bad --nproc needs no config: it comes with the fields' problems
    proc = run_cli("train", "--out", str(tmp_path / "run"), "--set", "model.moe.top_k=9",
                   "--nproc", "0", timeout=120, env=dict(cli_env, MOEPLUG_CACHE=str(cache_dir)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 2, proc.stderr
    assert "MoEConfig.top_k = 9" in lines[0] and "--nproc 0: must be >= 1" in lines[1]
    assert not os.path.exists(cache_dir) and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# The config reference (docs/config.md) stays complete and correct
# --------------------------------------------------------------------------------------------

def _all_fields(obj, prefix=""):
    import dataclasses
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _all_fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def test_readme_config_reference_lists_every_field_with_its_default():
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in readme.splitlines()
            if line.startswith("| `") and line.count("|") >= 4}
    fields = dict(_all_fields(RootConfig()))
    missing = [k for k in fields if f"`{k}`" not in rows]
    assert not missing, f"docs/config.md lacks: {missing}"
    wrong = [k for k, v in fields.items() if f"| `{v!r}` |" not in rows[f"`{k}`"]]
    assert not wrong, f"docs/config.md shows a stale default for: {wrong}"
    described = [k for k in fields if not rows[f"`{k}`"].rstrip(" |").split("|")[-1].strip()]
    assert not described, f"docs/config.md rows without a meaning: {described}"


def test_float_fields_accept_yaml_exponents_and_reject_words():
    assert load_config(None, ["train.lr=1e-3", "train.min_lr=0"]).train.lr == 1e-3
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.lr=fast"])
    assert_names(err, "TrainConfig.lr", "'fast'", "number")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "nope.yaml"))
    assert_names(err, "nope.yaml", "does not exist", "--config")


def test_config_file_with_yaml_syntax_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: [64\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert_names(err, "bad.yaml", "not valid YAML", "line")


def test_resolve_pipeline_rule_matches_the_rank_tables():
    # config.ParallelConfig.resolve checks the dense and expert grids' pipeline groups by
    # arithmetic (the strides of 'pp'); moeplug.parallel.layout builds the real tables.
    import itertools

    from moeplug.parallel.layout import _grid_sizes, rank_groups
    orders = ["-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))]
    checked = 0
    for order, tp, cp, ep, etp, pp in itertools.product(orders, (1, 2), (1, 2), (1, 2, 4),
                                                        (1, 2), (1, 2)):
        pcfg = ParallelConfig(tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, order=order,
                              sequence_parallel=True)
        try:
            out = pcfg.resolve(8)
        except ConfigError as e:
            if "different pipeline groups" not in str(e):
                continue  # another rule (tiling) refused it: not what this test compares
            out = None
        if out is None:
            resolved = dataclasses.replace(pcfg, dp=8 // (tp * cp * pp))
        else:
            resolved = out
        dense, expert = _grid_sizes(resolved)
        same = rank_groups(dense, order, ("pp",)) == rank_groups(expert, order, ("pp",))
        assert same == (out is not None), (order, tp, cp, ep, etp, pp)
        checked += 1
    assert checked > 500
