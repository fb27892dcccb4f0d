"""Declared plugin capabilities (#44 item 3): every optional attribute the core reads off a
router, dispatcher, experts backend or precision recipe is declared on its interface in
moeplug/interfaces.py, typed and documented; the core reads them as attributes, never probes
with getattr/hasattr; the public contract tests (moeplug.testing.check_declared, run by every
check_*) catch a misspelt or mistyped one.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from moeplug import interfaces
from moeplug.testing import ContractError, check_declared, check_experts, check_router
from moeplug.testing.capabilities import declared

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASES = (interfaces.Router, interfaces.Dispatcher, interfaces.Experts, interfaces.Precision)
CAPABILITIES = {name for base in BASES for name in declared(base)}


def test_each_interface_declares_its_capabilities_with_a_type_and_a_doc():
    source = (ROOT / "moeplug" / "interfaces.py").read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    for base in BASES:
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == base.__name__)
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                name = node.target.id
                comment = lines[node.lineno - 2].strip()
                assert comment.startswith("#:"), f"{base.__name__}.{name}: no '#:' doc above it"
    assert {"accepts_num_sequences", "accepts_token_group", "accepts_batch_group",
            "quantizes_dispatch", "overlaps_comm", "can_recompute_activation",
            "delay_wgrad_compute", "budget_rows", "capturable", "packed_rows",
            "compute_dtype", "row_alignment"} <= CAPABILITIES


def _probes(path: pathlib.Path) -> list[str]:
    """getattr(x, "name", ...) / hasattr(x, "name") of a declared capability name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in CAPABILITIES | {"call_offloaded", "group"}):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id} "
                         f"{node.args[1].value}")
    return found


def test_the_core_reads_capabilities_as_declared_attributes_never_by_probing():
    probes = [p for f in sorted((ROOT / "moeplug").rglob("*.py"))
              if f.name != "capabilities.py" for p in _probes(f)]
    assert probes == []


class _Misspelt(interfaces.Router):
    accept_token_group = True  # the core reads accepts_token_group

    def __init__(self, model, options=None):
        super().__init__()
        self.num_experts, self.top_k = model.moe.num_experts, model.moe.top_k
        self.weight = torch.nn.Parameter(torch.randn(self.num_experts, model.hidden_size))

    def forward(self, x_TD):
        probs_TK, ids_TK = torch.softmax(x_TD @ self.weight.t(), -1).topk(self.top_k, -1)
        return interfaces.RouterOutput(probs_TK, ids_TK, torch.zeros(()))


def test_a_misspelt_capability_fails_the_contract_naming_the_declared_one():
    with pytest.raises(ContractError, match=r"router '_Misspelt': declares accept_token_group "
                                            r"= True, which the core never reads; .* declares "
                                            r"accepts_token_group\. Fix: rename it"):
        check_router(_Misspelt, "_Misspelt")


def test_a_mistyped_capability_fails_the_contract():
    from moeplug_plugins.experts.grouped import GroupedExperts

    class Yes(GroupedExperts):
        budget_rows = "yes"

    def make(model, options, num_local_experts):
        return Yes(model, num_local_experts)
    with pytest.raises(ContractError, match=r"budget_rows = 'yes': declared as a bool on "
                                            r"moeplug\.interfaces\.Experts\. Fix: set "
                                            r"budget_rows = True or False"):
        check_experts(make, "yes")


def test_check_declared_passes_the_interfaces_defaults():
    class Plain(interfaces.Precision):
        name = "plain"
    check_declared(Plain(), interfaces.Precision, "precision 'plain'")


def test_every_declared_capability_is_in_the_plugin_guide():
    """docs/plugins.md 'Declared capabilities' names every optional attribute an interface
    declares (those with a default: num_experts and the like are each kind's contract): a new
    capability a plugin author must know fails here until it is documented."""
    from pathlib import Path

    from moeplug import interfaces
    from moeplug.testing.capabilities import declared

    guide = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text("utf-8")
    section = guide[guide.index("## Declared capabilities"):]
    bases = (interfaces.Router, interfaces.Dispatcher, interfaces.Experts,
             interfaces.Precision, interfaces.PluginOptions)
    names = {n for base in bases for n in declared(base) if hasattr(base, n)}
    assert {"budget_rows", "packed_rows", "capturable", "training_only"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in section)
    assert not missing, f"docs/plugins.md 'Declared capabilities' does not name {missing}"
