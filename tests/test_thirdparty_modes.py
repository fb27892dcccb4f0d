"""A third-party plugin package (tests/thirdparty/moeplug-tally, written only from the documented
plugin API) installed with pip into a private directory, training in the modes of #44 item 9
or refused in one line before any rank starts.

``tally`` experts: a plain SwiGLU loop that declares ``budget_rows``; ``tally_plain``: the same
loop declaring nothing; ``tally`` dispatcher: all-gather / all-reduce. With
``$MOEPLUG_TALLY_LOG`` every eager forward of the experts appends ``pid rows N weighted M``, so
these tests see that the plugin itself computed the experts, and on which rows.

Tiny config (conftest.tiny_config_dict): 1 MoE layer, E = 4 experts, top-2, 8 x 32 = 256
tokens a micro-batch per rank, so T*K/E = 128 and with runtime.token_budget = 4.0 the budget is
C = 512 rows per (source rank, expert): no step goes over it. One process: the experts get
E*C = 2048 budget rows, 512 of them weighted (every choice lands). EP2: each rank's 2 local
experts get B = W*C = 1024 rows each, 2048 rows, and the ranks' weighted rows add up to both
ranks' 2 * 512 choices.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

from moeplug.testing.example_plugin import install_plugin_package
from moeplug.training.metrics import read_metrics

TALLY_DIR = Path(__file__).resolve().parent / "thirdparty" / "moeplug-tally"
STEPS = 3
SYNC_FREE = ("--set", "runtime.sync_free=true", "--set", "runtime.token_budget=4.0")


@pytest.fixture(scope="module")
def tally_env(tmp_path_factory):
    return install_plugin_package(TALLY_DIR, tmp_path_factory.mktemp("site") / "tally")


def _train(run_cli, cli_env, tally_env, config, out, log, *extra, experts="tally"):
    env = {**cli_env, "PYTHONPATH": tally_env["PYTHONPATH"], "MOEPLUG_TALLY_LOG": str(log)}
    return run_cli("train", "--config", config, "--out", str(out), "--experts", experts,
                   "--dispatcher", "tally", "--steps", str(STEPS), "--set",
                   "train.log_interval=1", "--set", "train.warmup_steps=1", *extra, env=env,
                   timeout=600)


def _lines(log: Path) -> list[tuple[int, int, int]]:
    """(pid, rows, weighted rows) of each logged forward of the tally experts."""
    out = []
    for line in log.read_text().splitlines():
        pid, _, rows, _, weighted = line.split()
        out.append((int(pid), int(rows), int(weighted)))
    return out


def _losses(out: Path) -> list[float]:
    train = [r for r in read_metrics(f"{out}/metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    return [r["loss"] for r in train]


def test_tally_passes_the_experts_contract_with_its_budget_rows(tally_env):
    """check_experts runs the budget-rows case because ``tally`` declares it."""
    script = ("from moeplug.plugin_host import PluginHost\n"
              "from moeplug.testing import check_experts\n"
              "host = PluginHost.load()\n"
              "cls = type(host.create('experts', 'tally', {}, "
              "__import__('moeplug.testing', fromlist=['x']).tiny_model_config(), 2))\n"
              "assert cls.budget_rows and not cls.capturable\n"
              "check_experts(host, 'tally')\n"
              "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], env=tally_env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_tally_trains_sync_free_on_budget_rows_through_its_forward(
        tally_env, run_cli, cli_env, tiny_config_file, tmp_path):
    """runtime.sync_free with the third-party experts: every training forward is the plugin's
    own, on 2048 budget rows of which 512 carry a weight; the losses are the dynamic path's."""
    config = tiny_config_file()
    dynamic = _train(run_cli, cli_env, tally_env, config, tmp_path / "dyn", tmp_path / "d.log")
    assert dynamic.returncode == 0, dynamic.stderr[-3000:]
    proc = _train(run_cli, cli_env, tally_env, config, tmp_path / "sf", tmp_path / "sf.log",
                  *SYNC_FREE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    budgeted = [(rows, w) for _, rows, w in _lines(tmp_path / "sf.log") if rows == 4 * 512]
    assert budgeted == [(2048, 512)] * STEPS  # one MoE layer, one micro-batch a step
    assert all(rows != 2048 for _, rows, _ in _lines(tmp_path / "d.log"))
    records = list(read_metrics(f"{tmp_path / 'sf'}/metrics.jsonl"))
    assert not [r for r in records if r["kind"] == "sync_free_rerun"]
    assert _losses(tmp_path / "sf") == pytest.approx(_losses(tmp_path / "dyn"), rel=1e-4)


def test_tally_trains_sync_free_at_ep2(tally_env, run_cli, cli_env, tiny_config_file, tmp_path):
    """EP2: the budgeted exchange brings each rank's 2 local experts W*C = 1024 rows apiece,
    through the plugin's forward on both ranks; every choice of both ranks is weighted once."""
    proc = _train(run_cli, cli_env, tally_env, tiny_config_file(), tmp_path / "ep2",
                  tmp_path / "ep2.log", *SYNC_FREE, "--nproc", "2", "--set", "parallel.ep=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_pid = collections.defaultdict(list)
    for pid, rows, weighted in _lines(tmp_path / "ep2.log"):
        if rows == 2 * 1024:
            per_pid[pid].append(weighted)
    assert len(per_pid) == 2 and all(len(w) == STEPS for w in per_pid.values()), per_pid
    a, b = per_pid.values()
    assert [x + y for x, y in zip(a, b)] == [2 * 512] * STEPS
    assert not [r for r in read_metrics(f"{tmp_path / 'ep2'}/metrics.jsonl")
                if r["kind"] == "sync_free_rerun"]


@pytest.mark.parametrize("experts, extra, capability", [
    ("tally_plain", (), "budget_rows"),
    ("tally", ("--set", "runtime.capture=true"), "capturable"),
])
def test_a_capability_the_plugin_lacks_is_refused_in_one_line_before_any_rank(
        tally_env, run_cli, cli_env, tiny_config_file, tmp_path, experts, extra, capability):
    """At EP2 too: the plugin host refuses the run before a rank starts, one line naming the
    plugin, the capability and the fix; the experts never ran."""
    log = tmp_path / "refused.log"
    proc = _train(run_cli, cli_env, tally_env, tiny_config_file(), tmp_path / "r", log,
                  *SYNC_FREE, *extra, "--nproc", "2", "--set", "parallel.ep=2",
                  experts=experts)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"plugins.experts = '{experts}'" in lines[0] and capability in lines[0]
    assert "Fix:" in lines[0]
    assert not log.exists()
