"""``moeplug plan`` with FSDP2 (``--mapping ...,fsdp=1`` / ``parallel.fsdp``) against a real
FSDP run: the planner's per-rank parameter + gradient + optimizer bytes (moeplug.plan.memory.fsdp_memory)
against what a 4-rank gloo FSDP run of a tiny config holds after a real ``train_step``,
measured from the tensors themselves by benchmarks/test_bench_fsdp.py's ``_held_bytes`` (a
sharded tensor counts its local shard), within 10 %, at DP4, DP2 x TP2 (SP) x EP2 and
PP2 x DP2 (each pipeline stage against its own plan: the embedding on one, the head on the
other). And the planner's other FSDP terms: the gathered working set and the per-step comm
follow reshard_after_forward."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest

from moeplug.testing.distributed import run_distributed

V = 256
_BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "test_bench_fsdp.py")
_spec = importlib.util.spec_from_file_location("_bench_fsdp", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# name -> the parallel section of the benchmark's tiny model, on 4 ranks
LAYOUTS = {"fsdp_dp4": {"fsdp": True},
           "fsdp_dp2_tp2_sp_ep2": {"fsdp": True, "tp": 2, "sequence_parallel": True, "ep": 2},
           "fsdp_pp2_dp2": {"fsdp": True, "pp": 2}}
WORLD = 4


def _cfg(par: dict):
    cfg = bench._cfg(par)
    if cfg.parallel.pp > 1:  # a micro-batch per pipeline stage
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=2))
    return cfg


def _measure(rank: int, world: int) -> dict:
    import numpy as np

    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    ids = np.random.default_rng(0).integers(0, V, 20_000).astype(np.int64)
    out = {}
    for name, par in LAYOUTS.items():
        cfg = _cfg(par)
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        seed_everything(0)
        model = build_rank_model(cfg, host, V, groups)
        opt = build_rank_optimizer(model, cfg, groups)
        train_step(model, opt, step_batches(ids, cfg.train, 0, groups), cfg.train, precision,
                   groups)
        out[name] = {**bench._held_bytes(model, opt), "stage": groups.rank_in("pp")}
    return out


def _planned(par: dict, world: int, stage: int = 0):
    from moeplug.plan.memory import Mapping, Options, stage_memory
    cfg = _cfg(par)
    p = cfg.parallel
    model = dataclasses.replace(cfg.model, vocab_size=V)
    mp = Mapping(world=world, tp=p.tp, ep=p.ep, pp=p.pp, mbs=cfg.train.micro_batch_size,
                 seq=cfg.train.seq_len, fsdp=int(p.fsdp))
    # the run's fp32 recipe: fp32 weights, grads and moments, no separate master copy
    opt = Options(precision="fp32", param_bytes=4, distributed_optimizer=False)
    return stage_memory(model, mp, opt, stage)


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_measure, WORLD, timeout=400)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_fsdp_state_bytes_match_a_real_fsdp_run_within_10_percent(measured, name):
    for rank, rep in enumerate(measured):
        got = rep[name]
        plan = _planned(LAYOUTS[name], WORLD, got["stage"])
        # parameters + gradients, then AdamW's moments, then all of it
        pairs = {"params+grads": (plan.weights_grads, got["params"] + got["grads"]),
                 "optimizer": (plan.optimizer, got["optim"]),
                 "total": (plan.weights_grads + plan.optimizer,
                           got["params"] + got["grads"] + got["optim"])}
        for part, (want, have) in pairs.items():
            assert abs(want / have - 1) <= 0.10, (name, rank, part, want, have)
    # the sharding is what it measures: without FSDP (plain DP, no ZeRO) a rank holds
    # |DP x CP| times the dense and |EDP| times the expert bytes
    plain = _planned({**LAYOUTS[name], "fsdp": False}, WORLD)
    assert plain.weights_grads > 1.5 * _planned(LAYOUTS[name], WORLD).weights_grads


def test_fsdp_gathered_working_set_and_comm_follow_reshard_after_forward():
    from moeplug.plan.cluster import get_cluster
    from moeplug.plan.memory import Mapping, Options, stage_memory
    from moeplug.plan.models import model_config
    from moeplug.plan.perf import step_time
    cfg = model_config("qwen3_235b")
    opt = Options(precision="bf16", distributed_optimizer=True)
    c = get_cluster("h100", 256)
    base = dict(world=256, pp=8, ep=32, tp=1, gbs=2048)
    zero1 = stage_memory(cfg, Mapping(**base), opt, 0)
    resh = stage_memory(cfg, Mapping(**base, fsdp=1), opt, 0)
    kept = stage_memory(cfg, Mapping(**base, fsdp=1, fsdp_reshard=0), opt, 0)
    # FSDP shards the 6 B/param ZeRO-1 keeps whole: less state, a working set on top, which
    # keeping every block gathered from forward to backward makes larger
    assert resh.weights_grads + resh.optimizer < zero1.weights_grads + zero1.optimizer
    assert 0 < resh.fsdp_gathered < kept.fsdp_gathered
    assert resh.total == pytest.approx(resh.weights_grads + resh.optimizer
                                       + resh.activations_total + resh.comm_buffers
                                       + resh.fsdp_gathered)
    st0 = step_time(cfg, Mapping(**base), opt, c)
    st1 = step_time(cfg, Mapping(**base, fsdp=1), opt, c)
    assert "fsdp_comm" in st1.parts and st1.parts["dp_comm"] == 0 and "fsdp_comm" not in st0.parts


def test_plan_cli_accepts_fsdp_in_the_mapping_and_refuses_a_bad_switch(capsys):
    from moeplug.cli import main
    assert main(["plan", "--preset", "qwen3_235b", "--cluster", "h100", "--gpus", "256",
                 "--mapping", "pp=8,ep=32,fsdp=1,fsdp_reshard=0", "--gbs", "2048"]) == 0
    out = capsys.readouterr().out
    assert "FSDP (kept gathered)" in out and "FSDP gathered" in out and "fsdp_comm" in out
    assert main(["plan", "--preset", "qwen3_235b", "--mapping", "pp=8,fsdp=2"]) == 2
    assert "fsdp is a switch. Fix: write fsdp=1 (on) or fsdp=0 (off)" in capsys.readouterr().err
