"""Run a function on N real processes joined by a gloo process group on 127.0.0.1 (tests only).

    results = run_distributed(fn, 4, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on 4 ranks

``fn`` must be importable by the children (a module-level function) and return something
picklable; ``results[r]`` is rank r's return value. The harness guarantees three things tests need:

* **No hangs.** The whole run has a wall-clock ``timeout``; on expiry every child is killed and
  :class:`DistributedTimeout` names the ranks that had not finished. The process group itself is
  created with ``pg_timeout``, so a rank waiting on a dead peer raises instead of blocking.
* **Failures keep their traceback.** An exception on any rank becomes a
  :class:`DistributedError` carrying each failed rank's formatted traceback (and the exit code of
  ranks that died without one). After the first failure the others get ``grace`` seconds to
  report their own error (often the more telling one) before they are killed.
* **Clean teardown.** Every child destroys its process group; the parent reaps every child.

Children run with one intra-op thread (OMP_NUM_THREADS=1): the test machines are small and N
ranks of multi-threaded torch would only fight over the same cores.

Children are forked from a forkserver that imported torch and moeplug's training stack once
(spawn re-imports them in every rank: ~2-3 s of CPU each, which over a test suite's thousands
of ranks was minutes of a 2-core CI run). The forkserver only imports -- no op runs there, so
no OpenMP or runtime thread exists to be lost in a fork -- and each child takes the caller's
environment as it is at the call (a spawned child would have; a forked one would otherwise
see the server's, frozen when it started).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class DistributedError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text or exit reason."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        parts = [f"--- rank {r} ---\n{text.rstrip()}" for r, text in self.failures.items()]
        super().__init__(f"{len(self.failures)} rank(s) failed: {sorted(self.failures)}\n"
                         + "\n".join(parts))


class DistributedTimeout(DistributedError):
    """The run exceeded its wall-clock timeout; all children were killed."""


def free_port() -> int:
    # Bind to port 0 so the OS picks an unused port. Until rank 0 binds it again another
    # process may take it: run_distributed then starts over on a new port (_port_was_taken).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launches on a fresh port after rank 0 found its port taken (the race of free_port). A CI run
# lost a test to it once: rank 0's TCPStore "failed to listen ... EADDRINUSE" while two xdist
# workers each started process groups.
PORT_ATTEMPTS = 3


def _port_was_taken(error: "DistributedError") -> bool:
    """Rank 0 could not listen on the port free_port gave: it failed before ``fn`` ran on any
    rank (init_process_group is the first thing a child does), so starting over is safe."""
    return "EADDRINUSE" in error.failures.get(0, "") and "init_process_group" in error.failures[0]


def _child(fn: Callable, rank: int, world_size: int, port: int, pg_timeout_s: float,
           results: Any, args: tuple, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickle to bytes here: handing tensors to the queue directly would send them through
        # torch's shared-memory reducer, whose file descriptors die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from the test body
        results.put((rank, False, traceback.format_exc()))


def _context():
    """forkserver with torch preloaded (see the module docstring); spawn where the platform has
    no forkserver. Never plain fork: the caller (pytest) has run torch ops, so its OpenMP and
    runtime threads would be half-copied into the child and can deadlock it."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    global SERVER_ENV
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    if SERVER_ENV is None:  # the forkserver starts with the first process started from ctx
        SERVER_ENV = dict(os.environ)
    return ctx


# The environment the forkserver started with (its children inherit it before they take their
# caller's): what moeplug.testing.cli compares a CLI's environment with.
SERVER_ENV: dict[str, str] | None = None


# What the forkserver imports once, so no rank pays it. torch._dynamo: torch's own optimizers
# (some tests' references) and torch.utils.checkpoint import it at their first call, ~2.4 s of
# CPU a rank. moeplug's training stack, its built-in plugins and pytest (which the test modules
# a rank unpickles its function from import): ~0.8 s of CPU a rank (py-spy over the ranks of
# tests/test_overlap.py, most of it registering custom ops), for hundreds of ranks a suite.
# Importing them starts no thread and reads no environment variable: moeplug reads its
# variables when called, so each rank still sees the caller's environment. A module that
# fails to import here is skipped by the forkserver and imported by the rank as before.
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "moeplug.training.trainer",
            "moeplug.training.distributed", "moeplug.testing.steps", "moeplug_plugins.routers",
            "moeplug_plugins.dispatchers", "moeplug_plugins.experts",
            "moeplug_plugins.precision", "moeplug.cli", "pytest")


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                    pg_timeout: float = 60, grace: float = 10) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return the
    per-rank results in rank order. Raises DistributedError / DistributedTimeout."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size = {world_size!r}: must be a positive integer. "
                         "Fix: pass the number of ranks to spawn")
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _run_once(fn, world_size, args, timeout, pg_timeout, grace)
        except DistributedError as error:
            if isinstance(error, DistributedTimeout) or not _port_was_taken(error):
                raise
    return _run_once(fn, world_size, args, timeout, pg_timeout, grace)


def run_layouts(fn: Callable, world_size: int, layouts: dict, *, per_launch: int = 4,
                timeout: float = 300, pg_timeout: float = 60) -> list[dict]:
    """``fn(rank, world_size, some_layouts) -> dict`` over ``layouts`` (name -> spec), a few at
    a time, each few on new processes; per rank, the dicts merged in order. ``timeout`` is
    per launch.

    Why not all in one launch: every gloo process group keeps a TCP loop and two run-loop
    threads until the default group is destroyed, and a rank that built dozens of layouts'
    groups (25 layouts x 2 variants of the overlap comparison: ~1,200 threads per rank) ran its
    steps several times slower. Destroying the groups in between is no way out: torch names a
    group that only its members create (the hierarchical dispatcher's node groups) after its
    ranks and the number of live groups, so once groups are destroyed a new group can get a
    live one's name and torch refuses it ("The specified group name has already been
    created")."""
    names = list(layouts)
    merged: list[dict] = [{} for _ in range(world_size)]
    for start in range(0, len(names), per_launch):
        chunk = {n: layouts[n] for n in names[start:start + per_launch]}
        for rank, out in enumerate(run_distributed(fn, world_size, chunk, timeout=timeout,
                                                   pg_timeout=pg_timeout)):
            merged[rank].update(out)
    return merged


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float, pg_timeout: float,
              grace: float) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_child, daemon=True, name=f"moeplug-rank{r}",
                         args=(fn, r, world_size, port, pg_timeout, results, args, env))
             for r in range(world_size)]
    for p in procs:
        p.start()

    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                pending = [r for r in range(world_size) if r not in outputs and r not in failures]
                for r in pending:
                    failures[r] = f"still running after the {timeout} s timeout; killed"
                raise DistributedTimeout(failures)
            if first_failure_at is not None and now > first_failure_at + grace:
                for r in range(world_size):
                    if r not in outputs and r not in failures:
                        failures[r] = f"killed {grace} s after another rank failed"
                break
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue.Empty:
                # A child that died without reporting (os._exit, a signal, a segfault).
                for r, p in enumerate(procs):
                    if r in outputs or r in failures or p.is_alive():
                        continue
                    try:  # its report may still be in flight through the queue's pipe
                        rank, ok, value = results.get(timeout=0.5)
                    except queue.Empty:
                        failures[r] = f"process exited with code {p.exitcode} without a result"
                        first_failure_at = first_failure_at or time.monotonic()
                        continue
                    break
                else:
                    continue
            if ok:
                outputs[rank] = pickle.loads(value)
            else:
                failures[rank] = value
                first_failure_at = first_failure_at or time.monotonic()
        if failures:
            raise DistributedError(failures)
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
