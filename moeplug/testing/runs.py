"""Reading a run directory while a test kills and resumes it (tests/test_resume_kill*.py): its
logged records, the loss trajectory by step, and the newest checkpoint; the uninterrupted run
the killed ones must end like, and that check."""

from __future__ import annotations

import os


def records(out: str) -> list[dict]:
    """Every record of ``out/metrics.jsonl`` ([] before the run wrote one)."""
    from moeplug.training.metrics import read_metrics
    path = os.path.join(out, "metrics.jsonl")
    return read_metrics(path) if os.path.exists(path) else []


def trajectory(out: str, kind: str, key: str) -> dict[int, float]:
    """step -> ``key`` of the ``kind`` records. A step trained again after a kill is logged
    again; the later record (the resumed run's) wins."""
    return {r["step"]: r[key] for r in records(out) if r["kind"] == kind}


def count_train(out: str) -> int:
    """How many train records are logged; -1 while a line is being written."""
    try:
        return sum(1 for r in records(out) if r["kind"] == "train")
    except ValueError:
        return -1


def latest_step(out: str) -> int:
    """The step of the checkpoint ``latest`` points at (0: none yet)."""
    from moeplug.training.checkpoint import find_latest
    latest = find_latest(out)
    return int(os.path.basename(latest)[5:]) if latest else 0


def launch_and_wait(args: list[str], out: str, env: dict, more_steps: int,
                    delay: float) -> tuple:
    """Start ``args`` (a ``moeplug train --out out`` command; stderr appended to
    out/stderr.log) and return once it has logged ``more_steps`` more train records (or ended),
    plus ``delay`` seconds: (the process, the deadline for the rest of the wait, 300 s from
    the start)."""
    import subprocess
    import time
    start = count_train(out)
    with open(os.path.join(out, "stderr.log"), "a") as err:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while proc.poll() is None and count_train(out) < start + more_steps:
        assert time.monotonic() < deadline, "a launch made no progress in 300 s"
        time.sleep(0.01)
    time.sleep(delay)
    return proc, deadline


def uninterrupted(args: list[str], env: dict, out: str, steps: int) -> tuple[dict, dict]:
    """Run ``args`` (a ``moeplug train --out out`` command of ``steps`` steps) to the end: the
    train loss and val loss trajectories every killed-and-resumed run must end with."""
    import subprocess
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = trajectory(out, "train", "loss")
    assert sorted(loss) == list(range(1, steps + 1))
    return loss, trajectory(out, "val", "val_loss")


def assert_resumed_exactly(out: str, steps: int, expected: tuple[dict, dict]) -> None:
    """``out``, killed and resumed until it finished, logged ``expected`` (uninterrupted's
    trajectories) bit for bit, and kept its last two checkpoints (train.keep_last = 2)."""
    loss, val = expected
    assert trajectory(out, "train", "loss") == loss, out
    assert trajectory(out, "val", "val_loss") == val, out
    kept = sorted(d for d in os.listdir(out) if d.startswith("step_"))
    # a kill between the final rename and the pruning may leave one more
    assert kept[-2:] == [f"step_{steps - 2:06d}", f"step_{steps:06d}"] and len(kept) <= 3
    assert latest_step(out) == steps
