"""runtime.capture (moeplug.runtime.syncfree, moeplug.moe.capture): the sync-free region compiled
(torch.compile fullgraph on the CPU) or recorded as CUDA graphs, then replayed every step."""

from __future__ import annotations

from moeplug.config._checks import ConfigError, _fail
from moeplug.config.model import expert_op_levers
from moeplug.config.modes._rule import Facts, Rule, missing_capability


def _not_with_stash(f: Facts) -> None:
    rt = f.cfg.runtime
    if rt.capture and rt.stash:
        _fail(rt, "capture", rt.capture, "cannot combine with runtime.stash (the captured "
              "region keeps its saved tensors in its own compiled graph)",
              "set runtime.stash: false, or capture: false")


def _needs_sync_free(f: Facts) -> None:
    rt = f.cfg.runtime
    if rt.capture and not rt.sync_free:
        _fail(rt, "capture", rt.capture, "needs runtime.sync_free: true (only a region with "
              "static shapes and no host sync can be captured and replayed)",
              "set runtime.sync_free: true, or capture: false")


def _fp32_or_bf16(f: Facts) -> None:
    rt, precision = f.cfg.runtime, f.cfg.plugins.precision
    if rt.sync_free and rt.capture and precision not in ("fp32", "bf16"):
        _fail(rt, "capture", True, f"compiles the sync-free region in fp32 or bf16 only; "
              f"plugins.precision = {precision!r} runs it eagerly",
              "set runtime.capture: false, or plugins.precision: fp32 or bf16")


def _ignores_expert_op_levers(key: str):
    # The eager CPU static region (moeplug.moe.budgeted.arena) keeps FC1's output, never the
    # activation (moe_act recompute is its only mode), and notes its saved tensors for the
    # expert offload names. The captured region is compiled: inductor decides what it keeps and
    # no saved-tensor hook sees inside, so either switch would do nothing there. (A GPU's
    # region: sync_free.py's device rule.)
    def check(f: Facts) -> None:
        rt, m = f.cfg.runtime, f.cfg.model
        if not (rt.sync_free and rt.capture):
            return
        names = expert_op_levers(m).get(key)
        if not names:
            return
        obj, field_name = (m.recompute, "modules") if key == "recompute.modules" else (m, "offload")
        what = " and ".join(names) + (" acts" if len(names) == 1 else " act")
        _fail(obj, field_name, getattr(obj, field_name), f"{what} inside the expert ops; "
              f"runtime.capture compiles the sync-free region, which would ignore "
              f"{'it' if len(names) == 1 else 'them'}", f"drop {' and '.join(names)} "
              f"from model.{key}, or set runtime.capture: false")
    return check


def missing_capturable(experts: type) -> str | None:
    """What ``experts`` (an Experts class) lacks for runtime.capture: one line, or None."""
    return missing_capability(
        experts, "capturable", "runtime.capture", "its forward on budget rows is compiled "
        "whole, torch.compile fullgraph, or recorded as a CUDA graph", "it is")


def _experts_capturable(f: Facts) -> None:
    rt = f.cfg.runtime
    # A backend without budget_rows is refused by sync_free.py's rule, whose fix (another
    # backend, or sync_free off) covers this one too: one line per backend.
    if rt.sync_free and rt.capture and f.experts.budget_rows:
        missing = missing_capturable(f.experts)
        if missing is not None:
            raise ConfigError(f"plugins.experts = {f.cfg.plugins.experts!r}: {missing}")


_CAPTURED = {"runtime": {"sync_free": True, "capture": True}}
_MOE_ACT = {"granularity": "selective", "modules": ["moe_act"]}
RULES = (
    Rule("capture", "config", "RuntimeSection.capture", _not_with_stash,
         {"runtime": {"sync_free": True, "capture": True, "stash": True}}),
    Rule("capture", "config", "RuntimeSection.capture", _needs_sync_free,
         {"runtime": {"capture": True}}),
    Rule("capture", "config", "RuntimeSection.capture", _fp32_or_bf16,
         {**_CAPTURED, "plugins": {"precision": "fp8_tensorwise"}}),
    Rule("capture", "config", "RecomputeConfig.modules",
         _ignores_expert_op_levers("recompute.modules"), {**_CAPTURED, "model": {"recompute": _MOE_ACT}}),
    Rule("capture", "config", "ModelConfig.offload", _ignores_expert_op_levers("offload"),
         {**_CAPTURED, "model": {"offload": ["expert_fc1"]}}),
    Rule("capture", "experts", "plugins.experts", _experts_capturable, _CAPTURED,
         declares={"budget_rows": True}),
)
