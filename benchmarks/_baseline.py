"""Old vs new in one run: a baseline revision of moeplug built once, then one workload timed in
two long-lived worker processes, alternating old / new / old / new.

    result = old_vs_new("moe_layer", {"T": 4096, ...}, pairs=5)
    result.ratios      # new / old seconds, one per pair (pair i ran back to back)

The baseline is ``$MOEPLUG_BENCH_BASELINE`` (any git revision), by default
``DEFAULT_BASELINE``: main's last commit before the MoE-wing redesign of issue #44 landed
(e61165b, the h-fsdp merge; its first-parent child 26078d9 merges h-moe, items 1-3). The fork
point h-moe branched from (78896e3) is older: main gained h-tok, h-data, h-train, h-pipe,
h-audit and h-fsdp after it, so a ratio against it would mix their changes into the
redesign's.

The baseline tree is ``git archive``d (no worktree is registered in the user's repository)
into ``$MOEPLUG_BENCH_CACHE`` (default ``build/bench-baseline/`` in the checkout) and its C++
extension built there with CMake as .ci/run builds one (Release, pybind11's CMake config),
cached by the hash of its C++ sources (``runtime_cpp/`` and ``CMakeLists.txt``), so a
baseline with the same C++ as another reuses its build. One-time cost on 2 shared cores:
the archive ~2 s, the extension ~1.5-3 min. Without git history (a tarball install) or
without cmake / pybind11, the benchmarks that need a baseline skip, saying why.

Both workers run the same ``benchmarks/_baseline_workloads.py`` code with the same seeds and
shapes, timed inside the worker (no pipe in the timing) and one at a time (the other waits on
its pipe), so each pair shares a stretch of the shared machine's drift. Each pair's ratio
is new / old; the figure is their median with the min-max spread. After timing, the workers'
digests (sha256 of the first unit's output and gradients, or every step's loss and grad norm)
must be equal: a speed comparison of two different computations means nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DEFAULT_BASELINE = "e61165b"
ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_baseline_worker.py"
MARK = "@@moeplug-bench@@ "
# new / old median paired ratio accepted as "unchanged". Generous: 2 shared cores under other
# sessions' load drift 2-3x within minutes; pairing cancels most of it, not all (one pair's
# two units are seconds apart). A real regression of the layer or step shows as > 1.5.
NOISE_BAND = (2 / 3, 1.5)


def _git(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, **kw)


def baseline_rev() -> str:
    return os.environ.get("MOEPLUG_BENCH_BASELINE", DEFAULT_BASELINE)


def _cache() -> Path:
    return Path(os.environ.get("MOEPLUG_BENCH_CACHE", ROOT / "build" / "bench-baseline"))


def _resolve(rev: str) -> str:
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"old-vs-new needs the git history (baseline {rev}); this checkout has none")
    done = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode != 0:
        pytest.skip(f"MOEPLUG_BENCH_BASELINE={rev}: no such commit in this clone "
                    "(a shallow clone? git fetch --unshallow)")
    return done.stdout.strip()


def _archive(sha: str) -> Path:
    tree = _cache() / sha[:12]
    if (tree / ".complete").exists():
        return tree
    tmp = tree.with_name(tree.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {sha} failed")
    (tmp / ".complete").write_text(sha + "\n")
    shutil.rmtree(tree, ignore_errors=True)
    tmp.rename(tree)
    return tree


def _extension(sha: str, tree: Path) -> Path:
    """The tree's moeplug/_runtime_core built with CMake (cached by its C++ sources' hash)."""
    if list((tree / "moeplug").glob("_runtime_core*.so")):
        return tree
    key = hashlib.sha1("".join(_git("rev-parse", f"{sha}:{p}").stdout
                               for p in ("runtime_cpp", "CMakeLists.txt")).encode()).hexdigest()
    build = _cache() / "ext" / key[:12]
    built = sorted(build.glob("_runtime_core*.so"))
    if not built:
        if shutil.which("cmake") is None:
            pytest.skip("building the baseline's C++ extension needs cmake on PATH")
        try:
            import pybind11
        except ImportError:
            pytest.skip("building the baseline's C++ extension needs pybind11 "
                        "(pip install pybind11==3.1.0; it is in the test extra)")
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        f"-DPython_EXECUTABLE={sys.executable}",
                        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
                       check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "_runtime_core"],
                       check=True, capture_output=True)
        built = sorted(build.glob("_runtime_core*.so"))
    shutil.copy2(built[0], tree / "moeplug" / built[0].name)
    return tree


def baseline_tree(rev: str | None = None) -> tuple[str, Path]:
    """(full sha, materialized tree with its extension built) of the baseline revision."""
    rev = rev or baseline_rev()
    sha = _resolve(rev)
    return sha, _extension(sha, _archive(sha))


class Worker:
    """One worker process (benchmarks/_baseline_worker.py) serving one tree's moeplug."""

    def __init__(self, tree: Path | None) -> None:
        env = dict(os.environ)
        env.pop("MOEPLUG_BENCH_TREE", None)
        if tree is not None:
            env["MOEPLUG_BENCH_TREE"] = str(tree)
        self.proc = subprocess.Popen([sys.executable, "-u", str(WORKER)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=str(tree or ROOT))
        self.tree = tree

    def call(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                reply = json.loads(line[len(MARK):])
                if "error" in reply:
                    raise RuntimeError(f"worker ({self.tree or 'new'}): {reply['error']}")
                return reply
        raise RuntimeError(f"worker ({self.tree or 'new'}) exited with {self.proc.wait()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@dataclass
class OldVsNew:
    rev: str
    old_s: list[float] = field(default_factory=list)
    new_s: list[float] = field(default_factory=list)
    old_digest: dict = field(default_factory=dict)
    new_digest: dict = field(default_factory=dict)

    @property
    def ratios(self) -> list[float]:
        return [n / o for n, o in zip(self.new_s, self.old_s)]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def note(self) -> str:
        r = self.ratios
        return (f"new/old pairs {min(r):.3f}-{max(r):.3f} (n={len(r)}); old "
                f"{statistics.median(self.old_s) * 1e3:.1f} ms, new "
                f"{statistics.median(self.new_s) * 1e3:.1f} ms; baseline {self.rev[:8]}")

    def check(self) -> None:
        """Same computation (digests equal), then the speed within the noise band."""
        assert self.old_digest == self.new_digest, (self.old_digest, self.new_digest)
        lo, hi = NOISE_BAND
        assert lo <= self.median <= hi, self.note()


def old_vs_new(kind: str, params: dict, pairs: int = 5, warmup: int = 1,
               threads: int | None = None, rev: str | None = None) -> OldVsNew:
    """Time ``kind`` (a benchmarks/_baseline_workloads name) in the baseline tree and in this
    checkout, alternating unit by unit: ``warmup`` untimed pairs, then ``pairs`` timed ones."""
    sha, tree = baseline_tree(rev)
    result = OldVsNew(sha)
    old, new = Worker(tree), Worker(None)
    try:
        for w in (old, new):
            where = w.call(op="setup", kind=kind, params=params, threads=threads)
            if w is old:  # the core and the built-in plugins both from the baseline tree
                for path in (where["moeplug"], where["plugins"]):
                    assert path and Path(path).resolve().is_relative_to(tree.resolve()), where
        for _ in range(warmup):
            old.call(op="run"), new.call(op="run")
        for _ in range(pairs):
            result.old_s.append(old.call(op="run")["seconds"])
            result.new_s.append(new.call(op="run")["seconds"])
        result.old_digest, result.new_digest = old.call(op="digest"), new.call(op="digest")
    finally:
        old.close(), new.close()
    return result
