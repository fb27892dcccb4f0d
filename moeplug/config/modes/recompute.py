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


def _gpu_swiglu_moe_act(f: Facts) -> None:
    # The swiglu experts' CUDA path is torch's grouped_mm autograd, which keeps the activation;
    # the other activations run moeplug.ops.grouped_ffn.grouped_mlp on every device.
    levers = expert_op_levers(f.cfg.model)
    if f.device == "cuda" and f.cfg.model.moe.activation == "swiglu" \
            and "recompute.modules" in levers:
        raise ConfigError(f"{f.device_field}: model.recompute.modules moe_act is not built into "
                          "the swiglu experts' CUDA path (torch's grouped_mm keeps the "
                          "activation), so it would be ignored. Fix: drop moe_act from "
                          "model.recompute.modules, or --set train.device=cpu")


_MOE_ACT = {"model": {"recompute": {"granularity": "selective", "modules": ["moe_act"]}}}
RULES = (
    Rule("recompute", "experts", "plugins.experts", _experts_rebuild_activation, _MOE_ACT),
    Rule("recompute", "device", "TrainConfig.device", _gpu_swiglu_moe_act, _MOE_ACT),
)
