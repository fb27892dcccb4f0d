"""fp8_delayed's step-to-step state: one history entry per optimizer step, reduced over the ranks
of a stage (Transformer Engine's ``reduce_amax``), untouched by evaluation and by recompute.

The parallel proof compares histories, not losses: delayed scaling's first step quantizes at
scale 1 (TE's initial scale), where the gradients' E5M2 rounding depends on how the loss was
divided over micro-batches and ranks, so the runs part by ~1e-3 after that step whatever the
scales. What reduction promises is checked directly: after a step every rank of the stage holds
the same history under each (parameter, global expert, role), and each forward operand's
(``x``, ``w``) is the max of the amaxes every rank of the stage saw for it, bit for bit (what
the reduction does, exact by construction in every layout), and equals the one-process run's
amax of the same tensor. That last comparison is exact only where the layout computes each
operand in one process's order. Under TP the activations (and ETP's experts) differ from one
process in bf16 (row-parallel partial sums), so there only the weights' amaxes (the max over
the shards) are compared with one process. Under CP each rank's attention merges partial
softmax results over the K/V chunks (another summation order, rounded to bf16 per chunk), so
the activations that follow - the expert inputs among them - may differ from one process's by
a few bf16 roundings: their amaxes are compared within ``CP_ULPS`` units in the last place of
bf16 at the one-process value (seen: 2 ulps, 0.099609375 against 0.1005859375, on an AMD Zen 4
host; bitwise on Intel hosts, whose GEMM library summed alike). The weights' amaxes stay exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeplug.testing.distributed import run_distributed

V = 64
DELAYED = {"dispatcher": "alltoall", "precision": "fp8_delayed"}
WORLD2 = {"dp2": {}, "ep2": {"ep": 2}, "cp2": {"cp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}
WORLD4 = {"ep2_dp4": {"ep": 2}, "tp2_ep4_sp": {"tp": 2, "ep": 4, "sequence_parallel": True},
          "etp2_ep2": {"ep": 2, "etp": 2}}


# Units in the last place of bf16 by which a CP layout's activation amaxes may differ from one
# process's (module docstring): three times the 2 seen, for the few roundings that may add up.
CP_ULPS = 6


def _by_key(precision, model, groups, value) -> dict:
    """{(parameter name, global expert or None, role): value(scaler)} of this rank."""
    from moeplug.parallel import expert_param_names
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    first = {id(params[n]): (0 if groups is None else groups.rank_in("ep")) * params[n].shape[0]
             for n in expert_param_names(model)}
    out = {}
    for (key, role), s in precision.recipe.scalers.items():
        pid, e = key if isinstance(key, tuple) else (key, None)
        out[(names[pid], None if e is None else first[pid] + e, role)] = value(s)
    return out


def _histories(precision, model, groups) -> dict:
    """{(parameter name, global expert or None, role): (history, scale)} of this rank."""
    return _by_key(precision, model, groups, lambda s: (s.history.tolist(), float(s.scale)))


def _seen_amaxes(precision, model, groups) -> dict:
    """Wrap the recipe's end_step to keep {key: this rank's own amax} of the step, before the
    ranks' amaxes are reduced (None for a GEMM this rank never ran)."""
    seen, end_step = {}, precision.recipe.end_step

    def spy(names, experts, group=None, train=True):
        if train:
            seen.update(_by_key(precision, model, groups, lambda s: None if s.pending is None
                               else float(s.pending)))
        return end_step(names, experts, group, train)
    precision.recipe.end_step = spy
    return seen


def _bf16_ulps(a: float, b: float) -> float:
    """|a - b| in units in the last place of bf16 at b (8 significant bits)."""
    return abs(a - b) / 2.0 ** (np.floor(np.log2(abs(b))) - 7) if b else abs(a - b) and np.inf


def _one_step(rank: int, world: int, layouts: dict) -> dict:
    from tests.test_parallel_train import _cfg

    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model, single_process_equivalent
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)
    host = PluginHost.load()
    ids = np.random.default_rng(3).integers(0, V, 2048).astype(np.int64)
    out = {}
    for name, parallel in layouts.items():
        cfg = _cfg(parallel, DELAYED, 1)
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        ref_cfg = single_process_equivalent(cfg, groups.size("dp"))
        precision, ref_precision = (host.create("precision", "fp8_delayed", {}) for _ in "ab")
        seed_everything(cfg.train.seed)
        model = build_rank_model(cfg, host, V, groups)
        seen = _seen_amaxes(precision, model, groups)
        seed_everything(cfg.train.seed)
        ref = build_rank_model(ref_cfg, host, V, None)
        train_step(model, build_rank_optimizer(model, cfg, groups),
                   step_batches(ids, cfg.train, 0, groups), cfg.train, precision, groups)
        train_step(ref, build_rank_optimizer(ref, ref_cfg), step_batches(ids, ref_cfg.train, 0),
                   ref_cfg.train, ref_precision)
        out[name] = (_histories(precision, model, groups), _histories(ref_precision, ref, None),
                     seen)
    return out


def _check(reports: list, name: str, layouts: dict) -> None:
    ranks = [r[name][0] for r in reports]
    ref = reports[0][name][1]
    split = layouts[name].get("tp", 1) * layouts[name].get("etp", 1) > 1
    compared = ("w",) if split else ("x", "w")
    forward = [k for k in ref if k[2] in compared]
    # the reduction: each rank's history entry is the max of what the ranks saw, bit for bit
    seen = [r[name][2] for r in reports]
    for k in forward:
        amaxes = [s[k] for s in seen if s.get(k) is not None]
        for rank, hist in enumerate(ranks):
            if k in hist:
                assert amaxes and hist[k][0][0] == max(amaxes), \
                    f"{name}, rank {rank}: {k} took {hist[k][0][0]}, the ranks saw {amaxes}"
    assert forward and any(k[1] is not None for k in forward)  # expert GEMMs among them
    for rank, hist in enumerate(ranks):
        for other, theirs in enumerate(ranks):
            shared = hist.keys() & theirs.keys()
            bad = [k for k in shared if hist[k] != theirs[k]]
            assert not bad, f"{name}: ranks {rank} and {other} keep other scales for {bad[:3]}"
        # an expert that got no rows on this rank still takes the step's amax of its replicas
        held = [k for k in forward if k in hist]
        assert len(held) * len(ranks) >= len(forward), f"{name}: rank {rank} holds too few"
        bad = {k: (hist[k][0][0], ref[k][0][0]) for k in held if hist[k][0] != ref[k][0]
               and not (layouts[name].get("cp", 1) > 1 and k[2] == "x"
                        and _bf16_ulps(hist[k][0][0], ref[k][0][0]) <= CP_ULPS)}
        assert not bad, f"{name}, rank {rank}: forward amaxes are not one process's: {bad}"
    assert set().union(*ranks) >= set(forward)  # every one-process GEMM is someone's


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_one_step, 2, WORLD2, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_one_step, 4, WORLD4, timeout=300)


@pytest.mark.parametrize("name", list(WORLD2))
def test_every_rank_of_a_stage_takes_one_process_amaxes_world2(world2, name):
    _check(world2, name, WORLD2)


@pytest.mark.parametrize("name", list(WORLD4))
def test_every_rank_of_a_stage_takes_one_process_amaxes_world4(world4, name):
    _check(world4, name, WORLD4)


def _train_losses(cfg_file: str, out: str, *extra: str) -> dict:
    import os

    from moeplug.cli import main
    from moeplug.training.metrics import read_metrics
    rc = main(["train", "--config", cfg_file, "--out", out, "--steps", "4",
               "--set", "plugins.precision=fp8_delayed", "--set", "train.log_interval=1",
               "--set", "train.ckpt_interval=0", *extra])
    assert rc == 0
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}, records


def test_evaluation_does_not_move_the_scales(tiny_config_file, tmp_path, monkeypatch):
    """A run that evaluates every step trains bit for bit as one that never does: the val
    batches' amaxes are dropped (they once went into the histories and steered training)."""
    monkeypatch.setenv("MOEPLUG_CACHE", str(tmp_path / "cache"))
    cfg_file = tiny_config_file()
    quiet, _ = _train_losses(cfg_file, str(tmp_path / "quiet"), "--set", "train.eval_interval=0")
    evaluated, records = _train_losses(cfg_file, str(tmp_path / "eval"),
                                       "--set", "train.eval_interval=1")
    assert sum(r["kind"] == "val" for r in records) >= 3  # the evaluations really ran
    assert sorted(quiet) == [1, 2, 3, 4] and evaluated == quiet


def _keyed(rank: int, world: int, _) -> list:
    import torch.distributed as dist

    from moeplug.parallel.keyed import KeyedMax
    group = dist.group.WORLD
    reduce, t = KeyedMax(), torch.tensor
    mine = [{"a": t(1.0), "b": None}, {"b": t(3.0), "c": t(float("nan"))}][rank]
    first = reduce(mine, group, owns=lambda k: k != "c")
    again = reduce(mine, group, owns=lambda k: k != "c")  # same keys: the cached union
    mine[f"d{rank}"] = t(2.0 + rank)  # a key set changes: the union is agreed anew
    third = reduce(mine, group, owns=lambda k: False)
    nothing = reduce({}, group, owns=lambda k: True)  # no rank holds a key: no vector at all
    return [{k: None if v is None else float(v) for k, v in r.items()}
            for r in (first, again, third, nothing)]


def test_keyed_max_reduces_by_name_over_ranks_holding_other_keys():
    r0, r1 = run_distributed(_keyed, 2, None, timeout=60)
    inf = float("inf")
    assert r0[0] == r0[1] == {"a": 1.0, "b": 3.0}  # a key it holds and one it owns
    assert r1[0] == r1[1] == {"a": 1.0, "b": 3.0, "c": inf}  # NaN counts as +inf
    assert r0[2] == {"a": 1.0, "b": 3.0, "d0": 2.0}
    assert r1[2] == {"b": 3.0, "c": inf, "d1": 3.0}
    assert r0[3] == r1[3] == {}


def test_a_gemm_on_a_tensor_that_is_no_parameter_keeps_no_scaler():
    """A plugin's derived weight is a new tensor (and key) every step: its scaler goes at the
    step's end, while a parameter's takes the step's amax."""
    from moeplug.quant.recipes import Delayed
    recipe, w = Delayed(), torch.nn.Parameter(torch.full((2, 2), 3.0))
    derived = w * 2
    recipe.fake(torch.ones(2, 2), "x", 1, id(w))
    recipe.fake(torch.ones(2, 2), "x", 1, id(derived))
    recipe.end_step({id(w): "w"}, {})
    assert list(recipe.scalers) == [(id(w), "x")]
    assert recipe.scalers[(id(w), "x")].history.tolist() == [1.0]


def _state(ckpt) -> dict:
    """{(param, global expert, role): history} over every rank of a checkpoint's meta.json."""
    import json
    state = json.loads((ckpt / "meta.json").read_text())["precision_state"]
    out = {}
    for rank_state in (state["ranks"] if isinstance(state, dict) else [state]):
        for e in rank_state:
            out[(e["param"], e["global_expert"], e["role"])] = e["history"]
    return out


@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.ep=2"]], ids=["pp2", "ep2"])
def test_a_resume_onto_another_layout_keeps_the_histories(run_cli, tiny_config_file, tmp_path,
                                                           layout):
    """A one-process checkpoint resumed on 2 ranks: every rank takes the saved histories of the
    GEMMs it now holds (keys are one-process names and global experts), so they go on from the
    step-2 entries instead of starting afresh. pp2 keeps one process's micro-batches, so its
    steps 3-4 are the uninterrupted run's; ep2 quantizes other row sets (see README)."""
    import json
    cfg = tiny_config_file(str(tmp_path / "unused"))
    common = ["--config", cfg, "--steps", "4", "--set", "plugins.precision=fp8_delayed",
              "--set", "train.log_interval=1", "--set", "train.eval_interval=0",
              "--set", "train.ckpt_interval=2", "--set", "train.grad_accum_steps=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    proc = run_cli("train", "--out", str(one), *common, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("train", "--out", str(two), *common, "--nproc", "2",
                   "--resume", str(one / "step_000002"),
                   *[a for s in layout for a in ("--set", s)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved, resumed, uninterrupted = (_state(one / "step_000002"), _state(two / "step_000004"),
                                     _state(one / "step_000004"))
    assert resumed.keys() == uninterrupted.keys() == saved.keys()
    assert all(len(h) == 2 for h in saved.values())
    assert all(resumed[k][:2] == saved[k] and len(resumed[k]) == 4 for k in saved)
    if layout == ["parallel.pp=2"]:
        def losses(run):
            return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()
                    if json.loads(line)["kind"] == "train"]
        assert max(abs(a - b) for a, b in zip(losses(two), losses(one)[2:])) < 2e-5
        assert resumed == uninterrupted


def test_the_margin_option_reaches_every_scaler():
    from moeplug.plugin_host import PluginHost
    precision = PluginHost.load().create("precision", "fp8_delayed", {"margin": 3})
    w = torch.nn.Parameter(torch.ones(2, 2))
    precision.recipe.fake(torch.full((2, 2), 7.0), "x", 1, id(w))
    precision.recipe.end_step({id(w): "w"}, {})
    assert precision.recipe.scalers[(id(w), "x")].scale.item() == 448.0 / 7.0 / 8.0
