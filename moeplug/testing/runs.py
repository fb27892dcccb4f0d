"""Reading a run directory while a test kills and resumes it (tests/test_resume_kill*.py): its
logged records, the loss trajectory by step, and the newest checkpoint."""

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
