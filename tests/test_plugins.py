"""The plugin host: discovery, errors, blocking, autoload, availability, options, hookspecs.

Third-party plugins here are real: either plugin objects registered through ``extra_plugins``, or
real distributions (a ``*.dist-info`` with ``entry_points.txt`` written to a directory put on
sys.path), found by importlib.metadata exactly like an installed package.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pluggy
import pytest
import torch

import moeplug
from moeplug import hookspecs
from moeplug.config import ConfigError
from moeplug.interfaces import Router, RouterOutput
from moeplug.plugin_host import _FACTORY_ARGS, PluginError, PluginHost
from moeplug.testing import tiny_model_config

BUILTINS = {
    ("router", "topk"): "builtin_routers",
    ("dispatcher", "alltoall"): "builtin_dispatchers",
    ("dispatcher", "allgather"): "builtin_dispatchers",
    ("dispatcher", "hierarchical"): "builtin_dispatchers",
    ("dispatcher", "direct_write"): "builtin_dispatchers",
    ("dispatcher", "deepep"): "builtin_dispatchers",
    ("experts", "sequential"): "builtin_experts",
    ("experts", "grouped"): "builtin_experts",
    ("precision", "fp32"): "builtin_precisions",
    ("precision", "bf16"): "builtin_precisions",
    ("precision", "te_fp8"): "builtin_precisions",
    **{("precision", n): "builtin_precisions"
       for n in ("fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4")},
    **{("dataset", n): "builtin_datasets"
       for n in ("shakespeare", "txt", "jsonl", "parquet", "hf_disk", "megatron")},
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # The host reads these; a value exported in the developer's shell must not leak into tests.
    monkeypatch.delenv("MOEPLUG_BLOCK_PLUGINS", raising=False)
    monkeypatch.delenv("MOEPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)


def _plugin(**hooks) -> types.SimpleNamespace:
    """A plugin object whose attributes are @hookimpl functions."""
    return types.SimpleNamespace(__name__=f"test_plugin_{uuid.uuid4().hex[:6]}",
                                 **{name: moeplug.hookimpl(fn) for name, fn in hooks.items()})


class _ConstRouter(Router):
    def __init__(self, model, options):
        super().__init__()
        self.num_experts, self.top_k = model.moe.num_experts, model.moe.top_k
        self.options = options

    def forward(self, x_TD):
        T = x_TD.shape[0]
        ids_TK = torch.arange(self.top_k).expand(T, -1)
        return RouterOutput(torch.full((T, self.top_k), 1.0 / self.top_k), ids_TK, torch.zeros(()))


def _router_plugin(name: str, options_cls=None, requires=()) -> types.SimpleNamespace:
    def moeplug_register_routers(registry):
        registry.add(name, _ConstRouter, options_cls=options_cls, requires=requires,
                     description=f"test router {name}")
    return _plugin(moeplug_register_routers=moeplug_register_routers)


def _write_dist(root, dist: str, ep_name: str, module_source: str) -> str:
    """A real installed distribution under ``root``: module + dist-info with one moeplug entry point."""
    module = f"moeplug_testdist_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[moeplug]\n{ep_name} = {module}\n")
    return module


GOOD_DIST_SOURCE = """
    from moeplug import hookimpl

    @hookimpl
    def moeplug_register_precisions(registry):
        from moeplug_plugins.precision import make_fp32
        registry.add("fp32_from_testdist", make_fp32, description="fp32 again")
"""


# ---- discovery ----------------------------------------------------------------------------

def test_discovers_every_builtin_through_moeplug_entry_points():
    infos = {(i.kind, i.name): i for i in PluginHost.load().infos()}
    for (kind, name), ep in BUILTINS.items():
        info = infos[(kind, name)]
        assert (info.dist, info.entry_point) == ("moeplug", ep), info
        assert info.description
    gpu_only = {("precision", "te_fp8"), ("dispatcher", "deepep")}
    assert not any(infos[k].available for k in gpu_only)  # no transformer_engine, deep_ep here
    assert all(infos[k].available for k in BUILTINS if k not in gpu_only)


def test_core_does_not_import_builtin_plugins_directly():
    # The core finds built-ins like any plugin: no moeplug module names moeplug_plugins.
    import pathlib
    core = pathlib.Path(moeplug.__file__).parent
    offenders = [str(p.relative_to(core)) for p in core.rglob("*.py")
                 if "import moeplug_plugins" in p.read_text() or "from moeplug_plugins" in p.read_text()]
    assert offenders == []


def test_hookimpl_is_exported_from_moeplug_and_pluginerror_is_a_configerror():
    assert moeplug.hookimpl is hookspecs.hookimpl
    assert moeplug.hookimpl.project_name == "moeplug"
    assert issubclass(PluginError, ConfigError)


def test_a_real_installed_distribution_is_discovered_with_its_name(tmp_path, monkeypatch):
    _write_dist(tmp_path, "moeplug-testdist-good", "good_ep", GOOD_DIST_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost.load()
    info = next(i for i in host.infos() if i.name == "fp32_from_testdist")
    assert (info.kind, info.dist, info.entry_point, info.available) == (
        "precision", "moeplug-testdist-good", "good_ep", True)
    assert host.create("precision", "fp32_from_testdist", {}).compute_dtype == torch.float32


# ---- unknown / duplicate / import errors ----------------------------------------------------

def test_unknown_name_lists_available_and_unavailable_names():
    host = PluginHost.load()
    with pytest.raises(PluginError) as err:
        host.create("precision", "fp16", {})
    msg = str(err.value)
    assert "unknown precision 'fp16'" in msg
    assert "bf16, fp32" in msg                          # available ones
    assert "te_fp8 (needs module 'transformer_engine'" in msg  # unavailable ones, with the reason
    assert "Fix:" in msg


def test_unknown_name_suggests_the_closest_and_unknown_kind_is_an_error():
    host = PluginHost.load()
    with pytest.raises(PluginError, match=r"unknown router 'topkk'.*Available routers: topk.*"
                                          r"did you mean 'topk'"):
        host.create("router", "topkk", {}, tiny_model_config())
    with pytest.raises(PluginError, match=r"unknown plugin kind 'routers'.*Fix: use one of router, "):
        host.create("routers", "topk", {})


def test_duplicate_name_names_both_distributions():
    with pytest.raises(PluginError) as err:
        PluginHost.load(extra_plugins=[(_router_plugin("dup"), "dist-one"),
                                       (_router_plugin("dup"), "dist-two")])
    msg = str(err.value)
    assert "router 'dup' is registered twice" in msg
    assert "'dist-one'" in msg and "'dist-two'" in msg
    assert "MOEPLUG_BLOCK_PLUGINS=" in msg  # the fix


def test_duplicate_of_a_builtin_names_moeplug_and_the_newcomer():
    with pytest.raises(PluginError, match=r"router 'topk' is registered twice: by entry point "
                                          r"'builtin_routers' of distribution 'moeplug' and by .*"
                                          r"'shadowing-dist'"):
        PluginHost.load(extra_plugins=[(_router_plugin("topk"), "shadowing-dist")])
    # the fix names the newcomer: uninstalling moeplug or blocking its built-ins was the advice
    with pytest.raises(PluginError) as err:
        PluginHost.load(extra_plugins=[(_router_plugin("topk"), "shadowing-dist")])
    assert "Fix: rename the router in 'shadowing-dist' (moeplug's built-in names are taken)" \
        in str(err.value) and "builtin_routers" not in str(err.value).split("Fix:")[1]


def test_import_error_in_a_plugin_module_is_reported_against_it(tmp_path, monkeypatch):
    _write_dist(tmp_path, "moeplug-testdist-broken", "broken_ep",
                "import moeplug_dependency_that_does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as err:
        PluginHost.load()
    msg = str(err.value)
    assert "entry point 'broken_ep' of distribution 'moeplug-testdist-broken'" in msg
    assert "ModuleNotFoundError" in msg and "moeplug_dependency_that_does_not_exist_xyz" in msg
    assert "MOEPLUG_BLOCK_PLUGINS=broken_ep" in msg
    assert isinstance(err.value.__cause__, ImportError)


def test_misspelled_hook_fails_check_pending_naming_the_plugin():
    def moeplug_register_router(registry):  # missing the 's'
        pass
    plugin = _plugin(moeplug_register_router=moeplug_register_router)
    with pytest.raises(PluginError, match=r"plugin entry point 'test_plugin_\w+' of distribution "
                                          r"'typo-dist'.*moeplug_register_router.*Fix: rename"):
        PluginHost.load(extra_plugins=[(plugin, "typo-dist")])


def test_hook_with_wrong_argument_names_is_rejected_at_register():
    def moeplug_register_routers(reg):  # spec says `registry`
        pass
    with pytest.raises(PluginError, match=r"'badargs-dist'.*Fix: give the hook function the argument "
                                          r"names of its spec"):
        PluginHost.load(extra_plugins=[(_plugin(moeplug_register_routers=moeplug_register_routers),
                                        "badargs-dist")])


@pytest.mark.parametrize("name, factory, options_cls, fix", [
    ("bad name!", _ConstRouter, None, "rename it"),
    ("ok", "not callable", None, "pass the class or function"),
    ("ok", _ConstRouter, dict, "decorate it with @dataclasses.dataclass"),
])
def test_registry_add_rejects_bad_registrations(name, factory, options_cls, fix):
    def moeplug_register_routers(registry):
        registry.add(name, factory, options_cls=options_cls)
    with pytest.raises(PluginError, match=r"'reg-dist'") as err:
        PluginHost.load(extra_plugins=[(_plugin(moeplug_register_routers=moeplug_register_routers),
                                        "reg-dist")])
    assert fix in str(err.value)


def test_factory_returning_the_wrong_type_is_an_error():
    def moeplug_register_routers(registry):
        registry.add("notarouter", lambda model, options: object())
    host = PluginHost.load(extra_plugins=[(_plugin(moeplug_register_routers=moeplug_register_routers),
                                           "wrong-dist")])
    with pytest.raises(PluginError, match=r"router 'notarouter' .*'wrong-dist'.*returned object, not a "
                                          r"moeplug.interfaces.Router. Fix: subclass"):
        host.create("router", "notarouter", {}, tiny_model_config())


def test_create_checks_the_number_of_factory_arguments():
    with pytest.raises(TypeError, match=r"takes 2 argument\(s\) after options \(model_cfg, group\), got 1"):
        PluginHost.load().create("dispatcher", "alltoall", {}, tiny_model_config())


# ---- blocking and autoload ------------------------------------------------------------------

def test_block_argument_blocks_a_component_and_says_by_what():
    host = PluginHost.load(block=["topk"])
    info = next(i for i in host.infos() if i.name == "topk")
    assert not info.available and "blocked by plugins.block" in info.reason
    with pytest.raises(PluginError, match=r"router 'topk' .*is unavailable: blocked by plugins.block "
                                          r"\('topk'\). Fix: remove 'topk' from plugins.block"):
        host.create("router", "topk", {}, tiny_model_config())
    # Other kinds are untouched.
    assert host.create("precision", "fp32", {}).name == "fp32"


def test_env_var_blocks_a_qualified_name(monkeypatch):
    monkeypatch.setenv("MOEPLUG_BLOCK_PLUGINS", "experts:grouped, unrelated")
    host = PluginHost.load()
    assert host.names("experts") == ["sequential"]
    with pytest.raises(PluginError, match=r"blocked by \$MOEPLUG_BLOCK_PLUGINS \('experts:grouped'\)\. "
                                          r"Fix: remove 'experts:grouped' from \$MOEPLUG_BLOCK_PLUGINS"):
        host.create("experts", "grouped", {}, tiny_model_config(), 2)


def test_blocking_an_entry_point_skips_importing_it(tmp_path, monkeypatch):
    # The module raises on import: loading succeeds only if the blocked entry point is not imported.
    _write_dist(tmp_path, "moeplug-testdist-blocked", "explosive_ep", "raise ImportError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MOEPLUG_BLOCK_PLUGINS", "explosive_ep")
    host = PluginHost.load(block=["builtin_precisions"])
    skipped = {s.entry_point: s for s in host.skipped}
    assert "blocked by $MOEPLUG_BLOCK_PLUGINS" in skipped["explosive_ep"].reason
    assert skipped["explosive_ep"].dist == "moeplug-testdist-blocked"
    assert "blocked by plugins.block" in skipped["builtin_precisions"].reason
    assert host.names("precision") == []
    with pytest.raises(PluginError, match=r"unknown precision 'fp32'.*entry points not loaded: "
                                          r".*builtin_precisions from 'moeplug' \(blocked by plugins.block"):
        host.create("precision", "fp32", {})


def test_block_also_skips_an_extra_plugin_by_its_name():
    plugin = _router_plugin("extra")
    host = PluginHost.load(block=[plugin.__name__], extra_plugins=[(plugin, "extra-dist")])
    assert "extra" not in host.names("router")


def test_disable_autoload_env_loads_only_moeplugs_own_entry_points(tmp_path, monkeypatch):
    _write_dist(tmp_path, "moeplug-testdist-auto", "auto_ep", GOOD_DIST_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "fp32_from_testdist" in PluginHost.load().names("precision")
    monkeypatch.setenv("MOEPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    host = PluginHost.load()
    assert "fp32_from_testdist" not in host.names("precision")
    assert {i.name for i in host.infos()} == {name for _, name in BUILTINS}
    skipped = {s.entry_point: s.reason for s in host.skipped}
    assert "MOEPLUG_DISABLE_PLUGIN_AUTOLOAD" in skipped["auto_ep"]


# ---- availability ---------------------------------------------------------------------------

def test_missing_optional_module_lists_plugin_unavailable_with_install_hint():
    host = PluginHost.load()
    info = next(i for i in host.infos() if i.name == "te_fp8")
    assert not info.available
    assert "transformer_engine" in info.reason and "pip install transformer-engine" in info.reason
    with pytest.raises(PluginError, match=r"precision 'te_fp8' .*is unavailable: needs module "
                                          r"'transformer_engine'.*Fix: install what it needs, or choose "
                                          r"one of: bf16, fp32"):
        host.create("precision", "te_fp8", {})


@pytest.mark.parametrize("module", ["moeplug_missing_mod_xyz", "moeplug_missing_pkg_xyz.sub"])
def test_requires_checks_modules_without_importing_them(module):
    host = PluginHost.load(extra_plugins=[(_router_plugin("needy", requires=(module,)), "needy-dist")])
    info = next(i for i in host.infos() if i.name == "needy")
    assert (info.available, info.dist) == (False, "needy-dist")
    assert f"needs module '{module}'" in info.reason
    assert f"pip install {module.split('.')[0].replace('_', '-')}" in info.reason
    assert "needy" not in host.names("router") and "needy" in host.names("router", available_only=False)
    with pytest.raises(PluginError, match=rf"router 'needy' .*unavailable: needs module '{module}'"):
        host.create("router", "needy", {}, tiny_model_config())


def test_unavailable_reason_lists_plugin_unavailable_and_create_names_it():
    # An OS feature or runtime build missing (not a module): the plugin states the reason.
    def moeplug_register_routers(registry):
        registry.add("shm_only", _ConstRouter, unavailable="needs Linux POSIX shared memory")
    plugin = _plugin(moeplug_register_routers=moeplug_register_routers)
    host = PluginHost.load(extra_plugins=[(plugin, "shm-dist")])
    info = next(i for i in host.infos() if i.name == "shm_only")
    assert (info.available, info.reason) == (False, "needs Linux POSIX shared memory")
    with pytest.raises(PluginError, match=r"router 'shm_only' .*unavailable: needs Linux POSIX"):
        host.create("router", "shm_only", {}, tiny_model_config())


def test_requires_satisfied_is_available():
    host = PluginHost.load(extra_plugins=[(_router_plugin("fine", requires=("json",)), "fine-dist")])
    assert isinstance(host.create("router", "fine", {}, tiny_model_config()), _ConstRouter)


# ---- options --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Opts:
    mode: Literal["fast", "exact"] = "exact"
    scale: float = 1.0
    limit: int = 4
    tag: str | None = None
    sizes: list[int] | None = None
    pair: tuple[int, float] = (1, 0.5)

    def __post_init__(self):
        if self.limit < 1:
            raise ConfigError(f"limit = {self.limit}: must be >= 1. Fix: set limit to 1 or more")


@dataclass(frozen=True)
class _RequiredOpts:
    seed: int


def _opts_host():
    return PluginHost.load(extra_plugins=[(_router_plugin("opt", options_cls=_Opts), "opt-dist"),
                                          (_router_plugin("req", options_cls=_RequiredOpts), "req-dist")])


def test_options_are_validated_and_passed_to_the_factory():
    host = _opts_host()
    router = host.create("router", "opt", {"mode": "fast", "scale": 2, "tag": "x"}, tiny_model_config())
    assert router.options == _Opts(mode="fast", scale=2, limit=4, tag="x")
    # as YAML writes them: 1e-3 read as a string (YAML 1.1), a list for a tuple
    router = host.create("router", "opt", {"scale": "1e-3", "sizes": [1, 2],
                                           "pair": [3, "2e-1"]}, tiny_model_config())
    assert router.options == _Opts(scale=1e-3, sizes=[1, 2], pair=(3, 0.2))
    assert host.create("router", "opt", None, tiny_model_config()).options == _Opts()
    assert host.create("router", "req", {"seed": 3}, tiny_model_config()).options == _RequiredOpts(3)


@pytest.mark.parametrize("options, pattern", [
    ({"scael": 2.0}, r"router 'opt' \(from opt-dist\): unknown option plugins.router_options.scael = "
                     r"2.0. Fix: did you mean 'scale'\?"),
    ({"zzz": 1}, r"unknown option plugins.router_options.zzz = 1. "
                 r"Fix: valid options: mode, scale, limit, tag"),
    ({"limit": "4"}, r"option plugins.router_options.limit = '4' \(str\) must be int. Fix: set limit to int"),
    ({"limit": True}, r"option plugins.router_options.limit = True \(bool\) must be int"),
    ({"scale": "big"}, r"option plugins.router_options.scale = 'big' \(str\) must be float"),
    ({"mode": "slow"}, r"plugins.router_options.mode = 'slow' \(str\) must be one of 'fast', 'exact'"),
    ({"tag": 3}, r"plugins.router_options.tag = 3 \(int\) must be str or None"),
    # list elements are checked too (a sweep got ['a', 2.5, None] through)
    ({"sizes": ["a", 2.5, None]}, r"plugins.router_options.sizes = \['a', 2.5, None\] \(list\) "
                                  r"must be a list of int \(an element is 'a'\) or None"),
    ({"pair": [1]}, r"plugins.router_options.pair = \(1,\) \(tuple\) must be a tuple of 2 values"),
    ({"limit": 0}, r"router 'opt' \(from opt-dist\): invalid plugins.router_options = \{'limit': 0\}: "
                   r"limit = 0: must be >= 1. Fix: set limit to 1 or more"),
    ([1, 2], r"plugins.router_options = \[1, 2\] is not a mapping. Fix: write plugins.router_options:"),
])
def test_bad_options_name_plugin_field_value_and_fix(options, pattern):
    with pytest.raises(PluginError, match=pattern):
        _opts_host().create("router", "opt", options, tiny_model_config())


def test_missing_required_option_and_options_for_a_plugin_without_options():
    host = _opts_host()
    with pytest.raises(PluginError, match=r"router 'req' \(from req-dist\): option "
                                          r"plugins.router_options.seed is required. Fix: set"):
        host.create("router", "req", {}, tiny_model_config())
    with pytest.raises(PluginError, match=r"dispatcher 'alltoall' \(from moeplug\) takes no options, got "
                                          r"plugins.dispatcher_options = \{'x': 1\}. Fix: remove "
                                          r"plugins.dispatcher_options"):
        host.create("dispatcher", "alltoall", {"x": 1}, tiny_model_config(), None)


def test_builtin_topk_options_are_validated():
    host = PluginHost.load()
    with pytest.raises(PluginError, match=r"router 'topk' \(from moeplug\): option "
                                          r"plugins.router_options.renormalize = 'yes' \(str\) must be bool"):
        host.create("router", "topk", {"renormalize": "yes"}, tiny_model_config())


# ---- hookspec meta-tests --------------------------------------------------------------------

def _hookspec_functions():
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if name.startswith("moeplug_")}


def test_every_hookspec_is_documented_typed_and_explicit():
    specs = _hookspec_functions()
    assert set(specs) == set(hookspecs.REGISTER_HOOKS.values())
    for name, fn in specs.items():
        doc = inspect.getdoc(fn) or ""
        assert "Called" in doc and "Return" in doc, f"{name}: say when it is called and what it returns"
        opts = getattr(fn, "moeplug_spec")
        assert opts["firstresult"] is False and opts["historic"] is False
        sig = inspect.signature(fn)
        assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values()), name


def _readme_plugin_guide() -> str:
    return (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text(encoding="utf-8")


def test_every_hookspec_and_factory_call_is_in_the_readme_plugin_guide():
    """The plugin guide (docs/plugins.md) names every hook and calls each factory with the arguments
    PluginHost.create passes (plugin_host._FACTORY_ARGS), and so does each hookspec's docstring:
    adding a hook or changing a factory's arguments without documenting it fails here."""
    guide = _readme_plugin_guide()
    missing = [name for name in _hookspec_functions() if f"`{name}`" not in guide]
    assert not missing, f"docs/plugins.md does not name hooks: {missing}"
    for kind, hook in hookspecs.REGISTER_HOOKS.items():
        call_args = ", ".join([*_FACTORY_ARGS[kind][:1], "options", *_FACTORY_ARGS[kind][1:]])
        assert f"`{kind}({call_args})`" in guide, \
            f"docs/plugins.md lacks the {kind} factory call `{kind}({call_args})`"
        doc = inspect.getdoc(getattr(hookspecs, hook))
        assert f"factory({call_args})" in doc.replace("\n", " "), \
            f"{hook} docstring lacks `factory({call_args})`"


def test_every_hookspec_is_called_once_per_plugin_with_a_registry():
    calls = []

    def make(name):
        def impl(registry):
            calls.append((name, registry.kind))
        impl.__name__ = name
        return impl
    plugin = _plugin(**{name: make(name) for name in _hookspec_functions()})
    PluginHost.load(autoload=False, extra_plugins=[(plugin, "recording-dist")])
    assert sorted(calls) == sorted((hook, kind) for kind, hook in hookspecs.REGISTER_HOOKS.items())


def test_host_uses_a_pluggy_manager_for_project_moeplug():
    host = PluginHost.load()
    assert isinstance(host.pm, pluggy.PluginManager) and host.pm.project_name == "moeplug"
    names = {n for n, _ in host.pm.list_name_plugin()}
    assert {"moeplug:builtin_routers", "moeplug:builtin_experts"} <= names


def test_infos_are_frozen_records():
    info = PluginHost.load().infos()[0]
    assert dataclasses.is_dataclass(info)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "other"


class _ScaledRouter(_ConstRouter):
    """A router with a [1, E] parameter it initialises itself (to ones)."""

    def __init__(self, model, options):
        super().__init__(model, options)
        self.expert_scale = torch.nn.Parameter(torch.empty(1, model.moe.num_experts))

    def reset_parameters(self):
        torch.nn.init.ones_(self.expert_scale)


class _UnscaledRouter(_ConstRouter):
    def __init__(self, model, options):
        super().__init__(model, options)
        self.expert_scale = torch.nn.Parameter(torch.ones(1, model.moe.num_experts))


@pytest.mark.parametrize("cls, kept", [(_ScaledRouter, True), (_UnscaledRouter, False)])
def test_a_plugin_that_defines_reset_parameters_initialises_its_own(cls, kept):
    # moeplug draws every matrix from normal(0, init_std); a plugin's own [1, E] scale went
    # that way silently. PyTorch's convention now lets it keep its own initialisation.
    from moeplug.config import config_from_dict
    from moeplug.build import build_model

    def moeplug_register_routers(registry):
        registry.add("scaled", cls)
    host = PluginHost.load(extra_plugins=[(_plugin(moeplug_register_routers=
                                                   moeplug_register_routers), "scaled-dist")])
    cfg = config_from_dict({"plugins": {"router": "scaled"},
                            "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2,
                                      "num_kv_heads": 1, "first_k_dense": 0,
                                      "moe": {"num_experts": 4, "top_k": 2,
                                              "ffn_hidden_size": 8}}})
    model = build_model(cfg, host, 32)
    scale = next(p for n, p in model.named_parameters() if n.endswith("expert_scale"))
    assert torch.equal(scale, torch.ones_like(scale)) == kept
    # the model's own matrices are drawn as before either way
    assert float(model.embed.weight.std()) == pytest.approx(cfg.model.init_std, rel=0.2)


def _refusing_router(model, options):
    raise ValueError("mode 'remote' needs EP > 1. Fix: use mode local")


@pytest.mark.parametrize("factory, pattern", [
    (_refusing_router, r"router 'made' \(from made-dist\): mode 'remote' needs EP > 1. Fix: "),
    (lambda: None, r"router 'made' \(from made-dist\): its factory cannot be called as "
                   r"router\(model_cfg, options\) .*Fix: give the factory that signature"),
])
def test_a_factory_refusing_or_miscalled_is_one_plugin_error(factory, pattern):
    # both were tracebacks from `moeplug train`; a TypeError raised inside a factory (a bug in
    # it) keeps its traceback
    def moeplug_register_routers(registry):
        registry.add("made", factory)
    host = PluginHost.load(extra_plugins=[(_plugin(moeplug_register_routers=
                                                   moeplug_register_routers), "made-dist")])
    with pytest.raises(PluginError, match=pattern):
        host.create("router", "made", {}, tiny_model_config())


def test_a_type_error_inside_a_factory_keeps_its_traceback():
    def buggy(model, options):
        return len(5)  # TypeError inside the factory

    def moeplug_register_routers(registry):
        registry.add("buggy", buggy)
    host = PluginHost.load(extra_plugins=[(_plugin(moeplug_register_routers=
                                                   moeplug_register_routers), "buggy-dist")])
    with pytest.raises(TypeError, match="has no len"):
        host.create("router", "buggy", {}, tiny_model_config())


def test_a_hook_function_without_hookimpl_is_an_error():
    # pluggy registers only marked functions: an unmarked one registered nothing, silently
    def moeplug_register_routers(registry):
        registry.add("never", _ConstRouter)
    plugin = types.SimpleNamespace(__name__="unmarked_plugin",
                                   moeplug_register_routers=moeplug_register_routers)
    with pytest.raises(PluginError, match=r"moeplug_register_routers is not marked @hookimpl, "
                                          r"so it would register nothing. Fix: decorate it"):
        PluginHost.load(extra_plugins=[(plugin, "unmarked-dist")])


def test_a_block_token_that_matches_nothing_is_noted(caplog):
    # a typo in plugins.block or $MOEPLUG_BLOCK_PLUGINS blocked nothing, silently
    token = f"allgathr_{uuid.uuid4().hex[:4]}"
    with caplog.at_level("WARNING", logger="moeplug.plugin_host"):
        PluginHost.load(block=[token, "dispatcher:allgather"])
    notes = [r.getMessage() for r in caplog.records if "blocks nothing" in r.getMessage()]
    assert len(notes) == 1 and f"plugins.block names '{token}'" in notes[0], notes
