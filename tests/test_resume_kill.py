"""Exact resume under SIGKILL: ``moeplug train --resume auto`` killed at random moments (seeded),
some of them inside a checkpoint save, ends with the loss trajectory of the run nobody killed,
bit for bit (CPU, one thread, fixed layout)."""

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

STEPS = 12
KILLS = 8
# Every AIM-th launch waits for a checkpoint save to be under way before the kill, so kills
# inside a save are certain with few launches (the others land wherever the random delay does).
AIM = 3


def _args(cfg_file: str, out: str) -> list[str]:
    return [sys.executable, "-m", "moeplug", "train", "--config", cfg_file, "--out", out,
            "--steps", str(STEPS), "--resume", "auto", "--set", "train.warmup_steps=3",
            "--set", "train.log_interval=1", "--set", "train.eval_interval=6",
            "--set", "train.ckpt_interval=2", "--set", "train.keep_last=2"]


def _saving(out: str, pid: int) -> bool:
    return any(d.startswith(".tmp-step_") and d.endswith(f"-{pid}") for d in os.listdir(out))


def _kill_at_random(cfg_file: str, out: str, env: dict, rng: random.Random,
                    aim: bool) -> str:
    """Launch one resume; SIGKILL it once it has logged a random number (1-4) of further steps
    plus a random delay (``aim``: once a save is then under way). Returns 'killed',
    'killed in save' or 'finished'."""
    os.makedirs(out, exist_ok=True)
    if latest_step(out) == STEPS:  # killed after its final save: nothing left to train
        return "finished"
    target = rng.randint(1, 4)
    proc, deadline = launch_and_wait(_args(cfg_file, out), out, env, target,
                                     rng.uniform(0.0, 0.3))
    while aim and proc.poll() is None and not _saving(out, proc.pid):
        assert time.monotonic() < deadline, "a launch made no progress in 300 s"
        time.sleep(0.005)
    if proc.poll() is not None:
        assert proc.returncode == 0, open(os.path.join(out, "stderr.log")).read()[-2000:]
        return "finished"
    in_save = _saving(out, proc.pid)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    return "killed in save" if in_save else "killed"


def test_sigkill_at_random_steps_and_during_saves_resumes_bitwise(tiny_config_file, tmp_path,
                                                                 cli_env):
    cfg_file = tiny_config_file()
    reference = str(tmp_path / "reference")
    expected = uninterrupted(_args(cfg_file, reference), cli_env, reference, STEPS)

    # Pausing inside every save (after the shards, before meta.json) widens the window in
    # which a kill lands mid-save; the trajectory is unaffected.
    env = dict(cli_env, MOEPLUG_TEST_SAVE_PAUSE="0.2")
    rng = random.Random(20261123)
    outcomes: list[str] = []
    runs = 0
    while sum(o != "finished" for o in outcomes) < KILLS:
        out, runs = str(tmp_path / f"killed{runs}"), runs + 1
        while (outcome := _kill_at_random(cfg_file, out, env, rng,
                                          aim=len(outcomes) % AIM == 0)) != "finished":
            outcomes.append(outcome)
            assert len(outcomes) < 3 * KILLS, f"no end in sight: {outcomes}"
        outcomes.append(outcome)
        # every killed-and-resumed run ends exactly where the uninterrupted one did
        assert_resumed_exactly(out, STEPS, expected)
    kills = sum(o != "finished" for o in outcomes)
    in_save = outcomes.count("killed in save")
    print(f"{kills} SIGKILLs survived over {runs} runs, {in_save} of them during a save")
    assert kills >= KILLS and in_save >= 2, outcomes
