"""``moeplug train --nproc N``: run the same command on N ranks under torchrun.

No launcher or rendezvous of our own: the ``moeplug`` process runs torchrun's agent itself
(``torch.distributed.run --standalone --nproc-per-node N -m moeplug <argv minus --nproc>``,
through :func:`agent_main`) and returns its exit status. torchrun starts the ranks, sets
WORLD_SIZE/RANK/MASTER_ADDR/PORT, and tears every rank down when one fails; the ranks then see
a normal ``moeplug train`` under torchrun (moeplug.training.distributed.init_distributed joins
the process group).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Sequence


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


def torchrun_args(nproc: int, argv: Sequence[str]) -> list[str]:
    """torchrun's arguments for ``argv`` on ``nproc`` ranks of this machine."""
    return ["--standalone", f"--nproc-per-node={nproc}", "-m", "moeplug", *strip_nproc(argv)]


def _stopped(code: int) -> bool:
    """SIGTERM, raw or through the ranks' handler (128 + 15): torchrun stopping the rest."""
    return code in (-signal.SIGTERM, 128 + signal.SIGTERM)


def _how(failure: Any) -> str:
    if _stopped(failure.exitcode):
        return "stopped by SIGTERM"
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exit status {failure.exitcode}"


def agent_main(argv: Sequence[str]) -> int:
    """torchrun (``torch.distributed.run``) with ``argv``. With max_restarts 0, when one rank
    exits non-zero or is killed the agent SIGTERMs the others and waits for them (no orphans);
    its report becomes one line naming every rank that failed and how, not a traceback. The
    same when the launch itself gets SIGTERM, SIGINT or SIGHUP: the ranks are stopped, and the
    exit status is 128 + the signal's number."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    try:
        run(parse_args(list(argv)))
    except SignalException as e:
        # SIGTERM/SIGINT/SIGHUP to the launch (a scheduler, Ctrl-C): the agent has stopped the
        # ranks by now; exit as a process killed by that signal would, without a traceback.
        print(f"moeplug: stopped by {signal.Signals(e.sigval).name}; torchrun stopped the "
              "ranks", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # Who exited first is not always the culprit (a hung rank's peers time out first, a
        # killed rank's peer may be seen first): list every failed rank, killed ones first,
        # SIGTERM (the agent stopping the rest) last; the ranks' own lines say which peer failed.
        def order(kv: tuple) -> tuple:
            code = kv[1].exitcode
            return (2 if _stopped(code) else 0 if code < 0 else 1, kv[0])
        failures = sorted(e.failures.items(), key=order)
        what = ", ".join(f"rank {r} ({_how(f)})" for r, f in failures)
        print(f"moeplug: failed: {what}; torchrun stopped the other ranks", file=sys.stderr)
        # The ranks' own status (e.g. 3: a fault stopped training) when one exited with one.
        return next((f.exitcode for _, f in failures
                     if f.exitcode > 0 and not _stopped(f.exitcode)), 1)
    return 0


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launch_line(cfg: Any, nproc: int, threads: int, cores: int) -> str:
    """What ``--nproc`` says before starting the ranks: the global batch, which data
    parallelism multiplies (DP ranks each train their own micro-batches), and a warning when
    ``nproc`` ranks of ``threads`` threads each oversubscribe ``cores``."""
    tc, dp = cfg.train, cfg.parallel.layout().resolve(nproc).dp
    seqs = tc.micro_batch_size * tc.grad_accum_steps * dp
    line = (f"launching {nproc} ranks under torchrun, {threads} thread(s) each; global batch = "
            f"micro_batch_size {tc.micro_batch_size} x grad_accum_steps {tc.grad_accum_steps} x "
            f"DP {dp} = {seqs} sequences ({seqs * tc.seq_len} tokens) per step")
    if nproc * threads > cores:
        line += (f"\nwarning: {nproc} ranks x {threads} thread(s) on {cores} CPU core(s) "
                 "oversubscribe them: the ranks take turns, so each step is slower than with "
                 "fewer ranks (fine for trying a layout, not for speed)")
    return line


def relaunch(cfg: Any, nproc: int, argv: Sequence[str]) -> int:
    """Run the command on ``nproc`` ranks under torchrun; its exit status (0 = every rank ok)."""
    # One intra-op thread per rank unless the user chose otherwise: N ranks of multi-threaded
    # torch on the same cores only fight (torchrun sets the same default, with a warning). The
    # ranks inherit this process's environment; its own torch threads are already set.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # train.threads > 0 overrides OMP_NUM_THREADS in every rank (torch.set_num_threads).
    omp = os.environ["OMP_NUM_THREADS"]
    threads = cfg.train.threads or (int(omp) if omp.isdigit() and int(omp) > 0 else 1)
    print(launch_line(cfg, nproc, threads, usable_cores()), flush=True)
    # The agent runs here, not in a torchrun process of its own: this process has torch
    # imported already, and a second interpreter would import it again (seconds of CPU per
    # launch) only to wait on the ranks.
    return agent_main(torchrun_args(nproc, argv))

