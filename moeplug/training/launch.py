"""``moeplug train --nproc N``: re-execute the same command under torchrun.

No launcher or rendezvous of our own: the parent runs
``python -m torch.distributed.run --standalone --nproc-per-node N -m moeplug <argv minus --nproc>``
and returns its exit status. torchrun starts the ranks, sets WORLD_SIZE/RANK/MASTER_ADDR/PORT,
and tears every rank down when one fails; the ranks then see a normal ``moeplug train``
under torchrun (moeplug.training.distributed.init_distributed joins the process group).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence


def under_torchrun() -> bool:
    """True inside a rank started by torchrun (it sets TORCHELASTIC_RUN_ID for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (the ranks must not relaunch)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "moeplug", *strip_nproc(argv)]


def relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Run the command on ``nproc`` ranks under torchrun; its exit status (0 = every rank ok)."""
    env = dict(os.environ)
    # One intra-op thread per rank unless the user chose otherwise: N ranks of multi-threaded
    # torch on the same cores only fight (torchrun sets the same default, with a warning).
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(nproc, argv), env=env)
