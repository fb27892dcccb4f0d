"""Run ``python -m moeplug ARGS`` as a new process, as ``subprocess.run`` would (tests only).

    proc = run_cli(["train", "--steps", "3"], env=env, timeout=300)  # a CompletedProcess

The process is real -- its own pid, stdin on /dev/null, stdout and stderr captured from its
file descriptors, its exit status the CLI's (negative: the signal that killed it) -- but its
interpreter did not start from nothing: it is forked from the forkserver of
:mod:`moeplug.testing.distributed`, which has already imported torch and moeplug. A fresh
interpreter spends ~3 s of CPU importing torch before the CLI reads its first argument; over the
suite's ~180 CLI runs that was minutes of a 2-core CI run. What a fresh start would do
differently is redone in the child: it takes ``env`` as its whole environment, ``cwd`` as its
working directory, a fresh interpreter's ``sys.path`` (``-m`` puts the working directory
first), runs the ``moeplug`` package as ``__main__`` and exits through the interpreter's exit
path (non-daemon threads joined, atexit handlers run, streams flushed).

What cannot be redone after start-up is not faked: when ``env`` differs from the forkserver's
in a variable the interpreter or torch reads at start-up (``PYTHON*``, ``TORCH*``, ...), or the
caller asks for ``fresh=True``, the child ``exec``s a fresh ``python -m moeplug`` with the same
file descriptors -- the plain subprocess.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

# Read by the interpreter or by torch at start-up, before the CLI runs: a child whose env
# changes one of them must start from nothing (sitecustomize on PYTHONPATH, say).
# OpenMP reads its variables when torch loads it. Not among them: PYTHONUNBUFFERED (redone:
# write_through) and TORCHINDUCTOR_CACHE_DIR, which torch sets itself once the test process has
# imported its compiler (a fresh process's torch sets it again when it needs it).
_STARTUP_PREFIXES = ("PYTHON", "TORCH", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_")
_REDONE = frozenset({"PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR"})


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _REDONE}


@functools.lru_cache(maxsize=None)
def _fresh_sys_path() -> tuple[str, ...]:
    """A fresh ``python -m``'s sys.path after its first entry (the working directory)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout)[1:])


def _exit_code(exc: SystemExit) -> int:
    # As the interpreter does for an uncaught SystemExit.
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _cli_child(argv: list[str], env: dict[str, str], cwd: str | None, out_path: str,
               err_path: str, exec_fresh: bool, sys_path: tuple[str, ...]) -> None:
    import atexit
    import io
    import runpy
    import threading
    import traceback

    fds = [os.open(os.devnull, os.O_RDONLY), os.open(out_path, os.O_WRONLY | os.O_APPEND),
           os.open(err_path, os.O_WRONLY | os.O_APPEND)]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if cwd is not None:
        os.chdir(cwd)
    if exec_fresh:
        os.execve(sys.executable, [sys.executable, "-m", "moeplug", *argv], env)
    sys.path[:] = [os.getcwd(), *sys_path]  # as `python -m`: the working directory first
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.argv = [sys.executable, *argv]  # runpy sets argv[0] to the module's file
    code = 0
    try:
        runpy.run_module("moeplug", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - printed and exit 1, as the interpreter does
        traceback.print_exc()
        code = 1
    try:  # the interpreter's own exit path
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to keep
                pass
        os._exit(code)


def run_cli(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float | None = None, fresh: bool = False
            ) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "moeplug", *argv], capture_output=True,
    text=True, env=env, cwd=cwd, timeout=timeout)``, started from the preloaded forkserver (see
    the module doc). Raises ``subprocess.TimeoutExpired`` (the child killed) as it would. The
    result's ``started`` says how the CLI's interpreter began: "fork" or "exec"."""
    from moeplug.testing import distributed

    argv = [str(a) for a in argv]
    cmd = [sys.executable, "-m", "moeplug", *argv]
    env = dict(os.environ if env is None else env)
    ctx = distributed._context()
    exec_fresh = (fresh or distributed.SERVER_ENV is None
                  or _startup_vars(env) != _startup_vars(distributed.SERVER_ENV))
    with tempfile.TemporaryDirectory(prefix="moeplug-cli-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "wb").close()
        proc = ctx.Process(target=_cli_child, name="moeplug-cli",
                           args=(argv, env, cwd, out_path, err_path, exec_fresh,
                                 _fresh_sys_path()))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()

        def read(path: str) -> str:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        stdout, stderr = read(out_path), read(err_path)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    done = subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)
    done.started = "exec" if exec_fresh else "fork"  # a fresh interpreter, or the forkserver
    return done
