"""The declared plugin API (moeplug.api) is all the plugins under plugins/ use of moeplug.

Built from the source with ``ast``, like tests/test_import_graph.py: every import statement of
every file under plugins/ (inside functions too), and every string that names the compiled
extension (an ``importlib.import_module("moeplug._runtime_core")`` is an import too).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import moeplug.api as api

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
# What a plugin may import of moeplug: the API, and the public contract tests.
ALLOWED = ("moeplug.api", "moeplug.testing")
EXTENSIONS = ("moeplug._runtime_core", "moeplug._runtime_cuda")


def _allowed(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ALLOWED)


def violations(source: str, filename: str) -> list[str]:
    """``file:line: what`` for each import of moeplug outside the API and each mention of the
    compiled extension in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        bad: list[str] = []
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] == "moeplug"
                   and not _allowed(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "moeplug":  # `from moeplug import api` is the API; others are not
                bad = [f"moeplug.{a.name}" for a in node.names if not _allowed(f"moeplug.{a.name}")]
            elif node.module.split(".")[0] == "moeplug" and not _allowed(node.module):
                bad = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            bad = [f"the extension {e} (load it through moeplug.api.get_runtime)"
                   for e in EXTENSIONS if e in node.value]
        out += [f"{filename}:{node.lineno}: imports {b}" for b in bad]
    return out


def test_the_checker_sees_each_kind_of_violation():
    src = ("from moeplug import hookimpl\n"
           "import moeplug.config\n"
           "def f():\n"
           "    from moeplug.parallel import comm\n"
           "    return importlib.import_module('moeplug._runtime_core')\n"
           "from moeplug.api import hookimpl, comm\n"
           "from moeplug import api\n"
           "from moeplug.testing import check_router\n"
           "from moeplug_plugins.dispatchers import x\n")
    found = violations(src, "p.py")
    assert [v.split(": imports ")[0] for v in found] == ["p.py:1", "p.py:2", "p.py:4", "p.py:5"]
    assert "moeplug.hookimpl" in found[0] and "moeplug.parallel" in found[2]
    assert "moeplug._runtime_core" in found[3]


def test_plugins_import_only_the_public_api():
    # the built-in plugins, the examples, and the third-party package the mode tests install
    files = sorted([*PLUGINS.rglob("*.py"), *(ROOT / "tests" / "thirdparty").rglob("*.py")])
    assert len(files) > 20 and any("moeplug_tally" in str(p) for p in files)
    found = [v for p in files
             for v in violations(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert found == [], ("plugins may import moeplug only through moeplug.api (or moeplug."
                         "testing); add what they need to moeplug/api.py and docs/plugins.md:\n"
                         + "\n".join(found))


def test_every_exported_name_resolves_to_what_it_names():
    for name in api.__all__:
        module, attr = api._EXPORTS[name]
        target = importlib.import_module(module)
        assert getattr(api, name) is (target if attr is None else getattr(target, attr)), name
    assert len(set(api.__all__)) == len(api.__all__)


def test_the_api_refuses_a_name_it_does_not_export():
    try:
        api.ParallelGroups
    except AttributeError as exc:
        assert "not part of the plugin API" in str(exc)
    else:
        raise AssertionError("moeplug.api handed out a name outside __all__")


def test_the_plugins_use_every_exported_name_or_it_is_for_authors():
    # The API is what plugins need, not a second copy of moeplug: each name is used by a plugin
    # under plugins/, or is one of the authoring names the guide shows.
    # quant_linear: what a backend with its own GEMMs runs them through under a recipe
    # (tests/thirdparty/moeplug-tally; the built-ins use quant_expert_mlp).
    authoring = {"PluginHost", "quant_linear"}
    used: set[str] = set()
    for p in PLUGINS.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "moeplug.api":
                used |= {a.name for a in node.names}
    assert set(api.__all__) - used - authoring == set()


def test_the_guide_lists_every_exported_name_once():
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = guide.split("## The plugin API (`moeplug.api`)")[1].split("\n## ")[0]
    listed = [line.split("`")[1] for line in section.splitlines() if line.startswith("- `")]
    assert sorted(listed) == sorted(api.__all__), (
        f"docs/plugins.md 'The plugin API' lists {sorted(set(listed) - set(api.__all__))} "
        f"not exported, lacks {sorted(set(api.__all__) - set(listed))}")
