"""Building a RootConfig from nested mappings (YAML files, dotted overrides, checkpoints),
reporting every problem at once."""

from __future__ import annotations

import codecs
import difflib
import logging
import os
from dataclasses import fields
from typing import Any, Mapping

import yaml

from moeplug.config._checks import ConfigError, _found
from moeplug.config.data import DataConfig
from moeplug.config.model import MLAConfig, ModelConfig, MoEConfig, RecomputeConfig
from moeplug.config.parallel import ParallelConfig
from moeplug.config.plugins import PluginsConfig
from moeplug.config.root import RootConfig
from moeplug.config.runtime import RuntimeSection
from moeplug.config.train import TrainConfig

_log = logging.getLogger("moeplug.config")  # notices; with no logging set up, Python prints them


class _Unbuilt(Exception):
    """A section could not be built at all; its problems are already recorded in ``_found``."""


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    """``cls`` from a nested mapping, recording every problem (unknown keys, failed checks) in
    the collector that :func:`config_from_dict` set. A section whose checks failed is still
    passed up, so the cross-section checks run too; one that could not be built stops its
    parents (``_Unbuilt``)."""
    found = _found.get()
    if not isinstance(data, Mapping):
        found.append(f"{path.rstrip('.') or cls.__name__} = {data!r}: must be a mapping (the "
                     f"{cls.__name__} section). Fix: write it as `key: value` lines")
        raise _Unbuilt
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    complete = True
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(known)}"
            found.append(f"{cls.__name__}: unknown field '{path + key}'. Fix: {hint}")
            continue
        sub = _SUBCONFIGS.get((cls, key))
        if sub:
            try:
                value = _build(sub, value, f"{path}{key}.")
            except _Unbuilt:
                complete = False
                continue
        elif known[key].type in ("float", "float | None"):
            value = _as_float(value)
        kwargs[key] = value
    if not complete:
        raise _Unbuilt
    try:
        return cls(**kwargs)
    except ConfigError as e:  # raised, not recorded (e.g. by validate_model)
        found.extend(e.errors)
    except (TypeError, ArithmeticError):
        # A later check tripped over a value an earlier one already reported (a string where a
        # number belongs, a zero divisor): that report stands. With none, it is a real bug.
        if not found:
            raise
    raise _Unbuilt


def _as_float(value: Any) -> Any:
    # YAML 1.1 reads "1e-3" (no dot) as a string, and users write lr=1e-3; ints are fine too.
    # Anything that is not a number stays as it is, so the field's own check reports it.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


_SUBCONFIGS: dict[tuple[type, str], type] = {
    (RootConfig, "model"): ModelConfig,
    (RootConfig, "plugins"): PluginsConfig,
    (RootConfig, "data"): DataConfig,
    (RootConfig, "train"): TrainConfig,
    (RootConfig, "parallel"): ParallelConfig,
    (RootConfig, "runtime"): RuntimeSection,
    (ModelConfig, "moe"): MoEConfig,
    (ModelConfig, "mla"): MLAConfig,
    (ModelConfig, "recompute"): RecomputeConfig,
}


def config_from_dict(data: Mapping[str, Any]) -> RootConfig:
    """A validated RootConfig; one ConfigError listing every problem in ``data`` otherwise."""
    found: list[str] = []
    token = _found.set(found)
    try:
        cfg = _build(RootConfig, data, "")
    except _Unbuilt:
        pass
    finally:
        _found.reset(token)
    if found:
        raise ConfigError(*found)
    return cfg


def _parse_scalar(text: str) -> Any:
    # YAML scalars: 8 -> int, 1e-3 -> float, true -> bool, [a, b] -> list, anything else -> str.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE. Fix: write e.g. "
                              f"--set model.moe.num_experts=8")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section. Fix: check the key path")
        value = _parse_scalar(raw)
        old = node.get(parts[-1])
        # a section given as a mapping merges into it, as a file does over a preset
        node[parts[-1]] = (merge_config_dicts(old, value)
                           if isinstance(value, Mapping) and isinstance(old, Mapping) else value)
    return data


def merge_config_dicts(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict:
    """``top`` over ``base``: sections (mappings) merge key by key; any other value replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config_dicts(out[key], value)
        else:
            out[key] = value
    return out


def _utf16_or_32(path: str) -> bool:
    """Text an editor saved as UTF-16/32: a byte-order mark and printable text behind it."""
    with open(path, "rb") as f:
        raw = f.read()
    for codec in ("utf-32", "utf-16"):  # utf-32 first: its little-endian BOM starts with utf-16's
        try:
            text = raw.decode(codec)
        except UnicodeDecodeError:
            continue
        if raw[:4] in (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE) or \
                raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
            return all(c.isprintable() or c in "\t\r\n" for c in text)
    return False


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last: a
    second `model:` block silently replaced the first)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"config file {self.name!r}: key {key!r} appears twice in one "
                                  f"section (lines "
                                  f"{seen[key] + 1} and {key_node.start_mark.line + 1}); YAML "
                                  f"would keep only the last. Fix: merge the two into one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | None = None, overrides: list[str] | None = None,
                base: Mapping[str, Any] | None = None) -> RootConfig:
    """Defaults ← ``base`` (a preset) ← YAML file ← dotted overrides, validated as one RootConfig."""
    return config_from_dict(load_config_dict(path, overrides, base))


def load_config_dict(path: str | None = None, overrides: list[str] | None = None,
                     base: Mapping[str, Any] | None = None) -> dict:
    """What :func:`load_config` validates: ``base`` ← YAML file ← dotted overrides, as a nested
    dict of only what they give (a resume takes the rest from its checkpoint)."""
    data: dict = {}
    if path:
        if os.path.isdir(path):
            inside = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
            raise ConfigError(f"config file {path!r} is a directory, not a YAML file. Fix: pass "
                              f"a file" + (f" (there: {', '.join(inside)})" if inside else ""))
        if not os.path.isfile(path):
            what = "is not a regular file" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"config file {path!r} {what}. Fix: pass an existing YAML "
                              f"file to --config, or leave --config out to use the packaged default")
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a UTF-8 BOM is fine
                loaded = yaml.load(f, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: "
                              f"{' '.join(str(e).split())}. Fix: correct the syntax there") from None
        except UnicodeDecodeError as e:
            if _utf16_or_32(path):
                raise ConfigError(f"config file {path!r} is not UTF-8 text (it starts with a "
                                  f"UTF-16/32 byte-order mark). Fix: save it as UTF-8 "
                                  f"(e.g. iconv -f UTF-16 -t UTF-8)") from None
            raise ConfigError(f"config file {path!r} is not UTF-8 text ({e}). Fix: pass the YAML "
                              f"config file, not a binary one") from None
        if loaded is None and not base:
            # An empty file means the dataclass defaults (README "Config reference"), which
            # differ from the packaged default.yaml that no --config would have used.
            _log.warning(f"moeplug: note: config file {path!r} is empty: training the dataclass "
                         f"defaults (docs/config.md), not the packaged default.yaml")
        loaded = {} if loaded is None else loaded
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping. "
                              f"Fix: start with sections model:, plugins:, data:, train:")
        data = loaded
    if base:
        data = merge_config_dicts(base, data)
    apply_overrides(data, list(overrides or []))
    return data
