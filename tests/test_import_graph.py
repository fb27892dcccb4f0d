"""The import graph of the moeplug package is a tree over a ground floor: config imports nothing
of moeplug outside itself, and no module imports itself back through others (no import circle).

Built from the source with ``ast`` (every import statement, inside functions and TYPE_CHECKING
blocks too: a circle that only works because an import is deferred is still a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moeplug"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    # "moeplug.parallel.comm" may name a module or (for "from pkg import name") an attribute.
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the moeplug modules it imports (a package import also runs its __init__)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                hit = _resolve(t, set(files))
                # A module's parent packages are imported before it anyway (not an edge).
                if hit and hit != mod and not mod.startswith(hit + "."):
                    edges.add(hit)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_find_cycles_sees_a_circle():
    # The detector itself: a three-module circle and a self-contained tree.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_config_is_the_ground_floor():
    # moeplug.config is a package (a module per section): its modules import one another only.
    graph = import_graph()
    config = {m for m in graph if m == "moeplug.config" or m.startswith("moeplug.config.")}
    assert len(config) > 1
    outside = {m: sorted(graph[m] - config) for m in config if graph[m] - config}
    assert outside == {}, (
        f"the config package imports {outside}: it must import nothing of moeplug outside "
        "itself, so every module can import it")


def test_hookspecs_and_plugin_host_do_not_import_each_other():
    graph = import_graph()
    assert "moeplug.plugin_host" not in graph["moeplug.hookspecs"]


# The circle ran config -> parallel -> modules -> interfaces -> config (19 files) and
# hookspecs <-> plugin_host: none of these may sit on any circle.
CORE = ("moeplug.config", "moeplug.hookspecs", "moeplug.plugin_host", "moeplug.interfaces")


def test_no_import_circle_through_the_core():
    cycles = [c for c in find_cycles(import_graph()) if set(c) & set(CORE)]
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_circle_anywhere():
    # The last circle ran modules.moe (now moe.layer) -> parallel.tensor_parallel -> parallel.experts ->
    # parallel.tensor_parallel -> modules.moe: the sharding rules now live in
    # parallel.sharding and the model-level TP step in moeplug.parallelize, one-way imports both.
    cycles = find_cycles(import_graph())
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph folded to moeplug's top level: a subpackage (moeplug.parallel, its modules
    together) or a root module (moeplug.plugin_host) per node."""
    def top(mod: str) -> str:
        return ".".join(mod.split(".")[:2])
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        out.setdefault(top(mod), set()).update(top(t) for t in targets if top(t) != top(mod))
    return out


def test_packages_import_one_way():
    # Folder-level: no two packages (or a package and a root module) reach each other, so the
    # layout reads top-down. The ties this broke: parallel.pipeline -> modules / moe (the split
    # of a built model, now moeplug.parallelize.pipeline), runtime -> parallel.communicators
    # (now runtime.communicators), plugin_host -> data.reader (a dataset's caller names the
    # interface) and data.corpus -> training.checkpoint (the CLI passes the meta it read).
    graph = import_graph()
    packages = package_graph(graph)
    assert {"moeplug.parallel", "moeplug.data", "moeplug.plugin_host"} <= set(packages)
    cycles = find_cycles(packages)
    assert cycles == [], "package circles: " + "; ".join(" -> ".join(c) for c in cycles)
    # The fold itself sees a tie between two packages' modules.
    assert find_cycles(package_graph({"moeplug.a.x": {"moeplug.b.y"}, "moeplug.b.y": set(),
                                      "moeplug.b.z": {"moeplug.a"}, "moeplug.a": set()})) \
        == [["moeplug.a", "moeplug.b"]]


def test_model_code_and_tensor_parallel_layers_import_one_way():
    graph = import_graph()
    assert "moeplug.moe.layer" not in graph["moeplug.parallel.tensor_parallel"]
    assert "moeplug.parallel.tensor_parallel" not in graph["moeplug.parallel.experts"]


def test_model_modules_do_not_import_the_parallel_code():
    # Parallelism is applied to a built model from outside (moeplug.parallelize, torchtitan's
    # parallelize.py): the model's modules build for one process, so nothing under
    # moeplug/modules imports the parallel package, the parallelize step or the builder that
    # calls it (directly, or deferred inside a function).
    graph = import_graph()
    outside = ("moeplug.parallel", "moeplug.parallelize", "moeplug.build")

    def is_outside(name: str) -> bool:
        return any(name == o or name.startswith(o + ".") for o in outside)
    modules = [m for m in graph if m == "moeplug.modules" or m.startswith("moeplug.modules.")]
    assert "moeplug.modules.attention" in modules
    hits = {m: sorted(filter(is_outside, graph[m])) for m in modules if any(map(is_outside, graph[m]))}
    assert hits == {}, f"model modules importing parallel code: {hits}"
    # The check itself sees such an import: the graph of one importing module.
    assert "moeplug.parallel.comm" in graph["moeplug.parallel.tensor_parallel"]


def test_parallelize_steps_keep_their_documented_order():
    # TP/SP -> CP -> EP/ETP -> recompute -> offload: offload marks layers TP replaces
    # (attn_proj), and CP's hooks extend TP's; the module docstring lists the same order.
    import moeplug.parallelize as par
    assert par.ORDER == ("tp", "cp", "ep", "recompute", "offload")
    doc = par.__doc__
    positions = [doc.index(f"{i}. ") for i in range(1, 6)]
    assert positions == sorted(positions)
    src = (PKG / "parallelize" / "__init__.py").read_text(encoding="utf-8")
    body = src[src.index("def parallelize_model"):]
    calls = [body.index(c) for c in ("apply_tp(", "apply_cp(", "apply_ep(", "apply_recompute(",
                                     "apply_offload(")]
    assert calls == sorted(calls), "parallelize_model must call the steps in ORDER"
