"""What a run directory holds, so that ``moeplug train`` never mixes two runs in one.

A run writes ``metrics.jsonl``, ``step_XXXXXX/`` checkpoints, ``latest`` and, while saving,
``.tmp-*`` entries (moeplug.training.checkpoint). A directory holding any of them is *used*: a
new run there would append its records to the old run's and leave the old model's checkpoints
beside its own. So a used directory is refused unless the run continues it (``--resume auto``
or a checkpoint inside it) or ``--overwrite`` clears the old run first. Other files (a config
the user keeps there, a plot) are neither counted nor removed.

Nor may two *live* runs share a directory (a job re-queued while the first still runs): each
would append to the other's metrics and delete the other's checkpoint in progress. A run holds
an exclusive lock on ``.moeplug.lock`` there for its lifetime (:func:`lock_run_dir`): the
launching process, or one process alone; under a plain ``torchrun``, rank 0. The kernel drops
the lock when the process ends, however it ends, so a killed run never leaves it behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket

from moeplug.config import ConfigError
from moeplug.training.checkpoint import LATEST

METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".moeplug.lock"
# Set by the launching process for its ranks: the directory whose lock it holds for them.
LOCKED_ENV = "MOEPLUG_RUN_DIR_LOCKED"
_held: list = []  # this process's open lock files: the lock lives as long as they stay open


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
    refuse_file(out_dir, "train.out_dir =")
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


def refuse_file(out_dir: str, name: str) -> None:
    """ConfigError when ``out_dir`` exists but is no directory; ``name`` says where it came
    from (a field with " =", or a flag)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{name} {out_dir!r} is a file, not a directory. Fix: pass --out a "
                          "directory (new, or a run's)")


def clear_run(out_dir: str) -> None:
    """Remove the previous run's artifacts (``run_artifacts``) from ``out_dir``."""
    for name in run_artifacts(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def lock_run_dir(out_dir: str, name: str = "train.out_dir") -> None:
    """Hold ``out_dir``'s run lock until this process ends (or :func:`release_run_dirs`);
    ConfigError naming the holder if another live run has it, the directory as ``name`` (the
    field or flag it came from). Skipped in a rank whose launcher holds it (``LOCKED_ENV``)."""
    if os.environ.get(LOCKED_ENV) == os.path.realpath(out_dir):
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, LOCK_FILE), "a+")
    except OSError as e:  # a parent that is a file, no permission, a read-only file system
        raise ConfigError(f"{name} = {out_dir!r} cannot be created or written "
                          f"({e.strerror or e}). Fix: pass --out a directory this user can "
                          "write") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "its process id unknown"
        f.close()
        raise ConfigError(f"{name} = {out_dir!r} is in use by another live run "
                          f"({holder}): two runs there would interleave their metrics and "
                          f"delete each other's checkpoints in progress. Fix: wait for that run "
                          f"to end (or stop it), or pass --out NEW_DIR") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _held.append(f)


def release_run_dirs() -> None:
    """Drop every run lock this process holds (its train command returned)."""
    while _held:
        _held.pop().close()
