"""A real third-party package (plugins/examples/moeplug-example-router) installed with pip.

It is installed into a private ``--target`` directory (not the shared venv) and used through
PYTHONPATH in subprocesses, so nothing needs uninstalling and parallel test runs never see it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeplug.testing.example_plugin import install_example_router


@pytest.fixture(scope="module")
def example_env(tmp_path_factory):
    return install_example_router(tmp_path_factory.mktemp("site") / "example-router")


def _run(args, env):
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_moeplug_plugins_lists_the_example_router_with_its_distribution(example_env):
    out = _run([sys.executable, "-m", "moeplug", "plugins"], example_env)
    line = next(l for l in out.splitlines() if l.strip().startswith("hash "))
    assert "moeplug-example-router" in line and "available" in line


def test_example_router_is_discovered_passes_the_contract_and_routes_round_robin(example_env):
    script = """
import json, torch
from moeplug.plugin_host import PluginHost
from moeplug.testing import check_router, tiny_model_config
host = PluginHost.load()
info = next(i for i in host.infos() if i.name == "hash")
check_router(host, "hash")
out = host.create("router", "hash", {}, tiny_model_config(num_experts=4, top_k=2))(torch.randn(5, 16))
print(json.dumps({"kind": info.kind, "dist": info.dist, "ep": info.entry_point,
                  "ids": out.ids_TK.tolist(), "probs": out.probs_TK.tolist(),
                  "aux": out.aux_loss.item()}))
"""
    got = json.loads(_run([sys.executable, "-c", script], example_env).strip().splitlines()[-1])
    assert (got["kind"], got["dist"], got["ep"]) == ("router", "moeplug-example-router", "example_router")
    assert got["ids"] == [[(t + k) % 4 for k in range(2)] for t in range(5)]
    assert got["probs"] == [[0.5, 0.5]] * 5 and got["aux"] == 0.0


def test_example_router_is_invisible_without_its_path_and_blockable(example_env):
    probe = [sys.executable, "-c", "from moeplug.plugin_host import PluginHost; "
             "print(PluginHost.load().names('router'))"]
    clean = {k: v for k, v in example_env.items() if k != "PYTHONPATH"}
    assert "hash" not in _run(probe, clean)
    assert "hash" in _run(probe, example_env)
    assert "hash" not in _run(probe, {**example_env, "MOEPLUG_BLOCK_PLUGINS": "example_router"})
    assert "hash" not in _run(probe, {**example_env, "MOEPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"})


def test_moeplug_train_with_the_example_router_uses_it(example_env, run_cli, cli_env,
                                                       tiny_config_file, tmp_path):
    """`moeplug train --router hash` in a real subprocess trains with the third-party router.

    The hash router sends token t to experts (t + k) mod E with weight 1/K, so with the tiny
    config (4 experts, top-2, 8 sequences x 32 tokens = 256 tokens per micro-batch) every expert
    receives exactly 256 * 2 / 4 = 128 rows per step: perfectly flat load that the learned
    `topk` router would not produce, plus an aux loss of exactly zero.
    """
    out = str(tmp_path / "run")
    env = {**cli_env, "PYTHONPATH": example_env["PYTHONPATH"]}
    proc = run_cli("train", "--config", tiny_config_file(out), "--router", "hash",
                   "--steps", "4", "--set", "train.log_interval=1", "--set", "train.warmup_steps=1",
                   env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from moeplug.training.metrics import read_metrics
    train = [r for r in read_metrics(f"{out}/metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["plugins"]["router"] == "hash"
        assert r["aux_loss"] == 0.0
        assert r["moe"]["tokens"] == [[128, 128, 128, 128]], r["moe"]["tokens"]
    # Without the package on the path the same command is a config error naming the choices.
    missing = run_cli("train", "--config", tiny_config_file(out), "--router", "hash", timeout=120)
    assert missing.returncode == 2 and "hash" in missing.stderr and "topk" in missing.stderr
