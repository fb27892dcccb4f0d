"""What a run directory holds, so that ``moeplug train`` never mixes two runs in one.

A run writes ``metrics.jsonl``, ``step_XXXXXX/`` checkpoints, ``latest`` and, while saving,
``.tmp-*`` entries (moeplug.training.checkpoint). A directory holding any of them is *used*: a
new run there would append its records to the old run's and leave the old model's checkpoints
beside its own. So a used directory is refused unless the run continues it (``--resume auto``
or a checkpoint inside it) or ``--overwrite`` clears the old run first. Other files (a config
the user keeps there, a plot) are neither counted nor removed.
"""

from __future__ import annotations

import os
import shutil

from moeplug.config import ConfigError
from moeplug.training.checkpoint import LATEST

METRICS_FILE = "metrics.jsonl"


def run_artifacts(out_dir: str) -> list[str]:
    """The entries of ``out_dir`` that a run wrote, sorted ([] for a new or missing directory)."""
    if not os.path.isdir(out_dir):
        return []
    # "tb": the TensorBoard events of train.tensorboard (observability/tensorboard.py)
    return sorted(name for name in os.listdir(out_dir)
                  if name in (METRICS_FILE, LATEST, "tb") or name.startswith(("step_", ".tmp-")))


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def check_run_dir(out_dir: str, resume: str, resume_from: str | None, overwrite: bool) -> None:
    """ConfigError unless a run may write to ``out_dir``: it is unused, or the run continues it
    (``resume`` is "auto", or ``resume_from``, the resolved checkpoint, lies inside it), or
    ``overwrite`` is set (and the run does not also resume from it)."""
    continues = resume == "auto" or bool(resume_from and _inside(resume_from, out_dir))
    if overwrite and continues:
        raise ConfigError(f"--overwrite with train.resume = {resume!r}: overwriting would delete "
                          f"the run in {out_dir!r} that this run resumes. Fix: drop --overwrite "
                          "to continue that run, or drop --resume to replace it")
    used = run_artifacts(out_dir)
    if used and not continues and not overwrite:
        shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
        raise ConfigError(f"train.out_dir = {out_dir!r} already holds a run ({shown}); a new run "
                          "there would mix its metrics and checkpoints with the old one's. Fix: "
                          "pass --resume auto to continue it, --overwrite to replace it, or "
                          "--out NEW_DIR")


def clear_run(out_dir: str) -> None:
    """Remove the previous run's artifacts (``run_artifacts``) from ``out_dir``."""
    for name in run_artifacts(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
