"""Every pluggy hook moeplug calls, in one module (project name ``moeplug``, prefix ``moeplug_``).

A plugin is a module (or any object) with functions marked ``@hookimpl`` whose names match the
specs below; it is found through the ``moeplug`` entry-point group, e.g. in its pyproject.toml::

    [project.entry-points.moeplug]
    my_routers = "my_package.routers"

and ``my_package/routers.py`` holds::

    from moeplug import hookimpl

    @hookimpl
    def moeplug_register_routers(registry):
        registry.add("hash", make_hash_router, description="round-robin routing")

Phase: load. ``PluginHost.load`` imports every entry point, registers it, calls
``check_pending()`` (a misspelled hook name is an error, not a silent no-op), then calls each
register hook once per plugin, so it knows which distribution added which component.

What the factories receive is documented at the bottom of :mod:`moeplug.interfaces`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

import pluggy

PROJECT_NAME = "moeplug"
ENTRY_POINT_GROUP = "moeplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class ComponentRegistry(Protocol):
    """What a register hook receives: moeplug.plugin_host.ComponentRegistry implements it.
    Declared here as a contract so the specs import nothing of the host (no import circle)."""

    kind: str

    def add(self, name: str, factory: Callable[..., Any], options_cls: type | None = None,
            requires: Iterable[str] = (), description: str = "",
            install_hint: str = "", unavailable: str = "") -> None: ...


# --------------------------------------------------------------------------------------------
# Load phase: each hook is called once per plugin when the host loads, with a registry for one
# component kind. Every implementation is called (not firstresult); the calls are not replayed
# for plugins registered later (not historic), because the registry is complete after load.
# --------------------------------------------------------------------------------------------

@hookspec(firstresult=False, historic=False)
def moeplug_register_routers(registry: "ComponentRegistry") -> None:
    """Add routers with ``registry.add(name, factory, options_cls=None, requires=(), description="")``.

    Called once per plugin while ``PluginHost.load`` runs. ``factory(model_cfg, options)`` must
    return a :class:`moeplug.interfaces.Router`. Return value: ignored.
    """


@hookspec(firstresult=False, historic=False)
def moeplug_register_dispatchers(registry: "ComponentRegistry") -> None:
    """Add token dispatchers with ``registry.add(...)``.

    Called once per plugin while ``PluginHost.load`` runs. ``factory(model_cfg, options, group)``
    (``group``: the expert-parallel process group, ``None`` for one process) must return a
    :class:`moeplug.interfaces.Dispatcher`. Return value: ignored.
    """


@hookspec(firstresult=False, historic=False)
def moeplug_register_experts(registry: "ComponentRegistry") -> None:
    """Add expert backends with ``registry.add(...)``.

    Called once per plugin while ``PluginHost.load`` runs.
    ``factory(model_cfg, options, num_local_experts)`` must return a
    :class:`moeplug.interfaces.Experts`. Return value: ignored.
    """


@hookspec(firstresult=False, historic=False)
def moeplug_register_precisions(registry: "ComponentRegistry") -> None:
    """Add precision recipes with ``registry.add(...)``.

    Called once per plugin while ``PluginHost.load`` runs. ``factory(options)`` must return a
    :class:`moeplug.interfaces.Precision` (optional ``row_alignment``; a low-precision recipe
    enters ``moeplug.quant.recipe_plan`` in its ``autocast``). Return value: ignored.
    """


@hookspec(firstresult=False, historic=False)
def moeplug_register_datasets(registry: "ComponentRegistry") -> None:
    """Add corpus readers (data formats) with ``registry.add(...)``.

    Called once per plugin while ``PluginHost.load`` runs. ``factory(options)`` must return a
    :class:`moeplug.data.reader.CorpusReader`; ``data.corpus`` paths go to the reader whose
    ``claims(path)`` is true (or the one ``data.format`` names). Return value: ignored.
    """


# Which register hook fills which component kind (the model kinds as in
# moeplug.interfaces.KINDS, then the data kind).
REGISTER_HOOKS = {
    "router": "moeplug_register_routers",
    "dispatcher": "moeplug_register_dispatchers",
    "experts": "moeplug_register_experts",
    "precision": "moeplug_register_precisions",
    "dataset": "moeplug_register_datasets",
}

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME", "ENTRY_POINT_GROUP", "REGISTER_HOOKS"]
