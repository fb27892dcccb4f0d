"""Reading a run's ``metrics.jsonl`` back for plots and TensorBoard (the format:
moeplug.training.metrics). Errors are RunDirErrors naming the path and the fix."""

from __future__ import annotations

import json
import os

from moeplug.config import ConfigError


class RunDirError(ConfigError):
    """The run directory cannot be read or plotted; the message names the path and the fix. A
    ConfigError, so the CLI reports it as one paragraph with exit status 2."""


def read_records(run_dir: str) -> list[dict]:
    """Every record of ``run_dir/metrics.jsonl`` in file order.

    A truncated last line (the run died mid-write, or is still writing) is skipped; a broken
    line elsewhere is an error.
    """
    if not os.path.isdir(run_dir):
        raise RunDirError(f"run directory {run_dir!r} does not exist. Fix: pass the train.out_dir "
                          f"of a run (the folder holding metrics.jsonl), e.g. runs/default")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise RunDirError(f"{run_dir!r} has no metrics.jsonl. Fix: pass the train.out_dir of a "
                          f"run that `moeplug train` has started (it writes metrics.jsonl there)")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the run died while writing its last line
            raise RunDirError(f"{path}: line {i + 1} is not valid JSON. Fix: delete or repair "
                              f"that line (metrics.jsonl holds one JSON object per line)") from None
    return records


def by_step(records: list[dict], kind: str) -> dict[int, dict]:
    """The records of ``kind`` ("train", "val") keyed by step, in step order. A resumed run
    appends to the file and may log a step twice: the later record wins."""
    latest = {int(r["step"]): r for r in records if r.get("kind") == kind and "step" in r}
    return dict(sorted(latest.items()))
