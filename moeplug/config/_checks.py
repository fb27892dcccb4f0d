"""The rules every config section shares: the error type, the collector that lets a load
report every problem at once, and the field checks (type, sign, seed range)."""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import fields
from typing import Any, Callable, Iterator


class ConfigError(ValueError):
    """A config value is invalid. The message names the field, the value and the fix.

    ``errors``: one such message per problem; several when a config has several mistakes (the
    message then holds them one per line).
    """

    def __init__(self, *errors: str) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


class Problems:
    """Collects the ConfigErrors of independent checks, so one command reports them all."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as e:
            self.errors.extend(e.errors or [str(e)])

    def attempt(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None after recording its ConfigError."""
        with self.check():
            return fn(*args)
        return None

    def raise_all(self, error: type[ConfigError] = ConfigError) -> None:
        """``error`` listing every problem recorded (each once), if any."""
        if self.errors:
            raise error(*dict.fromkeys(self.errors))


# While config_from_dict builds a config, _fail records here instead of raising, so the
# remaining checks still run and report their own problems (None: raise at once).
_found: ContextVar[list[str] | None] = ContextVar("moeplug_config_errors", default=None)


def _fail(obj: Any, name: str, value: Any, rule: str, fix: str) -> None:
    head = f"{type(obj).__name__}.{name} = {value!r}: "
    found = _found.get()
    if found is None:
        raise ConfigError(f"{head}{rule}. Fix: {fix}")
    if not any(m.startswith(head) for m in found):  # one line per problem: the first rule wins
        found.append(f"{head}{rule}. Fix: {fix}")


def _record(error: ConfigError) -> None:
    """``error``'s lines recorded as :func:`_fail` records them (raised when nothing collects):
    a field that already has a problem keeps its first line only."""
    found = _found.get()
    if found is None:
        raise error
    for line in error.errors:
        head = line.split(": ", 1)[0] + ": "
        if not any(m.startswith(head) for m in found):
            found.append(line)


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,),
          "dict": (dict,), "None": (type(None),)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "a boolean (true or false)",
               "list": "a list", "dict": "a mapping", "None": "null"}


def _check_fields(obj: Any) -> None:
    """The rules every field has from its annotation alone (so a new field is covered without
    listing it): the annotated type (bool is not a number), and a float must be finite (nan
    and inf pass every ``<``/``>`` rule silently and then poison the run). Runs first in each
    section's ``__post_init__``; the section's own value rules follow."""
    for f in fields(obj):
        v, names = getattr(obj, f.name), str(f.type).split(" | ")
        if not all(n in _TYPES for n in names):
            continue  # a sub-section: checked by its own class
        if not any(isinstance(v, _TYPES[n]) and not (isinstance(v, bool) and n != "bool")
                   for n in names):
            want = " or ".join(_TYPE_WORDS[n] for n in names)
            fix = f"write {f.name}: true or false" if names == ["bool"] else \
                f"set {f.name} to {want}"
            _fail(obj, f.name, v, f"must be {want}", fix)
        elif isinstance(v, float) and not math.isfinite(v):
            _fail(obj, f.name, v, "must be a finite number", f"set {f.name} to a real value")


def _above_zero(obj: Any, *names: str) -> None:
    # Physical scales (a RoPE base, a norm epsilon, a std): zero or negative means nothing.
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v > 0:
            _fail(obj, n, v, "must be > 0", f"set {n} to a positive number")


def _is_positive_int(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not _is_positive_int(v):
            _fail(obj, n, v, "must be a positive integer", f"set {n} to an integer >= 1")


SEED_LIMIT = 2 ** 63  # torch.manual_seed and numpy's generators take seeds in [0, 2**63)


def _check_seed(obj: Any, name: str, value: Any) -> None:
    if not 0 <= value < SEED_LIMIT:
        _fail(obj, name, value, "must be in [0, 2**63) (torch's and numpy's generators take "
              "no other)", f"set {name} to e.g. 1234")


def _non_negative(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            _fail(obj, n, v, "must be a number >= 0", f"set {n} to 0 or more")

