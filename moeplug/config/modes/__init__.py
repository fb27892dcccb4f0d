"""Which modes combine: every mode's compatibility rules, and the one check that runs them.

A mode states its rules in its own module here, one small file each (``RULES``, a tuple of
:class:`Rule`); :data:`RULES` lists them all and :func:`check_modes` runs them:

    sync_free    runtime.sync_free: precisions, the experts' budget rows, a GPU's region
    capture      runtime.capture: needs sync_free, no stash, fp32/bf16, the expert levers
    overlap      model.moe.overlap_chunks and combined 1F1B (overlap_moe_expert_parallel_comm)
    delay_wgrad  model.moe.delay_wgrad_compute: grouped experts, fp32/bf16, CPU, no stash
    recompute    model.recompute: moe_act's backend capability, the swiglu CUDA path
    offload      model.offload against recompute
    precision    plugins.precision's recipes against train.master_dtype / param_dtype, and
                 a recipe that quantizes GEMMs against an experts backend not running it
    fsdp         parallel.fsdp against ZeRO-1, combined 1F1B and the other sections
    device       train.device: what a GPU does not run yet

A rule lives in the module of the mode its message reports (the field it names first); the
paged stash (runtime.stash) is refused by the modes that cannot hold it (capture, overlap,
delay_wgrad, fsdp). Each rule reads one fact and runs as soon as that fact is known; all three
are known before any process group exists (moeplug.cli cmd_train):

    config   the RootConfig alone: RootConfig.__post_init__, on every load
    experts  the chosen Experts class's declared capabilities (moeplug.interfaces.Experts):
             plugin_host.check_plugins
    device   the device train.device resolved to (auto: a GPU when torch sees one):
             training.distributed.resolve_device

The rules need no torch and nothing outside moeplug.config (config is the ground floor of the
import graph), which is why they live here and not beside the torch code of each mode. A new
mode adds one module here and its name to ``_MODULES``; tests/test_mode_rules.py refuses a rule
whose example config is not refused with a one-line message naming field, value and fix.
"""

from __future__ import annotations

from moeplug.config._checks import Problems
from moeplug.config.modes import (capture, delay_wgrad, device, fsdp, offload, overlap,
                                  precision, recompute, sync_free)
from moeplug.config.modes._rule import NEEDS, Facts, Rule

# Order counts only between rules that report the same field (the first broken one is the
# line shown): offload's before capture's (ModelConfig.offload).
_MODULES = (precision, offload, capture, overlap, fsdp, sync_free, delay_wgrad, recompute, device)
RULES: tuple[Rule, ...] = tuple(r for module in _MODULES for r in module.RULES)


def check_modes(cfg, *, experts: type | None = None, device: str | None = None,
                precision: type | None = None, rules: tuple[Rule, ...] | None = None) -> None:
    """Run the mode rules (``rules``, default every one) that read the fact given: with
    ``experts`` (the chosen Experts class; ``precision``, the chosen Precision class, beside
    it), the ``experts`` rules; with ``device`` ("cuda" or
    "cpu", what train.device resolved to), the ``device`` rules; with neither, the ``config``
    rules (RootConfig runs these). ConfigError listing every broken rule, one line each; while
    a config load collects problems (moeplug.config.loader), the config rules record theirs."""
    if experts is not None and device is not None:
        raise TypeError("check_modes: give experts or device, not both (they become known at "
                        "different points: check_plugins, resolve_device)")
    needs = "experts" if experts is not None else "device" if device is not None else "config"
    facts = Facts(cfg, experts=experts, device=device, precision=precision)
    chosen = [r for r in (RULES if rules is None else rules) if r.needs == needs]
    if needs == "config":
        for rule in chosen:  # _fail records while a load collects, else raises the first
            rule.check(facts)
        return
    problems = Problems()
    for rule in chosen:
        problems.attempt(rule.check, facts)
    problems.raise_all()


__all__ = ["NEEDS", "RULES", "Facts", "Rule", "check_modes"]
