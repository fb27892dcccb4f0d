"""model.recompute (moeplug.modules.recompute): what the backward recomputes instead of
keeping. moe_act lives inside the routed experts' op: the op keeps FC1's output and rebuilds
the activation in backward; the same op notes its saved tensors for the expert offload names
(model.offload expert_fc1 / moe_act), so both ask the backend for one capability
(config.expert_op_levers). Combined 1F1B's recompute rule: overlap.py."""

from __future__ import annotations

from moeplug.config._checks import ConfigError
from moeplug.config.model import expert_op_levers
from moeplug.config.modes._rule import Facts, Rule


def _experts_rebuild_activation(f: Facts) -> None:
    # Refused here, before any process group, rather than when the model is built.
    levers = expert_op_levers(f.cfg.model)
    if not levers or f.experts.can_recompute_activation:
        return
    wants = [f"model.{key} {n}" for key, names in levers.items() for n in names]
    names = [n for ns in levers.values() for n in ns]
    raise ConfigError(
        f"plugins.experts = {f.cfg.plugins.experts!r}: {f.experts.__name__} cannot run "
        f"{', '.join(wants)} (they need a backend that declares can_recompute_activation: its op "
        f"keeps FC1's output and marks its saved tensors). Fix: use plugins.experts: "
        f"grouped, or drop {', '.join(names)} from those settings")


_MOE_ACT = {"model": {"recompute": {"granularity": "selective", "modules": ["moe_act"]}}}
RULES = (
    Rule("recompute", "experts", "plugins.experts", _experts_rebuild_activation, _MOE_ACT),
)
