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
