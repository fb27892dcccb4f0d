"""Find plugins through the ``moeplug`` entry-point group, keep one registry per component kind,
and create components by name with validated options.

The core never imports ``moeplug_plugins``: built-ins arrive through entry points declared in
moeplug's own pyproject.toml, exactly like a third-party package's.

Rules (each one raises :class:`PluginError`, whose message names what failed and the fix):
  * a plugin module that fails to import is reported against its entry point and distribution;
  * a hook name no spec knows (``check_pending``) or a hook with wrong arguments is an error;
  * two plugins adding the same name to one kind is an error naming both sources;
  * ``create`` with an unknown name lists what exists (and what is unavailable, and why);
  * a component whose ``requires`` modules are missing is listed as unavailable;
  * blocked names (``block=`` plus ``$MOEPLUG_BLOCK_PLUGINS``) match component names (``topk``),
    qualified names (``router:topk``) or entry-point names; blocked entry points are not imported;
  * ``MOEPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` (or ``autoload=False``) loads only moeplug's own
    entry points.

Factory call convention (see the bottom of :mod:`moeplug.interfaces`): the validated options
object always follows the model config, i.e. ``factory(*args[:1], options, *args[1:])``:
    router:     factory(model_cfg, options)
    dispatcher: factory(model_cfg, options, group)
    experts:    factory(model_cfg, options, num_local_experts)
    precision:  factory(options)
    dataset:    factory(options)
``options`` is an instance of the plugin's ``options_cls`` or ``None`` when it declares none.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import pluggy

from moeplug import hookspecs
from moeplug.config import ConfigError, Problems
from moeplug.config.modes import check_modes

# moeplug.interfaces.KINDS (no torch here), then the corpus readers (moeplug.data.reader).
KINDS = ("router", "dispatcher", "experts", "precision", "dataset")
_log = logging.getLogger(__name__)  # notices; with no logging set up, Python prints them
BLOCK_ENV = "MOEPLUG_BLOCK_PLUGINS"
NO_AUTOLOAD_ENV = "MOEPLUG_DISABLE_PLUGIN_AUTOLOAD"
CORE_DIST = "moeplug"

# What `create` passes to a factory besides the options, per kind (for arity errors).
_FACTORY_ARGS = {
    "router": ("model_cfg",),
    "dispatcher": ("model_cfg", "group"),
    "experts": ("model_cfg", "num_local_experts"),
    "precision": (),
    "dataset": (),
}


class PluginError(ConfigError):
    """A plugin could not be loaded, found or created. The message names the plugin and the fix."""


@dataclass(frozen=True)
class PluginInfo:
    """One registered component, as listed by ``moeplug plugins``."""

    kind: str
    name: str
    dist: str
    entry_point: str
    available: bool
    reason: str
    description: str


@dataclass(frozen=True)
class SkippedEntryPoint:
    """An entry point that was not imported (blocked, or autoload disabled)."""

    entry_point: str
    dist: str
    reason: str


@dataclass(frozen=True)
class _Source:
    dist: str
    entry_point: str

    def __str__(self) -> str:
        return f"entry point '{self.entry_point}' of distribution '{self.dist}'"


@dataclass(frozen=True)
class _Entry:
    kind: str
    name: str
    factory: Callable[..., Any]
    options_cls: type | None
    description: str
    source: _Source
    reason: str  # "" when creatable; otherwise why not (blocked, missing module)


def _normalize_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------------------------
# Blocking
# --------------------------------------------------------------------------------------------

def _collect_blocks(block: Iterable[str]) -> dict[str, str]:
    """Block token -> where it came from (for error messages)."""
    if isinstance(block, str):
        block = block.split(",")
    blocks = {tok.strip(): "plugins.block" for tok in block if tok.strip()}
    for tok in os.environ.get(BLOCK_ENV, "").split(","):
        if tok.strip():
            blocks.setdefault(tok.strip(), f"${BLOCK_ENV}")
    return blocks


_noted_blocks: set[str] = set()  # tokens already noted in this process (hosts load often)


def _note_unmatched_blocks(blocks: dict[str, str], entry_points: set[str],
                           entries: dict[str, dict[str, Any]]) -> None:
    """A note, once per process, for each block token that names no entry point, component or
    kind:component (a typo blocked nothing, silently)."""
    known = set(entry_points)
    for kind, by_name in entries.items():
        known.update(by_name)
        known.update(f"{kind}:{n}" for n in by_name)
    for tok, by in blocks.items():
        if tok not in known and tok not in _noted_blocks:
            _noted_blocks.add(tok)
            close = difflib.get_close_matches(tok, sorted(known), n=1)
            _log.warning(f"moeplug: note: {by} names '{tok}', which is no plugin, entry point or "
                         f"kind:name here, so it blocks nothing"
                         + (f" (did you mean '{close[0]}'?)" if close else ""))


def _block_reason(blocks: dict[str, str], *tokens: str) -> str:
    for tok in tokens:
        if tok in blocks:
            return f"blocked by {blocks[tok]} ('{tok}')"
    return ""


def _unblock_fix(reason_token: str, by: str) -> str:
    if by == "plugins.block":
        return f"remove '{reason_token}' from plugins.block"
    return f"remove '{reason_token}' from ${BLOCK_ENV}"


# --------------------------------------------------------------------------------------------
# The registry a register hook fills
# --------------------------------------------------------------------------------------------

class ComponentRegistry:
    """Adds components of one kind on behalf of one plugin (what a register hook receives)."""

    def __init__(self, kind: str, source: _Source, sink: dict[str, _Entry], blocks: dict[str, str]):
        self.kind = kind
        self._source = source
        self._sink = sink
        self._blocks = blocks

    def add(self, name: str, factory: Callable[..., Any], options_cls: type | None = None,
            requires: Iterable[str] = (), description: str = "", install_hint: str = "",
            unavailable: str = "") -> None:
        """Register ``factory`` under ``name``.

        requires: modules the component needs at create time (checked with find_spec, never
        imported here); when one is missing the component is listed as unavailable.
        install_hint: the pip command that provides them (default: ``pip install <module>``).
        unavailable: why the component cannot be created here when that is not a missing module
        (e.g. an OS feature or a runtime build without it); non-empty lists it as unavailable.
        """
        where = f"{self.kind} '{name}' from {self._source}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            raise PluginError(f"{self.kind} name {name!r} from {self._source} is invalid: names are "
                              f"non-empty and use letters, digits, '_', '-', '.'. Fix: rename it, "
                              f"e.g. 'my_router'")
        if not callable(factory):
            raise PluginError(f"{where}: factory {factory!r} is not callable. Fix: pass the class or "
                              f"function that builds the component")
        if options_cls is not None and not (isinstance(options_cls, type)
                                            and dataclasses.is_dataclass(options_cls)):
            raise PluginError(f"{where}: options_cls {options_cls!r} is not a dataclass. Fix: decorate "
                              f"it with @dataclasses.dataclass or pass options_cls=None")
        if isinstance(requires, str):
            requires = (requires,)
        if name in self._sink:
            other = self._sink[name].source
            builtin = next((s for s in (other, self._source) if s.dist == "moeplug"), None)
            if builtin is not None:  # a built-in's name: the other package must rename
                third = self._source if builtin is other else other
                fix = (f"rename the {self.kind} in '{third.dist}' (moeplug's built-in names are "
                       f"taken), or block its entry point with {BLOCK_ENV}={third.entry_point}")
            else:
                fix = (f"uninstall one of '{other.dist}' / '{self._source.dist}', or block one "
                       f"entry point with {BLOCK_ENV}={self._source.entry_point}")
            raise PluginError(f"{self.kind} '{name}' is registered twice: by {other} and by "
                              f"{self._source}. Fix: {fix}")
        reason = _block_reason(self._blocks, f"{self.kind}:{name}", name)
        if not reason:
            reason = _missing_requirement(tuple(requires), install_hint)
        if not reason and unavailable:
            reason = str(unavailable)
        self._sink[name] = _Entry(self.kind, name, factory, options_cls, description, self._source,
                                  reason)


def _missing_requirement(requires: tuple[str, ...], install_hint: str) -> str:
    for module in requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a missing parent package raises instead of returning None
            found = False
        if not found:
            hint = install_hint or f"pip install {module.split('.')[0].replace('_', '-')}"
            return f"needs module '{module}', which is not installed (`{hint}`)"
    return ""


# --------------------------------------------------------------------------------------------
# Options validation
# --------------------------------------------------------------------------------------------

def _type_ok(value: Any, tp: Any) -> tuple[bool, str]:
    """Whether ``value`` fits annotation ``tp``; also a readable name of what was expected."""
    if tp is Any:
        return True, "any value"
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        return value in allowed, "one of " + ", ".join(repr(a) for a in allowed)
    if origin in (typing.Union, types.UnionType):
        results = [_type_ok(value, a) for a in typing.get_args(tp)]
        return any(ok for ok, _ in results), " or ".join(name for _, name in results)
    if origin in (list, tuple) and typing.get_args(tp):
        args = typing.get_args(tp)
        if not isinstance(value, origin):
            return False, f"a {origin.__name__} of {_type_ok(None, args[0])[1]}"
        elems = _element_types(origin, args, len(value))
        if len(elems) != len(value):
            return False, f"a tuple of {len(elems)} values"
        for v, a in zip(value, elems):
            ok, name = _type_ok(v, a)
            if not ok:
                return False, f"a {origin.__name__} of {name} (an element is {v!r})"
        return True, origin.__name__
    if origin is not None:
        tp = origin
    if tp is type(None):
        return value is None, "None"
    if tp is bool:
        return isinstance(value, bool), "bool"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), "int"
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), "float"
    if isinstance(tp, type):
        return isinstance(value, tp), tp.__name__
    return True, str(tp)


def _element_types(origin: type, args: tuple, n: int) -> tuple:
    """The annotations of the n elements of a ``list[X]`` / ``tuple[X, ...]`` (X each) or a
    fixed ``tuple[X, Y]`` (its own, whatever n is)."""
    return args[:1] * n if origin is list or args[-1:] == (...,) else args


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as YAML cannot write it for ``tp``: a number YAML 1.1 read as a string (1e-3,
    as moeplug.config.loader._as_float does for config fields) where a float goes, and a list where a
    tuple goes (YAML has no tuples); elements of lists and tuples alike. Anything else as it
    is, for :func:`_type_ok` to judge."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and float in args and str not in args:
            return _coerce(value, float)
        seqs = [a for a in args if typing.get_origin(a) in (list, tuple)]
        return _coerce(value, seqs[0]) if len(seqs) == 1 and isinstance(value, list) else value
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if origin in (list, tuple) and args and isinstance(value, (list, tuple)):
        elems = _element_types(origin, args, len(value))
        if len(elems) == len(value):
            value = [_coerce(v, a) for v, a in zip(value, elems)]
        return tuple(value) if origin is tuple else list(value)
    return value


def _build_options(entry: _Entry, options: dict | None) -> Any:
    where = f"{entry.kind} '{entry.name}' (from {entry.source.dist})"
    field_path = f"plugins.{entry.kind}_options"
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise PluginError(f"{where}: {field_path} = {options!r} is not a mapping. Fix: write "
                          f"{field_path}: {{key: value}}")
    cls = entry.options_cls
    if cls is None:
        if options:
            raise PluginError(f"{where} takes no options, got {field_path} = {options!r}. Fix: remove "
                              f"{field_path}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    options = {k: (_coerce(v, hints.get(k, Any)) if k in fields else v)
               for k, v in options.items()}
    for key, value in options.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{close[0]}'?" if close else (
                f"valid options: {', '.join(fields)}" if fields else "it takes no options")
            raise PluginError(f"{where}: unknown option {field_path}.{key} = {value!r}. Fix: {hint}")
        ok, expected = _type_ok(value, hints.get(key, Any))
        if not ok:
            raise PluginError(f"{where}: option {field_path}.{key} = {value!r} "
                              f"({type(value).__name__}) must be {expected}. Fix: set {key} to {expected}")
        # inf and nan pass every range check written as a comparison (nan < 0 is False)
        if any(isinstance(v, float) and not math.isfinite(v)
               for v in (value if isinstance(value, (list, tuple)) else [value])):
            raise PluginError(f"{where}: option {field_path}.{key} = {value!r} must be finite. "
                              f"Fix: set {key} to a finite number")
    for name, f in fields.items():
        required = (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if required and name not in options:
            raise PluginError(f"{where}: option {field_path}.{name} is required. Fix: set "
                              f"{field_path}.{name}")
    try:
        return cls(**options)
    except (ValueError, TypeError) as exc:  # ConfigError is a ValueError
        raise PluginError(f"{where}: invalid {field_path} = {options!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# The host
# --------------------------------------------------------------------------------------------

class PluginHost:
    """Loaded plugins and the per-kind registries they filled. Build it with :meth:`load`."""

    def __init__(self, pm: pluggy.PluginManager, entries: dict[str, dict[str, _Entry]],
                 skipped: tuple[SkippedEntryPoint, ...], blocks: dict[str, str]):
        self.pm = pm
        self._entries = entries
        self.skipped = skipped
        self._blocks = blocks

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, block: Iterable[str] = (), autoload: bool = True,
             extra_plugins: Iterable[tuple[object, str]] = ()) -> "PluginHost":
        """Discover, import and register plugins, then fill the registries.

        block: names never to load (joined with $MOEPLUG_BLOCK_PLUGINS).
        autoload: False (or $MOEPLUG_DISABLE_PLUGIN_AUTOLOAD=1) loads only moeplug's own entry points.
        extra_plugins: (plugin object, distribution name) pairs registered as if found through an
            entry point; for tests and embedding.
        """
        blocks = _collect_blocks(block)
        if os.environ.get(NO_AUTOLOAD_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            autoload = False
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        registered: list[tuple[object, _Source]] = []
        skipped: list[SkippedEntryPoint] = []

        for ep in _entry_points():
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            source = _Source(dist, ep.name)
            if not autoload and _normalize_dist(dist) != CORE_DIST:
                skipped.append(SkippedEntryPoint(ep.name, dist, f"autoload disabled by "
                                                 f"${NO_AUTOLOAD_ENV} or autoload=False"))
                continue
            reason = _block_reason(blocks, ep.name)
            if reason:
                skipped.append(SkippedEntryPoint(ep.name, dist, reason))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # never swallow: report it against the plugin that failed
                raise PluginError(
                    f"plugin {source} ('{ep.value}') failed to import: {type(exc).__name__}: {exc}. "
                    f"Fix: install what it needs or reinstall '{dist}', or skip it with "
                    f"{BLOCK_ENV}={ep.name}") from exc
            _register(pm, plugin, source)
            registered.append((plugin, source))

        for plugin, dist in extra_plugins:
            source = _Source(dist, getattr(plugin, "__name__", type(plugin).__name__))
            if not _block_reason(blocks, source.entry_point):
                _register(pm, plugin, source)
                registered.append((plugin, source))

        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {_source_of(exc.plugin, registered)}: {_one_line(exc)}. "
                              f"Fix: rename the function to one of the moeplug_* hooks in "
                              f"moeplug.hookspecs") from exc

        # Each implementation is called with a registry bound to its own plugin, so every
        # component records the distribution that added it (and duplicates can name both).
        entries: dict[str, dict[str, _Entry]] = {kind: {} for kind in KINDS}
        sources = {id(p): source for p, source in registered}
        for kind, hook_name in hookspecs.REGISTER_HOOKS.items():
            impls = getattr(pm.hook, hook_name).get_hookimpls()  # pluggy order: last registered first
            for impl in sorted(impls, key=lambda i: _position(i.plugin, registered)):
                registry = ComponentRegistry(kind, sources[id(impl.plugin)], entries[kind], blocks)
                impl.function(**{arg: registry for arg in impl.argnames})
        _note_unmatched_blocks(blocks, {s.entry_point for _, s in registered}
                               | {s.entry_point for s in skipped}, entries)
        return cls(pm, entries, tuple(skipped), blocks)

    # ---- queries ---------------------------------------------------------------------------
    def infos(self) -> list[PluginInfo]:
        """Every registered component (available or not), sorted by kind then name."""
        return [PluginInfo(e.kind, e.name, e.source.dist, e.source.entry_point, not e.reason,
                           e.reason, e.description)
                for kind in KINDS for e in sorted(self._entries[kind].values(), key=lambda e: e.name)]

    def names(self, kind: str, available_only: bool = True) -> list[str]:
        self._check_kind(kind)
        return sorted(n for n, e in self._entries[kind].items() if not (available_only and e.reason))

    # ---- creation --------------------------------------------------------------------------
    def require(self, kind: str, name: str) -> _Entry:
        """The entry of plugin ``name``; PluginError (what :meth:`create` would raise) when it
        is unknown or unavailable. A check that builds nothing."""
        self._check_kind(kind)
        entry = self._entries[kind].get(name)
        if entry is None:
            raise PluginError(self._not_found(kind, name))
        if entry.reason:
            raise PluginError(f"{kind} '{name}' (from {entry.source}) is unavailable: {entry.reason}. "
                              + (f"Fix: {_unblock_fix(*self._block_token(kind, name))}, or choose one of: "
                                 if entry.reason.startswith("blocked") else
                                 "Fix: install what it needs, or choose one of: ")
                              + (", ".join(self.names(kind)) or "(none)"))
        return entry

    def create(self, kind: str, name: str, options: dict | None = None, *args: Any,
               interface: type | None = None) -> Any:
        """Build component ``name`` of ``kind``; ``args`` as in the module docstring. The
        component must be an instance of ``interface``: by default the kind's class in
        moeplug.interfaces. A dataset's caller names its interface
        (moeplug.data.reader.CorpusReader, which moeplug.data.sources passes: the data package
        sits above this host, which does not import it)."""
        entry = self.require(kind, name)
        expected = _FACTORY_ARGS[kind]
        if len(args) != len(expected):
            raise TypeError(f"PluginHost.create('{kind}', ...) takes {len(expected)} argument(s) after "
                            f"options ({', '.join(expected) or 'none'}), got {len(args)}")
        opts = _build_options(entry, options)
        try:
            component = entry.factory(*args[:1], opts, *args[1:])
        except ConfigError:
            raise
        except ValueError as exc:  # a factory refusing its options or the model: one line
            raise PluginError(f"{kind} '{name}' (from {entry.source.dist}): {exc}") from exc
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                raise  # raised inside the factory: a bug there, keep its traceback
            raise PluginError(  # the call itself failed: the factory's signature is wrong
                f"{kind} '{name}' (from {entry.source.dist}): its factory cannot be called as "
                f"{kind}({', '.join((*_FACTORY_ARGS[kind][:1], 'options', *_FACTORY_ARGS[kind][1:]))})"
                f" ({exc}). Fix: give the factory that signature (docs/plugins.md)"
            ) from exc
        _check_interface(kind, name, entry, component, interface)
        return component

    def defining_options(self, kind: str, name: str, options: dict | None) -> dict | None:
        """``options`` as plugin ``name`` reads them, for comparing two configs: every option
        with its default filled in, less those its ``options_cls`` lists in
        ``execution_only`` (a class attribute: options that change how it runs, not what it
        computes) or ``training_only`` (options that only weight or steer training: loss
        coefficients, update rates; the trained model computes the same). None where the plugin is unknown, unavailable or rejects them (compare
        them as written; the run reports the problem itself)."""
        self._check_kind(kind)
        entry = self._entries[kind].get(name)
        if entry is None or entry.reason or entry.options_cls is None:
            return None
        try:
            built = _build_options(entry, options)
        except PluginError:
            return None
        from moeplug.interfaces import PluginOptions  # imports torch: only when compared
        skip = (set(PluginOptions.execution_only_of(entry.options_cls))
                | set(PluginOptions.training_only_of(entry.options_cls)))
        return {f.name: getattr(built, f.name) for f in dataclasses.fields(built)
                if f.init and f.name not in skip}

    def check_parallel(self, kind: str, name: str, options: dict | None, parallel: Any) -> None:
        """Rules of a plugin's options that need the parallel layout (``cfg.parallel``), e.g. a
        node size that must divide ``parallel.ep``: an ``options_cls`` may define
        ``check_parallel(self, parallel)`` raising ValueError/ConfigError. The CLI calls this
        before any process group exists; a plugin without such a method passes."""
        self._check_kind(kind)
        entry = self._entries[kind].get(name)
        if entry is None or entry.reason:
            return  # create() reports unknown and unavailable plugins
        from moeplug.interfaces import PluginOptions
        check = PluginOptions.parallel_check_of(_build_options(entry, options))
        if check is None:
            return
        try:
            check(parallel)
        except ValueError as exc:
            raise PluginError(f"{kind} '{name}' (from {entry.source.dist}): {exc}") from exc

    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind {kind!r}. Fix: use one of {', '.join(KINDS)}")

    def _block_token(self, kind: str, name: str) -> tuple[str, str]:
        for tok in (f"{kind}:{name}", name):
            if tok in self._blocks:
                return tok, self._blocks[tok]
        return name, "plugins.block"

    def _not_found(self, kind: str, name: str) -> str:
        reason = _block_reason(self._blocks, f"{kind}:{name}", name)
        if reason:
            return (f"{kind} '{name}' is {reason}. Fix: {_unblock_fix(*self._block_token(kind, name))}")
        avail = self.names(kind)
        unavailable = [f"{e.name} ({e.reason})" for e in self._entries[kind].values() if e.reason]
        close = difflib.get_close_matches(name, avail, n=1)
        plural = kind if kind.endswith("s") else kind + "s"  # "experts" is already plural
        msg = f"unknown {kind} '{name}'. Available {plural}: {', '.join(avail) or '(none)'}"
        if unavailable:
            msg += f"; unavailable: {'; '.join(sorted(unavailable))}"
        if self.skipped:
            msg += "; entry points not loaded: " + "; ".join(
                f"{s.entry_point} from '{s.dist}' ({s.reason})" for s in self.skipped)
        fix = f"did you mean '{close[0]}'?" if close else \
            "pick an available name (`moeplug plugins` lists them) or install the plugin that provides it"
        return f"{msg}. Fix: {fix}"


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    # Sorted so load order (and thus which duplicate is reported second) is reproducible.
    return sorted(eps, key=lambda ep: (_normalize_dist(ep.dist.name) if ep.dist else "", ep.name))


def _register(pm: pluggy.PluginManager, plugin: object, source: _Source) -> None:
    # pluggy registers only functions marked @hookimpl: one named like a hook but unmarked would
    # add nothing, silently (a misspelled marked one is already an error)
    for hook_name in hookspecs.REGISTER_HOOKS.values():
        fn = getattr(plugin, hook_name, None)
        if callable(fn) and pm.parse_hookimpl_opts(plugin, hook_name) is None:
            raise PluginError(f"plugin {source}: {hook_name} is not marked @hookimpl, so it "
                              f"would register nothing. Fix: decorate it with "
                              f"`@moeplug.hookimpl`")
    try:
        pm.register(plugin, name=f"{source.dist}:{source.entry_point}")
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {source}: {_one_line(exc)}. Fix: give the hook function the "
                          f"argument names of its spec in moeplug.hookspecs") from exc
    except ValueError as exc:  # pluggy: plugin object or name already registered
        raise PluginError(f"plugin {source}: {exc}. Fix: point each entry point at its own module") \
            from exc


def _one_line(exc: Exception) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _position(plugin: object, registered: list[tuple[object, _Source]]) -> int:
    return next(i for i, (p, _) in enumerate(registered) if p is plugin)


def _source_of(plugin: object, registered: list[tuple[object, _Source]]) -> str:
    for p, source in registered:
        if p is plugin:
            return str(source)
    return repr(plugin)


def _check_interface(kind: str, name: str, entry: _Entry, component: Any,
                     base: type | None) -> None:
    if base is None:
        if kind == "dataset":  # checked by its caller: moeplug.data.sources passes the interface
            return
        from moeplug import interfaces  # imports torch: only when something is created
        base = {"router": interfaces.Router, "dispatcher": interfaces.Dispatcher,
                "experts": interfaces.Experts, "precision": interfaces.Precision}[kind]
    if not isinstance(component, base):
        raise PluginError(f"{kind} '{name}' from {entry.source}: factory returned "
                          f"{type(component).__name__}, not a {base.__module__}.{base.__name__}. "
                          f"Fix: subclass {base.__module__}.{base.__name__}")


__all__ = ["PluginHost", "PluginError", "PluginInfo", "SkippedEntryPoint", "ComponentRegistry",
           "KINDS", "BLOCK_ENV", "NO_AUTOLOAD_ENV"]


def load_host(cfg: Any) -> "PluginHost":
    """The plugin host of a run (a RootConfig): every plugin but ``plugins.block``."""
    return PluginHost.load(block=cfg.plugins.block)


def check_plugins(host: "PluginHost", cfg: Any) -> Any:
    """Fail fast (PluginError) if a chosen plugin is unknown, unavailable or has bad options.

    The host has no build-free check, so one instance of each component is created (one layer's
    worth: cheap next to data preparation). Returns the precision recipe, which is reused.
    Here, not in the CLI, so that other entry points (``moeplug plan``'s calibration) check a
    config the same way without importing the CLI.
    """
    p, m = cfg.plugins, cfg.model
    problems = Problems()  # every kind's problem, reported together
    attempt = problems.attempt
    for kind in ("router", "dispatcher", "experts", "precision"):  # rules needing parallel.*
        attempt(host.check_parallel, kind, getattr(p, kind),
                dict(getattr(p, f"{kind}_options")), cfg.parallel)
    attempt(host.create, "router", p.router, dict(p.router_options), m)
    dispatcher = attempt(host.create, "dispatcher", p.dispatcher, dict(p.dispatcher_options), m,
                         None)
    # one process: every expert local (a dispatcher that failed above does not hide the rest)
    local = m.moe.num_experts if dispatcher is None else dispatcher.num_local_experts
    experts = attempt(host.create, "experts", p.experts, dict(p.experts_options), m, local)
    precision = attempt(host.create, "precision", p.precision, dict(p.precision_options))
    if experts is not None:  # the modes' rules on the backend's (and recipe's) declared capabilities
        with problems.check():
            check_modes(cfg, experts=type(experts),
                        precision=None if precision is None else type(precision))
    problems.raise_all(PluginError)
    return precision
