"""Faults through the real CLI: a rank that dies or hangs, NaN/Inf steps (skip or stop).

Faults are injected with the test-only ``MOEPLUG_TEST_FAULT`` hook
(moeplug.training.faults.TestFault): ``kill:rank=1:step=3`` makes rank 1 SIGKILL itself at
step 3, ``hang:rank=1:step=3`` makes it sleep forever, ``nan:layer=1:step=2`` turns block 1's
output into NaN at step 2 on every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moeplug.training.metrics import read_metrics

TIMEOUT_S = 10  # parallel.timeout_s in these tests: a hang is noticed after this long
STEPS = ["--steps", "4", "--set", "train.log_interval=1", "--set", "train.warmup_steps=1",
         "--set", "train.eval_interval=0"]


def _run_train(cli_env, args, fault: str, timeout: float = 300):
    """Run `moeplug train ...` in its own session with MOEPLUG_TEST_FAULT set; returns
    (returncode, stdout, stderr, seconds, processes of the run still alive afterwards); the
    wall-clock time of the exit is in ``_run_train.end``."""
    env = dict(cli_env, MOEPLUG_TEST_FAULT=fault)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "moeplug", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the run hung past {timeout}s:\n{err[-3000:]}") from None
    elapsed = time.monotonic() - t0
    _run_train.end = time.time()
    time.sleep(1)  # what would be left behind has had time to exit
    left = _session_processes(proc.pid)
    for p in left:  # do not leak them into the rest of the suite
        os.kill(p, signal.SIGKILL)
    return proc.returncode, out, err, elapsed, left


def _session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``: ranks re-parented to init keep it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_a_failed_rank_stops_every_rank_in_bounded_time(cli_env, tiny_config_file, tmp_path,
                                                        kind):
    out = str(tmp_path / "run")
    rc, stdout, err, elapsed, left = _run_train(
        cli_env, ["--config", tiny_config_file(out), "--nproc", "2", "--set", "parallel.ep=2",
                  "--set", f"parallel.timeout_s={TIMEOUT_S}", *STEPS],
        f"{kind}:rank=1:step=3")
    # From rank 0's last record (step 2, just before step 3 starts) to the command's exit.
    after_fault = _run_train.end - os.path.getmtime(os.path.join(out, "metrics.jsonl"))
    print(f"{kind}: exit {elapsed:.1f}s after start, {after_fault:.1f}s after the fault\n{err}")
    assert rc != 0, (stdout[-2000:], err[-3000:])
    assert "moeplug: rank 1 failed" in err and "this rank (0) stops" in err, err[-3000:]
    if kind == "kill":  # the launcher's line puts the killed rank first
        assert "moeplug: failed: rank 1 (killed by SIGKILL)" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not left, f"processes of the run still alive: {left}"
    # a death is seen at once (torchrun, closed sockets), a hang after parallel.timeout_s;
    # margins for a loaded 2-core machine
    if kind == "kill":
        assert after_fault < 20, after_fault
    else:
        assert TIMEOUT_S - 1 < after_fault < TIMEOUT_S + 20, after_fault
    assert elapsed < 60 + TIMEOUT_S, elapsed


def _params(ckpt_dir: str) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(os.listdir(ckpt_dir)) if f.startswith("model")
            for k, v in load_file(os.path.join(ckpt_dir, f)).items()}


LAYOUTS = {"one_process": [], "ep2_dp2": ["--nproc", "2", "--set", "parallel.ep=2"],
           "dp2_zero1": ["--nproc", "2", "--set", "parallel.distributed_optimizer=true"],
           # block 1 runs on rank 1 (stage 1), whose pipeline chunk 0 holds it: rank 0 reports it
           "pp2": ["--nproc", "2", "--set", "parallel.pp=2"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_step_is_skipped_and_named(cli_env, tiny_config_file, tmp_path, layout):
    """Block 1 outputs NaN at step 3 only: skip mode drops that update (the weights after step
    3 equal those after step 2), counts it and names the block; in parallel layouts too."""
    par = LAYOUTS[layout]
    out = str(tmp_path / "run")
    rc, stdout, err, _, left = _run_train(
        cli_env, ["--config", tiny_config_file(out), *par, *STEPS, "--set", "train.nonfinite=skip",
                  "--set", "train.ckpt_interval=1"], "nan:layer=1:step=3")
    assert rc == 0, err[-3000:]
    assert not left
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    skips = [r for r in records if r["kind"] == "skip"]
    where = "output of 0.blocks.1" if layout == "pp2" else "output of blocks.1"
    assert [(r["step"], r["where"], r["skipped_steps"]) for r in skips] == [
        (3, where, 1)], skips
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert [train[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert "non-finite step 3" in stdout and "blocks.1" in stdout, stdout
    before, after = (_params(os.path.join(out, f"step_{s:06d}")) for s in (2, 3))
    assert before.keys() == after.keys()
    import torch
    assert all(torch.equal(before[k], after[k]) for k in before)
    last = _params(os.path.join(out, "step_000004"))
    assert any(not torch.equal(after[k], last[k]) for k in after)  # step 4 trained again


@pytest.mark.parametrize("nproc", [1, 2])
def test_nan_step_stops_naming_step_and_layer(cli_env, tiny_config_file, tmp_path, nproc):
    par = ["--nproc", "2", "--set", "parallel.ep=2"] if nproc == 2 else []
    rc, _, err, _, left = _run_train(
        cli_env, ["--config", tiny_config_file(str(tmp_path / "run")), *par, *STEPS],
        "nan:layer=1:step=2")
    assert rc == 3 and not left, (rc, left, err[-3000:])  # EXIT_FAULT, also through the launcher
    assert "moeplug: non-finite step 2: loss nan" in err, err[-3000:]
    assert "first at the output of blocks.1" in err and "train.nonfinite = stop" in err
    assert "Traceback" not in err, err[-3000:]


def test_skips_in_a_row_stop_at_the_limit(cli_env, tiny_config_file, tmp_path):
    """NaN at steps 2 and 3: one skip in a row is allowed, the second stops the run."""
    rc, stdout, err, _, _ = _run_train(
        cli_env, ["--config", tiny_config_file(str(tmp_path / "run")), *STEPS,
                  "--set", "train.nonfinite=skip", "--set", "train.max_skipped_steps=1"],
        "nan:layer=0:step=2-3")
    assert rc != 0
    assert "non-finite step 2" in stdout and "update skipped" in stdout, stdout
    assert "moeplug: non-finite step 3" in err, err[-3000:]
    assert "2 steps in a row, train.max_skipped_steps = 1" in err, err[-3000:]


def test_nonfinite_config_is_validated(run_cli, tiny_config_file, tmp_path):
    proc = run_cli("train", "--config", tiny_config_file(str(tmp_path / "run")),
                   "--set", "train.nonfinite=ignore", timeout=120)
    assert proc.returncode == 2
    assert "TrainConfig.nonfinite = 'ignore'" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_heartbeat_names_the_ranks_behind_and_the_line_says_so():
    """Four ranks' progress in a real TCPStore: rank 2 never started step 3 while the others
    did, so a timed-out rank names rank 2; all level: the error text decides, else 'a peer'."""
    from datetime import timedelta

    import torch.distributed as dist

    from moeplug.testing.distributed import free_port
    from moeplug.training.faults import Heartbeat, is_peer_failure, rank_failure_line

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10))
    beats = [Heartbeat(store, r, 4) for r in range(4)]
    for r, hb in enumerate(beats):
        hb.beat(4 if r == 2 else 5)
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                           "for recv operation to complete")
    assert is_peer_failure(timeout) and not is_peer_failure(RuntimeError("shape mismatch"))
    line = rank_failure_line(timeout, 0, beats[0])
    assert line.startswith("moeplug: rank 2 failed (collective timed out: ") and \
        "this rank (0) stops" in line, line
    beats[2].beat(5)
    assert "a peer rank failed" in rank_failure_line(timeout, 0, beats[0])
    beats[1].beat(4)
    beats[3].beat(4)
    assert "ranks 1, 3 failed" in rank_failure_line(timeout, 0, beats[0])
    # a long error text is cut between words, never mid-word
    long = RuntimeError("Connection closed by peer [127.0.0.1]:51234 " * 6)
    cut = rank_failure_line(long, 0, None).split("connection lost: ")[1].split("); this")[0]
    kept = cut[:-len(" ...")]
    assert len(cut) <= 160 and cut.endswith(" ...") and long.args[0].startswith(kept + " "), cut


def test_nan_gradient_with_a_finite_loss_is_skipped_and_named(cli_env, tiny_config_file,
                                                              tmp_path):
    """The loss is finite but the gradient into block 1's output is NaN at step 2: the step is
    skipped and named by the deepest parameter whose grad is NaN, one inside block 1."""
    out = str(tmp_path / "run")
    rc, _, err, _, _ = _run_train(
        cli_env, ["--config", tiny_config_file(out), *STEPS, "--set", "train.nonfinite=skip"],
        "nan_grad:layer=1:step=2")
    assert rc == 0, err[-3000:]
    skips = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "skip"]
    assert len(skips) == 1 and skips[0]["step"] == 2, skips
    assert skips[0]["loss"] == skips[0]["loss"] and skips[0]["grad_norm"] != skips[0]["grad_norm"]
    assert skips[0]["where"].startswith("grad of blocks.1."), skips


def test_a_rank_stopped_by_sigterm_names_the_rank_behind(tmp_path):
    """torchrun may SIGTERM a rank before its own collective noticed the failure: the rank
    still names the rank behind from the heartbeats, and exits 128 + 15."""
    from datetime import timedelta

    import torch.distributed as dist

    from moeplug.testing.distributed import free_port
    from moeplug.training.faults import Heartbeat

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30),
                          wait_for_workers=False)
    Heartbeat(store, 1, 2).beat(4)  # rank 1 finished step 2 and never started step 3
    script = (
        "import sys, time, torch.distributed as dist\n"
        "from datetime import timedelta\n"
        "from moeplug.training.faults import Heartbeat, exit_on_stop_signals\n"
        f"s = dist.TCPStore('127.0.0.1', {port}, 2, False, timedelta(seconds=30))\n"
        "hb = Heartbeat(s, 0, 2); hb.beat(5); exit_on_stop_signals(hb, 0)\n"
        "print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == ("moeplug: rank 1 failed (the launcher stopped this rank); this rank "
                           "(0) stops"), err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_a_single_process_run_stops_it_in_one_line_and_it_resumes(
        tiny_config_file, cli_env, tmp_path, sig):
    """Ctrl-C (SIGINT) or a scheduler's SIGTERM to a one-process `moeplug train` once a
    checkpoint exists: one line naming the signal, the newest checkpoint and how to go on, exit
    128 + the signal (a KeyboardInterrupt traceback before, or for SIGTERM a silent death);
    no save left half-written; `--resume auto` continues from that checkpoint."""
    from moeplug.training.checkpoint import find_latest
    out = str(tmp_path / "run")
    args = ["--config", tiny_config_file(out), "--set", "train.log_interval=1",
            "--set", "train.ckpt_interval=1", "--set", "train.eval_interval=0"]
    proc = subprocess.Popen([sys.executable, "-m", "moeplug", "train", *args,
                             "--steps", "100000"], env=cli_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # step 2 logged: step 1's checkpoint is written
            if line.startswith("step      2"):
                break
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    latest = find_latest(out)
    assert proc.returncode == 128 + getattr(signal, sig), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"moeplug: stopped by {sig}; the newest checkpoint is {latest} (the steps after it "
        f"are lost). Fix: continue with the same command and --resume auto"), err[-3000:]
    assert not [d for d in os.listdir(out) if d.startswith(".tmp-")]
    done = int(os.path.basename(latest)[5:])
    resumed = subprocess.run([sys.executable, "-m", "moeplug", "train", *args, "--steps",
                              str(done + 1), "--resume", "auto"], env=cli_env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))
             if r.get("kind") == "train"]
    assert steps[-1] == done + 1, steps


def test_a_stop_before_the_first_checkpoint_says_nothing_is_kept():
    from moeplug.training.faults import stopped_line
    assert stopped_line(signal.SIGTERM, None) == (
        "moeplug: stopped by SIGTERM before the first checkpoint; nothing to resume. Fix: run "
        "again with --overwrite (or another --out)")
