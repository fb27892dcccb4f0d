"""model.moe.delay_wgrad_compute (moeplug.ops.delayed_wgrad): the grouped experts' backward queues
its weight-gradient GEMMs to run during the dispatch's backward exchange. The split backward
lives in the grouped experts' fp32/bf16 CPU ops (moeplug.ops expert_mlp, grouped_mlp); every
other path computes its weight gradients inside torch's autograd, where they cannot be moved
behind the exchange."""

from __future__ import annotations

from moeplug.config._checks import ConfigError, _fail
from moeplug.config.modes._rule import Facts, Rule

_NAME = "delay_wgrad_compute"


def _on(f: Facts) -> bool:
    return f.cfg.model.moe.delay_wgrad_compute is True


def _grouped_experts(f: Facts) -> None:
    experts = f.cfg.plugins.experts
    if _on(f) and experts != "grouped":
        _fail(f.cfg.model.moe, _NAME, True, f"needs the grouped experts backend (its op splits "
              f"the backward), not plugins.experts = {experts!r}",
              f"set plugins.experts: grouped or {_NAME}: false")


def _fp32_or_bf16(f: Facts) -> None:
    precision = f.cfg.plugins.precision
    if _on(f) and precision not in ("fp32", "bf16"):
        _fail(f.cfg.model.moe, _NAME, True, f"splits the fp32/bf16 expert GEMMs; "
              f"plugins.precision = {precision!r} runs the experts through its own quantized op",
              f"set plugins.precision: fp32 or bf16, or {_NAME}: false")


def _not_sync_free(f: Facts) -> None:
    if _on(f) and f.cfg.runtime.sync_free:
        _fail(f.cfg.model.moe, _NAME, True, "is not built into the static sync-free region "
              "(runtime.sync_free runs its own expert backward)",
              f"set runtime.sync_free: false or {_NAME}: false")


def _not_with_stash(f: Facts) -> None:
    if _on(f) and f.cfg.runtime.stash:
        # The stash hands the experts' saved tensors back as views of its pages and frees the
        # pages when autograd drops them - right after the dgrad, before the deferred weight
        # GEMMs read them.
        _fail(f.cfg.model.moe, _NAME, True, "cannot be combined with runtime.stash (its pages "
              "return to the pool when the experts' backward node ends; the delayed weight "
              "GEMMs read them later)", f"set runtime.stash: false or {_NAME}: false")


def _cpu_only(f: Facts) -> None:
    device = f.cfg.train.device
    if _on(f) and device.startswith("cuda"):
        _fail(f.cfg.model.moe, _NAME, True, f"is implemented for the CPU expert ops only (on "
              f"CUDA the experts use torch's grouped_mm autograd), but train.device = "
              f"{device!r}", f"set train.device: cpu or {_NAME}: false")


def _cpu_only_resolved(f: Facts) -> None:
    # train.device auto resolves to a GPU only at launch, where the config cannot see it.
    if f.device == "cuda" and f.cfg.model.moe.delay_wgrad_compute:
        raise ConfigError(f"{f.device_field}: model.moe.delay_wgrad_compute runs in the CPU "
                          "expert ops only. Fix: set model.moe.delay_wgrad_compute: false, or "
                          "--set train.device=cpu")


_DELAY = {"model": {"moe": {_NAME: True}}}
RULES = (
    Rule("delay_wgrad", "config", "MoEConfig.delay_wgrad_compute", _grouped_experts,
         {**_DELAY, "plugins": {"experts": "sequential"}}),
    Rule("delay_wgrad", "config", "MoEConfig.delay_wgrad_compute", _fp32_or_bf16,
         {**_DELAY, "plugins": {"precision": "fp8_tensorwise"}}),
    Rule("delay_wgrad", "config", "MoEConfig.delay_wgrad_compute", _not_sync_free,
         {**_DELAY, "runtime": {"sync_free": True}}),
    Rule("delay_wgrad", "config", "MoEConfig.delay_wgrad_compute", _not_with_stash,
         {**_DELAY, "runtime": {"stash": True}}),
    Rule("delay_wgrad", "config", "MoEConfig.delay_wgrad_compute", _cpu_only,
         {**_DELAY, "train": {"device": "cuda"}}),
    Rule("delay_wgrad", "device", "TrainConfig.device", _cpu_only_resolved, _DELAY),
)
