"""What a mode rule is (:class:`Rule`) and what it reads (:class:`Facts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# When each fact becomes known, all before any process group exists (moeplug.cli cmd_train):
#   config   the RootConfig alone: its __post_init__, on every load (CLI, library, plan, resume)
#   experts  the chosen Experts class's declared capabilities (and the Precision class's):
#            plugin_host.check_plugins
#   device   the device train.device resolved to: training.distributed.resolve_device
NEEDS = ("config", "experts", "device")


@dataclass(frozen=True, slots=True)
class Facts:
    """What a rule may read: the run's config, and (once known) the chosen Experts class (with
    the Precision class beside it: its declared ``quantizes_gemms``) and the device
    ``train.device`` resolved to ("cuda" or "cpu")."""

    cfg: Any  # the RootConfig
    experts: type | None = None
    device: str | None = None
    precision: type | None = None

    @property
    def device_field(self) -> str:
        """How a device rule's message names the setting (``auto`` resolves to a GPU only at
        launch, where RootConfig cannot see it)."""
        return f"TrainConfig.device = {self.cfg.train.device!r}"


@dataclass(frozen=True, slots=True)
class Rule:
    """One compatibility rule of a mode.

    ``check(facts)`` reports a broken rule as every config check does: ``_fail`` (the
    ``Class.field = value: rule. Fix: ...`` line) or a raised ConfigError of such lines.
    ``reports``: the setting its message starts with (``RuntimeSection.capture``,
    ``plugins.experts``, ``TrainConfig.device``). ``example``: a config (as
    ``config_from_dict`` takes it) that the rule refuses, given the fact ``needs`` names (an
    Experts class declaring only ``declares``; the device "cuda"): tests/test_mode_rules.py
    checks every rule with it, so a new rule cannot land without a message naming field, value
    and fix.
    """

    mode: str
    needs: str
    reports: str
    check: Callable[[Facts], None]
    example: Mapping[str, Any] = field(default_factory=dict)
    declares: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.needs not in NEEDS:
            raise ValueError(f"Rule {self.mode}/{self.reports}: needs = {self.needs!r} must be "
                             f"one of {', '.join(NEEDS)}")



def missing_capability(experts: type, capability: str, switch: str, why: str,
                       once: str) -> str | None:
    """The one line for an Experts class that does not declare ``capability``, which the mode
    ``switch`` (its field) needs, ``why``; None when it does."""
    if getattr(experts, capability):
        return None
    name = experts.__name__
    return (f"{name} does not declare {capability}, which {switch} needs ({why}). Fix: declare "
            f"{capability} = True on {name} once {once}, use plugins.experts: grouped, or set "
            f"{switch}: false")
