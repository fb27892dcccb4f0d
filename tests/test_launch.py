"""Multi-process launch: `moeplug train --nproc N` under torchrun, end to end, and its errors.

The end-to-end test runs the real command (torchrun, gloo, real data pipeline and plugins) at
EP2 for 5 steps and compares the loss of every step in metrics.jsonl with a one-process run of
the equivalent config (grad_accum_steps x DP, see moeplug.training.distributed).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from moeplug.config import ConfigError, load_config
from moeplug.training.metrics import read_metrics

STEPS = ["--steps", "5", "--set", "train.log_interval=1", "--set", "train.warmup_steps=1",
         "--set", "train.eval_interval=0"]


def _losses(out_dir: str) -> list[float]:
    return [r["loss"] for r in read_metrics(os.path.join(out_dir, "metrics.jsonl"))
            if r["kind"] == "train"]


def test_nproc2_ep2_equals_one_process_with_double_accumulation(run_cli, tiny_config_file,
                                                                 tmp_path):
    cfg = tiny_config_file(str(tmp_path / "unused"))
    par, one = str(tmp_path / "ep2"), str(tmp_path / "one")
    proc = run_cli("train", "--config", cfg, "--out", par, "--nproc", "2",
                   "--set", "parallel.ep=2", *STEPS, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 0 alone prints: one summary line, one metrics file
    assert proc.stdout.count("done: 5 steps") == 1, proc.stdout
    run = [r for r in read_metrics(os.path.join(par, "metrics.jsonl")) if r["kind"] == "run"]
    assert len(run) == 1 and run[0]["parallel"]["ep"] == 2 and run[0]["parallel"]["dp"] == 2
    ckpt = os.path.join(par, "step_000005")
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("model_rank")) == [
        "model_rank0.safetensors", "model_rank1.safetensors"]

    proc = run_cli("train", "--config", cfg, "--out", one, "--set", "train.grad_accum_steps=2",
                   *STEPS, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _losses(par), _losses(one)
    assert len(got) == len(want) == 5
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)

    # The 2-rank EP checkpoint reshards into one process (tests/test_reshard.py proves the
    # values): resuming it for one more step works.
    resumed = str(tmp_path / "r")
    proc = run_cli("train", "--config", cfg, "--out", resumed, "--resume", ckpt,
                   "--set", "train.grad_accum_steps=2", "--steps", "6", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(os.path.join(resumed, "metrics.jsonl"))
             if r["kind"] == "train"]
    assert steps[-1] == 6, steps


@pytest.mark.parametrize("extra, words", [
    (["--nproc", "2", "--set", "parallel.ep=3"],
     ["num_experts 4 not divisible by EP 3", "ParallelConfig.ep = 3", "Fix:"]),
    (["--nproc", "3", "--set", "parallel.ep=2"],
     ["ParallelConfig.ep = 2", "does not divide world size 3", "Fix:"]),
    # no --nproc: one process cannot hold EP2; say which --nproc it needs
    (["--set", "parallel.ep=2"], ["parallel.ep = 2: needs 2 processes", "Fix: add --nproc 2"]),
    (["--set", "parallel.tp=2", "--set", "parallel.ep=4",
      "--set", "parallel.sequence_parallel=true"],
     ["parallel.tp = 2, parallel.ep = 4: needs 4 processes", "Fix: add --nproc 4"]),
    (["--nproc", "0"], ["--nproc 0: must be >= 1", "Fix:"]),
    # MLA under CP: was a ValueError traceback from every rank's model build
    (["--nproc", "2", "--set", "parallel.cp=2", "--set", "model.attention=mla"],
     ["ModelConfig.attention = 'mla'", "parallel.cp = 2",
      "Fix: set model.attention: gqa or parallel.cp: 1"]),
])
def test_layout_errors_exit_2_before_launching(run_cli, tiny_config_file, tmp_path, extra,
                                               words):
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli("train", "--config", tiny_config_file(str(out)), *extra, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for w in words:
        assert w in proc.stderr, proc.stderr
    assert "torch.distributed.run" not in proc.stderr and "Traceback" not in proc.stderr
    if extra == ["--nproc", "0"]:  # no torchrun is involved: the message must not say there is
        assert "torchrun" not in proc.stderr, proc.stderr
    assert not out.exists(), "nothing may run before the layout is validated"
    assert time.monotonic() - t0 < 60


def test_launch_line_states_global_batch_and_oversubscription(tiny_config_file, cli_env,
                                                              tmp_path):
    """`--nproc 2` on one core: the launch line gives the global batch the two DP ranks make
    (the same tokens/step the trainer then reports) and warns that 2 ranks share 1 core."""
    import re
    import subprocess
    import sys
    out = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "moeplug", "train", "--config", tiny_config_file(out),
         "--nproc", "2", "--set", "parallel.ep=2", "--steps", "1"],
        env=cli_env, capture_output=True, text=True, timeout=600,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == ("launching 2 ranks under torchrun, 1 thread(s) each; global batch = "
                        "micro_batch_size 8 x grad_accum_steps 1 x DP 2 = 16 sequences "
                        "(512 tokens) per step"), lines[:3]
    assert lines[1].startswith("warning: 2 ranks x 1 thread(s) on 1 CPU core(s) oversubscribe")
    assert re.search(r"\b512 tokens/step", proc.stdout), proc.stdout


def test_launch_line_without_oversubscription():
    from moeplug.training.launch import launch_line
    cfg = load_config(None, ["parallel.ep=2", "train.grad_accum_steps=3"])
    line = launch_line(cfg, 4, threads=2, cores=8)
    assert "x grad_accum_steps 3 x DP 4 = 192 sequences (24576 tokens)" in line
    assert "warning" not in line
    assert "4 ranks x 2 thread(s) on 7 CPU core(s)" in launch_line(cfg, 4, threads=2, cores=7)


@pytest.mark.parametrize("override, words", [
    ("parallel.distributed_optimizer=maybe", ["ParallelConfig.distributed_optimizer", "'maybe'",
                                            "Fix: write distributed_optimizer: true"]),
    ("parallel.timeout_s=0", ["ParallelConfig.timeout_s = 0.0", "Fix: set timeout_s"]),
    ("parallel.tp=3", ["num_heads 8 not divisible by TP 3", "Fix:"]),
    ("parallel.etp=5", ["ffn_hidden_size 384 not divisible by ETP 5", "Fix:"]),
    ("parallel.pp=3", ["ParallelConfig.vpp", "num_layers 4", "Fix:"]),
    ("parallel.cp=3", ["seq_len 128 not divisible by 2·CP", "Fix:"]),
    ("parallel.order=tp-cp-dp-pp", ["ParallelConfig.order", "Fix:"]),
])
def test_parallel_section_errors_name_field_value_and_fix(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for w in words:
        assert w in str(err.value), str(err.value)


def test_model_dependent_pipeline_checks_run_at_load():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["parallel.pp=2", "parallel.vpp=2", "train.grad_accum_steps=3"])
    assert "TrainConfig.grad_accum_steps = 3" in str(err.value) and "multiple of 2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["parallel.pp=2", "parallel.num_layers_in_first_stage=5"])
    assert "num_layers_in_first_stage = 5" in str(err.value) and "Fix:" in str(err.value)
    # a valid layout loads and maps onto the parallel package's configs
    cfg = load_config(None, ["parallel.pp=2", "parallel.vpp=2", "train.grad_accum_steps=2"])
    assert cfg.parallel.layout().pp == 2 and cfg.parallel.pipeline().vpp == 2
    # MTP is refused only with TP/CP (see test_layout_errors_exit_2_before_launching), not PP/EP
    cfg = load_config(None, ["parallel.pp=2", "parallel.ep=2", "model.mtp_num_layers=1"])
    assert cfg.model.mtp_num_layers == 1 and cfg.parallel.pp == 2


def test_world_size_from_env_and_launch_command(monkeypatch):
    from moeplug.training.distributed import world_from_env
    from moeplug.training.launch import strip_nproc, torchrun_args
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError) as err:
        world_from_env()
    assert "$WORLD_SIZE = 'two'" in str(err.value) and "Fix:" in str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_from_env() == 4
    argv = ["train", "--nproc", "2", "--set", "parallel.ep=2", "--nproc=2"]
    assert strip_nproc(argv) == ["train", "--set", "parallel.ep=2"]
    assert torchrun_args(2, argv) == ["--standalone", "--nproc-per-node=2", "-m", "moeplug",
                                      "train", "--set", "parallel.ep=2"]


def _sharded_ckpt_rank(rank: int, world: int, out_dir: str) -> str:
    # Save a 2-rank checkpoint, then try to load it with another layout on the same ranks.
    import torch

    from moeplug.config import config_from_dict
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from moeplug.training.distributed import build_rank_model, layout_manifest
    from moeplug.training.trainer import build_rank_optimizer

    host = PluginHost.load()
    cfgs = [config_from_dict({"model": {"hidden_size": 16, "num_layers": 2, "num_heads": 2,
                                        "num_kv_heads": 2, "max_seq_len": 16,
                                        "dense_ffn_hidden_size": 16,
                                        "moe": {"num_experts": 4, "ffn_hidden_size": 8}},
                              "train": {"seq_len": 8}, "parallel": par})
            for par in ({"ep": 2}, {}, {"pp": 2})]
    handles = []
    for cfg in cfgs:
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        torch.manual_seed(0)
        model = build_rank_model(cfg, host, 32, groups)
        handles.append((cfg, groups, model, build_rank_optimizer(model, cfg, groups)))
    cfg, groups, model, opt = handles[0]
    path = save_sharded_checkpoint(out_dir, 1, model, opt, {"metrics": {}}, groups,
                                   layout_manifest(cfg, groups))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_sharded_checkpoint(path, model, opt, groups, layout_manifest(cfg, groups))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # EP2 -> DP2, saved before any optimizer step (no AdamW state yet): the replicas load the
    # same dense weights and every expert.
    cfg, groups, model, opt = handles[1]
    load_sharded_checkpoint(path, model, opt, groups, layout_manifest(cfg, groups))
    dense = [k for k in before if "experts" not in k]
    assert dense and all(torch.equal(before[k], model.state_dict()[k]) for k in dense)
    # EP2 -> PP2: each stage's chunk takes its layers under the one-process names
    cfg, groups, model, opt = handles[2]
    load_sharded_checkpoint(path, model, opt, groups, layout_manifest(cfg, groups))
    mine = {k.split(".", 1)[1]: v for k, v in model.state_dict().items()}
    dense = [k for k in mine if "experts" not in k]
    assert dense and all(torch.equal(before[k], mine[k]) for k in dense)
    # A checkpoint written before the shard manifests reshards only without CP, PP and ETP.
    import torch.distributed as dist
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        del meta["reshard_version"]
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f)
    dist.barrier()
    try:
        load_sharded_checkpoint(path, model, opt, groups, layout_manifest(cfg, groups))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_sharded_checkpoint_round_trip_and_layout_mismatch(tmp_path):
    from moeplug.testing.distributed import run_distributed
    msgs = run_distributed(_sharded_ckpt_rank, 2, str(tmp_path), timeout=120)
    for msg in msgs:
        assert "was written with parallel layout" in msg, msg
        assert "'pp': (1, 2)" in msg and "Fix: resume with the same parallel settings" in msg
    assert sorted(os.listdir(tmp_path / "step_000001")) == [
        "meta.json", "model_rank0.safetensors", "model_rank1.safetensors",
        "optimizer_rank0.json", "optimizer_rank0.safetensors", "optimizer_rank1.json",
        "optimizer_rank1.safetensors"]


def _dead_peer_rank(rank: int, world: int) -> str:
    # parallel.timeout_s reaches the groups init_distributed builds: rank 1 dies (os._exit, no
    # goodbye), rank 0's next collective on the EP group must raise, not hang.
    import os as _os

    import torch
    import torch.distributed as dist

    from moeplug.config import load_config
    from moeplug.training.distributed import init_distributed

    _os.environ["WORLD_SIZE"] = str(world)
    groups = init_distributed(load_config(None, ["parallel.ep=2", "parallel.timeout_s=3"]))
    if rank == 1:
        _os._exit(17)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=groups.ep)
    except Exception as e:  # gloo reports the timeout or the closed connection
        return f"raised after {time.monotonic() - t0:.1f}s: {type(e).__name__}"
    raise AssertionError("a collective with a dead peer returned normally")


def test_a_dead_rank_makes_the_others_fail_instead_of_hanging():
    from moeplug.testing.distributed import DistributedError, run_distributed
    with pytest.raises(DistributedError) as err:
        run_distributed(_dead_peer_rank, 2, timeout=60, grace=30)
    failures = err.value.failures
    assert "exited with code 17" in failures[1]
    # rank 0's collective raised (it returned its message), it was neither killed by the
    # harness after the grace period nor allowed to complete the collective
    assert 0 not in failures, failures


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launch_stops_every_rank_in_one_line(tiny_config_file, cli_env,
                                                             tmp_path, sig):
    """A scheduler's SIGTERM (or Ctrl-C's SIGINT) to `moeplug train --nproc 2` mid-run: the
    launch, which runs torchrun's agent itself, stops both ranks, leaves no process behind,
    and exits 128 + the signal's number with one line instead of the agent's traceback."""
    import signal
    import subprocess
    import sys
    out = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplug", "train", "--config", tiny_config_file(out),
         "--nproc", "2", "--steps", "100000", "--set", "train.log_interval=1"],
        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # training has started on the ranks
            if line.startswith("step "):
                break
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            ranks = [int(p) for p in f.read().split()]
        assert len(ranks) == 2, ranks
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + getattr(signal, sig), err[-3000:]
    assert f"moeplug: stopped by {sig}; torchrun stopped the ranks" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 10  # reaped by the agent before it returned
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks), ranks


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_live_run_in_the_same_out_dir_is_refused(tiny_config_file, cli_env, run_cli,
                                                         tmp_path, nproc):
    """Two live runs in one out dir (a job re-queued while the first still runs) each appended
    to the other's metrics and deleted the other's checkpoint in progress, one ending in a
    FileNotFoundError traceback (a fault sweep). The running one holds the directory's lock,
    its ranks under --nproc do not contend for it, and the second is refused naming it; once
    the first is killed (SIGKILL: no cleanup), the directory is free again."""
    import subprocess
    import sys
    out = str(tmp_path / "run")
    cfg = tiny_config_file(out)
    args = ["train", "--config", cfg, "--steps", "100000", "--set", "train.log_interval=1",
            "--set", "train.ckpt_interval=1"] + (["--nproc", str(nproc)] if nproc > 1 else [])
    first = subprocess.Popen([sys.executable, "-m", "moeplug", *args], env=cli_env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:  # training has started
            if line.startswith("step "):
                break
        second = run_cli(*args[:3], "--steps", "100000", "--resume", "auto")
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"train.out_dir = {out!r} is in use by another live run (pid {first.pid} " in \
            second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.communicate(timeout=60)
    if nproc > 1:  # the killed launch's ranks: torchrun's agent died with it; wait them out
        time.sleep(3)
    third = run_cli(*args[:3], "--steps", "3", "--set", "train.ckpt_interval=0",
                    "--overwrite")
    assert third.returncode == 0, third.stderr[-2000:]
