"""The ``plugins:`` section: which plugin supplies each component, and its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeplug.config._checks import _check_fields, _fail


@dataclass(kw_only=True, slots=True)
class PluginsConfig:
    """Which plugin supplies each component, by registered name, plus per-plugin options."""

    router: str = "topk"
    dispatcher: str = "alltoall"
    experts: str = "grouped"
    precision: str = "fp32"
    # Options passed to the chosen plugin; validated by the plugin's own options dataclass.
    router_options: dict = field(default_factory=dict)
    dispatcher_options: dict = field(default_factory=dict)
    experts_options: dict = field(default_factory=dict)
    precision_options: dict = field(default_factory=dict)
    # Plugin names (component or entry-point names) never to load; joined with $MOEPLUG_BLOCK_PLUGINS.
    block: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.block, str):  # "a,b" from an override or the environment
            self.block = [s for s in self.block.split(",") if s]
        _check_fields(self)
        for n in ("router", "dispatcher", "experts", "precision"):
            v = getattr(self, n)
            if not isinstance(v, str) or not v:
                _fail(self, n, v, "must be a plugin name", "run `moeplug plugins` to list names")
        for n in ("router_options", "dispatcher_options", "experts_options", "precision_options"):
            if not isinstance(getattr(self, n), dict):
                _fail(self, n, getattr(self, n), "must be a mapping", f"write {n}: {{key: value}}")
        if not isinstance(self.block, list):
            _fail(self, "block", self.block, "must be a list of plugin names", "write block: [name, ...]")

