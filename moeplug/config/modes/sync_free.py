"""runtime.sync_free (moeplug.moe.budgeted, moeplug.runtime.syncfree): static shapes from a per-rank
token budget, no host synchronisation; the region runs the experts' GEMMs itself, in the
autocast dtype or through a built-in emulated recipe, over its own static EP exchange."""

from __future__ import annotations

from moeplug.config._checks import ConfigError, _fail
from moeplug.config.model import expert_op_levers
from moeplug.config.modes._rule import Facts, Rule, missing_capability
from moeplug.config.runtime import SYNC_FREE_PRECISIONS


def _precision(f: Facts) -> None:
    rt, precision = f.cfg.runtime, f.cfg.plugins.precision
    if rt.sync_free and precision not in SYNC_FREE_PRECISIONS:
        _fail(rt, "sync_free", True, f"runs the expert GEMMs in fp32, bf16 or an emulated "
              f"recipe ({', '.join(SYNC_FREE_PRECISIONS[2:])}), not plugins.precision = "
              f"{precision!r}", "set plugins.precision to one of those, or runtime.sync_free: false")


def missing_budget_rows(experts: type) -> str | None:
    """What ``experts`` (an Experts class) lacks for runtime.sync_free: one line, or None."""
    return missing_capability(
        experts, "budget_rows", "runtime.sync_free", "its forward then takes a token budget's "
        "fixed rows: B per local expert, zero rows of weight 0 where no choice landed, read on "
        "the host only as constants", "its forward does (moeplug.interfaces.Experts)")


def _experts_budget_rows(f: Facts) -> None:
    # The region calls the experts backend on budget rows: one that does not declare it takes
    # them is refused before any process group, rather than bypassed or failing in a step.
    missing = missing_budget_rows(f.experts) if f.cfg.runtime.sync_free else None
    if missing is not None:
        raise ConfigError(f"plugins.experts = {f.cfg.plugins.experts!r}: {missing}")


def _gpu_expert_op_levers(f: Facts) -> None:
    # A GPU's region runs batched GEMMs under autograd (or CUDA graphs): it keeps the
    # activation and has no offload scope, so moe_act and the expert offload names do nothing.
    levers = expert_op_levers(f.cfg.model)
    if f.device == "cuda" and f.cfg.runtime.sync_free and levers:
        wants = [f"model.{key} {n}" for key, names in levers.items() for n in names]
        drop = " and ".join(n for names in levers.values() for n in names)
        raise ConfigError(f"{f.device_field}: {', '.join(wants)} act in the CPU's sync-free "
                          "region only; a GPU's (batched GEMMs under autograd, or CUDA graphs) "
                          f"keeps the activation and offloads nothing. Fix: drop {drop} from "
                          "those settings, set runtime.sync_free: false, or --set "
                          "train.device=cpu")


_SYNC_FREE = {"runtime": {"sync_free": True}}
RULES = (
    Rule("sync_free", "config", "RuntimeSection.sync_free", _precision,
         {**_SYNC_FREE, "plugins": {"precision": "te_fp8"}}),
    Rule("sync_free", "experts", "plugins.experts", _experts_budget_rows, _SYNC_FREE),
    Rule("sync_free", "device", "TrainConfig.device", _gpu_expert_op_levers,
         {**_SYNC_FREE, "model": {"offload": ["expert_fc1"]}}),
)
