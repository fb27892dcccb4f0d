"""Overlap: model.moe.overlap_chunks (moeplug.moe.overlap: each micro-batch's tokens in chunks,
one chunk's exchange beside another's experts) and combined 1F1B,
parallel.overlap_moe_expert_parallel_comm (moeplug.parallel.schedules: one micro-batch's
backward on a helper thread beside the next one's forward)."""

from __future__ import annotations

from moeplug.config._checks import ConfigError, _fail
from moeplug.config.modes._rule import Facts, Rule


def chunked_region_blocker(*, device: str, capture: bool, recipe: str | None) -> str | None:
    """Why the chunked sync-free region cannot run here (None: it can). It pipelines the eager
    CPU region in fp32 or bf16 only: captured, it is compiled whole; under a recipe it runs
    through the recipe's op; on a GPU the GPU's region runs. The config rules below and the
    layer built without a config (moeplug.moe.overlap) both ask this."""
    if capture:
        return "runtime.capture compiles the region whole"
    if recipe is not None:
        return f"plugins.precision = {recipe!r} runs the region through its recipe"
    if device.startswith("cuda"):
        return f"train.device = {device!r} runs the GPU's region"
    return None


def _chunked_sync_free(f: Facts) -> None:
    cfg = f.cfg
    chunks = cfg.model.moe.overlap_chunks
    if not (cfg.runtime.sync_free and isinstance(chunks, int) and chunks > 1):
        return
    # Silently ignoring one of the two switches would hide it: refused.
    precision = cfg.plugins.precision
    where = chunked_region_blocker(device=cfg.train.device, capture=bool(cfg.runtime.capture),
                                   recipe=None if precision in ("fp32", "bf16") else precision)
    if where is not None:
        _fail(cfg.model.moe, "overlap_chunks", chunks, f"pipelines the sync-free region eagerly "
              f"on the CPU in fp32 or bf16 only; {where}, unchunked",
              "set model.moe.overlap_chunks: 1, or runtime.sync_free: false")


def _gpu_chunked_sync_free(f: Facts) -> None:
    chunks = f.cfg.model.moe.overlap_chunks
    if f.device == "cuda" and f.cfg.runtime.sync_free and chunks > 1:
        raise ConfigError(f"{f.device_field}: model.moe.overlap_chunks = {chunks} pipelines "
                          "the CPU's sync-free region only; a GPU's runs unchunked. Fix: set "
                          "model.moe.overlap_chunks: 1, runtime.sync_free: false, or "
                          "--set train.device=cpu")


# Combined 1F1B composes with every layout: TP/SP, CP (both cp_comm modes), EP/ETP and DP
# collectives (MLA's and MTP's included) all pass their group through
# moeplug.parallel.comm.active_group, which puts the overlapped backward's on the twin groups;
# PP's tagged p2p messages match by tag whichever thread sends them (moeplug.parallel.schedules).
_1F1B = "overlap_moe_expert_parallel_comm"


def _1f1b_two_micro_batches(f: Facts) -> None:
    par, train = f.cfg.parallel, f.cfg.train
    if par.overlap_moe_expert_parallel_comm is True and train.grad_accum_steps < 2:
        _fail(par, _1F1B, True, f"needs two micro-batches in flight, but "
              f"train.grad_accum_steps = {train.grad_accum_steps}",
              f"set train.grad_accum_steps >= 2 or {_1F1B}: false")


def _1f1b_recompute_jitter(f: Facts) -> None:
    par, rc = f.cfg.parallel, f.cfg.model.recompute
    if par.overlap_moe_expert_parallel_comm is not True:
        return
    jitter = f.cfg.plugins.router_options.get("input_jitter_eps", 0.0)
    recomputes = rc.granularity == "full" or bool(rc.modules)
    if isinstance(jitter, (int, float)) and jitter > 0 and recomputes:
        # A recompute replays the forward's RNG state on the helper thread (set, run, restore)
        # while this thread's forward draws the jitter from the same global generator: the
        # forward's draws would depend on the threads' timing.
        _fail(par, _1F1B, True, f"cannot be combined with recompute while the router draws "
              f"input jitter (plugins.router_options.input_jitter_eps = {jitter}: the "
              f"overlapped backward's recompute replays torch's global RNG while the forward "
              f"draws from it)", f"set plugins.router_options.input_jitter_eps: 0, recompute "
              f"nothing (model.recompute.granularity: selective, modules: []) or {_1F1B}: false")


def _1f1b_not_with_stash(f: Facts) -> None:
    par = f.cfg.parallel
    if par.overlap_moe_expert_parallel_comm is True and f.cfg.runtime.stash:
        _fail(par, _1F1B, True, "cannot be combined with runtime.stash (the stash pool serves "
              "one forward or backward at a time)", f"set runtime.stash: false or {_1F1B}: false")


_CHUNKED = {"model": {"moe": {"overlap_chunks": 2}}, "runtime": {"sync_free": True}}
_COMBINED = {"parallel": {_1F1B: True}, "train": {"grad_accum_steps": 2}}
RULES = (
    Rule("overlap", "config", "ParallelConfig.overlap_moe_expert_parallel_comm",
         _1f1b_two_micro_batches, {"parallel": {_1F1B: True}, "train": {"grad_accum_steps": 1}}),
    Rule("overlap", "config", "ParallelConfig.overlap_moe_expert_parallel_comm",
         _1f1b_recompute_jitter, {**_COMBINED, "model": {"recompute": {"granularity": "full"}},
                                  "plugins": {"router_options": {"input_jitter_eps": 0.01}}}),
    Rule("overlap", "config", "ParallelConfig.overlap_moe_expert_parallel_comm",
         _1f1b_not_with_stash, {**_COMBINED, "runtime": {"stash": True}}),
    Rule("overlap", "config", "MoEConfig.overlap_chunks", _chunked_sync_free,
         {**_CHUNKED, "train": {"device": "cuda"}}),
    Rule("overlap", "device", "TrainConfig.device", _gpu_chunked_sync_free, _CHUNKED),
)
