"""Install a third-party plugin package into a private directory, for tests: the example
router and reader (plugins/examples) or the test-only packages under tests/thirdparty.

The package is installed with ``pip install --target`` (no deps, no build isolation) instead of
into the shared venv, so it is visible only to processes whose PYTHONPATH includes that
directory: other tests running at the same time never see an extra router.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "plugins" / "examples"
EXAMPLE_ROUTER_DIR = EXAMPLES_DIR / "moeplug-example-router"


def install_example_router(target_dir: str | os.PathLike) -> dict[str, str]:
    """pip-install moeplug-example-router into ``target_dir``; return an env for subprocesses."""
    return install_plugin_package(EXAMPLE_ROUTER_DIR, target_dir)


def install_plugin_package(package_dir: str | os.PathLike,
                           target_dir: str | os.PathLike) -> dict[str, str]:
    """pip-install the plugin package at ``package_dir`` into ``target_dir``; return an env for
    subprocesses (PYTHONPATH starting with ``target_dir``)."""
    package_dir = Path(package_dir)
    if not (package_dir / "pyproject.toml").is_file():
        raise FileNotFoundError(f"plugin package not found at {package_dir}. Fix: run from a "
                                f"moeplug source checkout (pip install -e .)")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = Path(target_dir).with_name(Path(target_dir).name + "-src")
    shutil.copytree(package_dir, source, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--no-index", "--target", str(target_dir), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"installing the plugin package failed ({' '.join(cmd)}):\n{done.stderr}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target_dir), env.get("PYTHONPATH", "")) if p)
    return env
