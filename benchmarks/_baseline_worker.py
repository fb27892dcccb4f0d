"""A long-lived benchmark worker: one tree's moeplug, one workload, timed units on request.

Started by ``benchmarks/_baseline.py`` as ``python _baseline_worker.py``. With
``$MOEPLUG_BENCH_TREE`` set it imports moeplug (and the built-in plugins) from that tree, not
from the installed checkout: the editable install's import redirect is taken off
``sys.meta_path`` and the tree's root and ``plugins/`` go first on ``sys.path``; it checks
that ``moeplug`` really came from there. Without it: the installed (new) moeplug.

Protocol: one JSON request a line on stdin, one JSON reply a line on stdout prefixed with
``MARK`` (anything else torch or moeplug print is not mistaken for a reply):
    {"op": "setup", "kind": ..., "params": {...}, "threads": n|null} -> {"moeplug": file}
    {"op": "run"}                -> {"seconds": wall time of one unit}
    {"op": "digest"}             -> the workload's digest
    {"op": "exit"}
An exception is replied as {"error": traceback text}, and the worker keeps serving.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

MARK = "@@moeplug-bench@@ "


def _use_tree(tree: Path) -> None:
    # scikit-build-core's editable install maps `moeplug` / `moeplug_plugins` to the checkout
    # through a finder on sys.meta_path that outranks sys.path: drop it so the tree wins.
    sys.meta_path[:] = [f for f in sys.meta_path
                        if "editable" not in type(f).__module__.lower()
                        and "ScikitBuild" not in type(f).__name__]
    sys.path[:0] = [str(tree), str(tree / "plugins")]


def _reply(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    tree = os.environ.get("MOEPLUG_BENCH_TREE")
    if tree:
        _use_tree(Path(tree))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # _baseline_workloads
    import torch

    import moeplug
    if tree and not Path(moeplug.__file__).resolve().is_relative_to(Path(tree).resolve()):
        _reply({"error": f"moeplug imported from {moeplug.__file__}, not from {tree}"})
        return
    import _baseline_workloads
    work = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "setup":
                if req.get("threads"):
                    torch.set_num_threads(int(req["threads"]))
                work = _baseline_workloads.make(req["kind"], req["params"])
                _reply({"moeplug": moeplug.__file__,
                        "plugins": sys.modules["moeplug_plugins"].__file__
                        if "moeplug_plugins" in sys.modules else None})
            elif req["op"] == "run":
                t0 = time.perf_counter()
                work.run()
                _reply({"seconds": time.perf_counter() - t0})
            elif req["op"] == "digest":
                _reply(work.digest())
            elif req["op"] == "exit":
                return
        except Exception:  # noqa: BLE001 - the parent reports it with the test's context
            _reply({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
