"""The mode rules in one place (moeplug.config.modes): every rule in the registry refuses its
own example with a one-line message naming the field, its value and the fix; the registry is
the only place the run asks; and an incompatible run is refused before any process group."""

from __future__ import annotations

import copy

import pytest

from moeplug.config import ConfigError, config_from_dict
from moeplug.config import modes
from moeplug.config.modes import NEEDS, RULES, Rule, check_modes
from moeplug.interfaces import Experts

# Where each section class lives in a config mapping (a message names the class).
_SECTIONS = {"RootConfig": "", "ModelConfig": "model", "MoEConfig": "model.moe",
             "RecomputeConfig": "model.recompute", "TrainConfig": "train",
             "ParallelConfig": "parallel", "RuntimeSection": "runtime", "PluginsConfig": "plugins"}


def _ids(rule: Rule) -> str:
    return f"{rule.mode}-{rule.needs}-{rule.reports}-{rule.check.__qualname__.split('.')[0]}"


def _value(rule: Rule):
    """The value the rule's message must name: its field in the example, else the default."""
    head, _, name = rule.reports.rpartition(".")
    path = rule.reports if head not in _SECTIONS else ".".join(
        p for p in (_SECTIONS[head], name) if p)
    node = copy.deepcopy(dict(rule.example))
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            node = None
            break
        node = node[part]
    if node is not None:
        return node
    value = config_from_dict({})
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _bare_experts(declares: dict) -> type:
    """An Experts class declaring only ``declares`` (every other capability at its default)."""
    return type("BareExperts", (Experts,), {"forward": lambda self, x, p, c: x, **declares})


def _lines(rule: Rule, without: bool = False) -> list[str]:
    """The error lines of the rule's example (``without``: with this rule taken out)."""
    rules = tuple(r for r in RULES if r is not rule) if without else RULES
    try:
        if rule.needs == "config":
            saved = modes.RULES
            modes.RULES = rules
            try:
                config_from_dict(copy.deepcopy(dict(rule.example)))
            finally:
                modes.RULES = saved
        else:
            cfg = config_from_dict(copy.deepcopy(dict(rule.example)))
            # the precision mode's rule reads a recipe that quantizes GEMMs beside the experts
            quantizing = type("QuantizingPrecision", (), {"quantizes_gemms": True})
            fact = ({"experts": _bare_experts(dict(rule.declares)),
                     "precision": quantizing if rule.mode == "precision" else None}
                    if rule.needs == "experts" else {"device": "cuda"})
            check_modes(cfg, rules=rules, **fact)
    except ConfigError as e:
        return e.errors
    return []


@pytest.mark.parametrize("rule", RULES, ids=_ids)
def test_every_rule_refuses_its_example_naming_field_value_and_fix(rule):
    assert rule.needs in NEEDS
    value = _value(rule)
    head = f"{rule.reports} = {value!r}"
    lines = _lines(rule)
    mine = [line for line in lines if line.startswith(head)]
    assert mine, (head, lines)
    # the line is this rule's: it goes when the rule is taken out of the registry
    assert not set(mine) & set(_lines(rule, without=True)), (rule, mine)
    for line in mine:
        assert "\n" not in line and ". Fix: " in line, line
        rule_text, fix = line[len(head):].split(". Fix: ", 1)
        assert rule_text.startswith((": ", " with ")) and len(rule_text) > 10, line
        assert len(fix) > 10, line


@pytest.mark.parametrize("needs", NEEDS)
def test_the_default_run_passes_every_rule(needs):
    cfg = config_from_dict({})
    fact = {"config": {}, "experts": {"experts": _bare_experts(
        {"budget_rows": True, "capturable": True, "can_recompute_activation": True,
         "runs_recipe": True}), "precision": type("QuantizingPrecision", (),
                                                  {"quantizes_gemms": True})},
        "device": {"device": "cuda"}}[needs]
    check_modes(cfg, **fact)
    # a CPU run meets no device rule, whatever it asks
    for rule in RULES:
        if rule.needs == "device":
            check_modes(config_from_dict(copy.deepcopy(dict(rule.example))), device="cpu")


def test_every_mode_states_its_rules_here():
    assert {r.mode for r in RULES} == {"sync_free", "capture", "overlap", "delay_wgrad",
                                       "recompute", "offload", "precision", "fsdp", "device"}
    # the paged stash is refused by each mode that cannot hold it, in that mode's module
    refusing_stash = {r.mode for r in RULES if r.example.get("runtime", {}).get("stash")}
    assert refusing_stash == {"capture", "overlap", "delay_wgrad", "fsdp"}
    assert all(r.needs in NEEDS for r in RULES)
    with pytest.raises(ValueError, match="needs = 'later' must be one of config, experts"):
        Rule("x", "later", "X.y", lambda f: None)
    with pytest.raises(TypeError, match="experts or device, not both"):
        check_modes(config_from_dict({}), experts=Experts, device="cuda")


def test_a_plugin_host_and_the_device_ask_the_same_registry(monkeypatch):
    """check_plugins and resolve_device run the registry's rules, not rules of their own: a
    rule added to the registry is asked by both."""
    from moeplug.plugin_host import check_plugins, load_host
    from moeplug.training import distributed as D

    def refuse(f):
        raise ConfigError(f"plugins.experts = {f.cfg.plugins.experts!r}: a new mode's rule. "
                          "Fix: none")
    added = (Rule("new", "experts", "plugins.experts", refuse),
             Rule("new", "device", "TrainConfig.device", refuse))
    monkeypatch.setattr(modes, "RULES", RULES + added)
    cfg = config_from_dict({})
    with pytest.raises(ConfigError, match="a new mode's rule"):
        check_plugins(load_host(cfg), cfg)
    monkeypatch.setattr(D.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(D.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="a new mode's rule"):
        D.resolve_device(config_from_dict({"train": {"device": "cuda"}}), num_local=1)


@pytest.mark.parametrize("sets, words", [
    # config: refused when the config loads, every broken rule on its own line
    (["model.moe.delay_wgrad_compute=true", "runtime.stash=true",
      "parallel.overlap_moe_expert_parallel_comm=true", "train.grad_accum_steps=1"],
     ["MoEConfig.delay_wgrad_compute = True: cannot be combined with runtime.stash",
      "ParallelConfig.overlap_moe_expert_parallel_comm = True: needs two micro-batches"]),
    # experts: refused once the plugin host created the backend
    (["runtime.sync_free=true", "runtime.capture=true", "plugins.experts=sequential"],
     ["plugins.experts = 'sequential': SequentialExperts does not declare capturable"]),
], ids=["config", "experts"])
def test_an_incompatible_run_exits_2_before_any_rank_starts(run_cli, tmp_path, sets, words):
    out = tmp_path / "run"
    args = ["train", "--nproc", "2", "--set", "parallel.ep=2", "--set", f"train.out_dir={out}"]
    for s in sets:
        args += ["--set", s]
    proc = run_cli(*args, timeout=120)  # refused in seconds; a run that started would not be
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)
    # no rank started: the launcher creates and locks the run directory before it spawns any
    assert not out.exists(), proc.stderr
