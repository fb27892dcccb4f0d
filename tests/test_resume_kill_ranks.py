"""Exact resume of a 2-rank run under SIGKILL: ``moeplug train --nproc 2 --resume auto`` (the
real launcher: torchrun, gloo) killed at random moments (seeded), some inside a checkpoint save,
ends with the loss trajectory of the run nobody killed, bit for bit (CPU, one thread per rank,
fixed layout: EP2 with the distributed optimizer, so each rank's files differ; and EP2 under
FSDP2, whose shards are saved whole and cut again on resume, moeplug.parallel.fsdp).

Two ways to die, drawn at random: the whole machine (SIGKILL to every process of the launch:
launcher, torchrun agent and both ranks) or one rank alone (SIGKILL to rank 0 or rank 1; the
agent then stops the other, and the launch exits non-zero). After each, no process of the
launch may be left.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest

from moeplug.testing.runs import (assert_resumed_exactly, latest_step, launch_and_wait,
                                  uninterrupted)

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # kills aimed in time

STEPS = 6
KILLS = 3
# Guard against a run that never ends: the bound of the 10-kill version (4 x 10 launches),
# kept when the kills required fell to 3 (a run may finish before its kills, needing another).
MAX_OUTCOMES = 40
HOWS = ("all", "rank 0", "rank 1")  # taken in turn, so each way to die occurs


# the layouts killed: what each adds to parallel.ep=2
LAYOUTS = {"ep2_zero1": ["--set", "parallel.distributed_optimizer=true"],
           "ep2_fsdp": ["--set", "parallel.fsdp=true"]}


def _args(cfg_file: str, out: str, layout: str) -> list[str]:
    return [sys.executable, "-m", "moeplug", "train", "--config", cfg_file, "--out", out,
            "--nproc", "2", "--steps", str(STEPS), "--resume", "auto",
            "--set", "parallel.ep=2", *LAYOUTS[layout],
            "--set", "parallel.timeout_s=30", "--set", "train.warmup_steps=3",
            "--set", "train.log_interval=1", "--set", "train.eval_interval=6",
            "--set", "train.ckpt_interval=2", "--set", "train.keep_last=2"]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...] (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _tree(root: int) -> list[int]:
    """``root`` and its live descendants (torchrun starts each rank in a session of its own,
    so the launch is found by parentage, not by session)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parent[int(entry)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return [p for p in tree if _alive(p)]


def _ranks(tree: list[int]) -> dict[int, int]:
    """{rank: pid} of the launch's worker processes (torchrun sets RANK in their env)."""
    out = {}
    for pid in tree:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            out[int(env[b"RANK"])] = pid
    return out


def _saving(out: str, pids) -> bool:
    # rank 0 names the save's temporary directory after its pid
    return any(d.startswith(".tmp-step_") and d.rsplit("-", 1)[1] in {str(p) for p in pids}
               for d in os.listdir(out))


def _kill_at_random(cfg_file: str, out: str, env: dict, rng: random.Random, how: str,
                    aim: bool, layout: str) -> str:
    """Launch one resume; kill it (``how``: all processes, or one rank) once it has logged a
    random number (1-3) of further steps plus a random delay (``aim``: once a save is then
    under way). Returns 'killed all', 'killed rank N' (' in save' appended when a save was
    under way) or 'finished'."""
    os.makedirs(out, exist_ok=True)
    if latest_step(out) == STEPS:  # killed after its final save: nothing left to train
        return "finished"
    target = rng.randint(1, 3)
    proc, deadline = launch_and_wait(_args(cfg_file, out, layout), out, env, target,
                                     rng.uniform(0.0, 0.4))
    tree = _tree(proc.pid)
    ranks = _ranks(tree)
    while aim and proc.poll() is None and len(ranks) == 2 and not _saving(out, ranks.values()):
        assert time.monotonic() < deadline, "a launch made no progress in 300 s"
        time.sleep(0.005)
    if proc.poll() is not None or len(ranks) < 2:
        assert proc.wait() == 0, open(os.path.join(out, "stderr.log")).read()[-3000:]
        return "finished"
    in_save = " in save" if _saving(out, ranks.values()) else ""
    if how == "all":  # the machine dies: every process of the launch at once
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # exited since the snapshot
                pass
        proc.wait(timeout=60)
    else:
        os.kill(ranks[int(how[-1])], signal.SIGKILL)
        # torchrun stops the surviving rank; the launch exits non-zero, bounded in time
        assert proc.wait(timeout=180) != 0
    deadline = time.monotonic() + 60
    while left := [p for p in tree if _alive(p)]:
        assert time.monotonic() < deadline, f"processes left after a kill: {left}"
        time.sleep(0.1)
    return f"killed {how}{in_save}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_killed_at_random_steps_and_during_saves_resume_bitwise(
        tiny_config_file, tmp_path, cli_env, layout):
    cfg_file = tiny_config_file()
    reference = str(tmp_path / "reference")
    expected = uninterrupted(_args(cfg_file, reference, layout), cli_env, reference, STEPS)

    # Rank 0 pauses inside every save (after the shards, before meta.json) while rank 1 waits
    # at the save's barrier: a kill often lands mid-save. The trajectory is unaffected.
    env = dict(cli_env, MOEPLUG_TEST_SAVE_PAUSE="0.3")
    rng = random.Random(20261123)
    outcomes: list[str] = []
    runs = 0
    while sum(o != "finished" for o in outcomes) < KILLS:
        out, runs = str(tmp_path / f"killed{runs}"), runs + 1
        while (outcome := _kill_at_random(
                cfg_file, out, env, rng, HOWS[len(outcomes) % len(HOWS)],
                aim=len(outcomes) % 2 == 0, layout=layout)) != "finished":
            outcomes.append(outcome)
            assert len(outcomes) < MAX_OUTCOMES, f"no end in sight: {outcomes}"
        outcomes.append(outcome)
        assert len(outcomes) < MAX_OUTCOMES, f"too few kills landed: {outcomes}"
        # every killed-and-resumed run ends exactly where the uninterrupted one did
        assert_resumed_exactly(out, STEPS, expected)
    kills = [o for o in outcomes if o != "finished"]
    in_save = [o for o in kills if o.endswith("in save")]
    print(f"{len(kills)} SIGKILLs of a 2-rank run survived over {runs} runs, {len(in_save)} "
          f"of them during a save: {kills}")
    assert len(kills) >= KILLS and in_save, outcomes
    assert any(o.startswith("killed rank") for o in kills)
    assert any(o.startswith("killed all") for o in kills)
