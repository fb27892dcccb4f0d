"""parallel.fsdp (moeplug.parallel.fsdp): what it cannot be combined with. ZeRO-1 is the
alternative to it; combined 1F1B runs a second backward beside its hooks; the rest is a part of
moeplug that reads or writes parameters outside their module's forward, where fully_shard
leaves only this rank's shard, or that keeps its own copy of them. (Against the world size:
ParallelConfig.resolve.)"""

from __future__ import annotations

from typing import Any, Callable

from moeplug.config._checks import _fail
from moeplug.config.modes._rule import Facts, Rule


def _rule(bad: Callable[[Any], bool], rule: Callable[[Any], str], fix: str):
    def check(f: Facts) -> None:
        p = f.cfg.parallel
        if p.fsdp and bad(f.cfg):
            _fail(p, "fsdp", True, rule(f.cfg), f"{fix}, or fsdp: false")
    return check


_FSDP = {"parallel": {"fsdp": True}}
RULES = (
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.parallel.distributed_optimizer,
        lambda c: "shards the AdamW state itself; ZeRO-1 (distributed_optimizer) is the "
                  "alternative to it, not an addition",
        "set distributed_optimizer: false"), {"parallel": {"fsdp": True,
                                                           "distributed_optimizer": True}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.parallel.overlap_moe_expert_parallel_comm,
        lambda c: "gathers and reduces each block's parameters in hooks of one backward at a "
                  "time; overlap_moe_expert_parallel_comm runs a micro-batch's backward on a "
                  "second thread beside the next forward",
        "set overlap_moe_expert_parallel_comm: false"),
        {"parallel": {"fsdp": True, "overlap_moe_expert_parallel_comm": True},
         "train": {"grad_accum_steps": 2}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.train.bf16_params,
        lambda c: f"keeps fp32 sharded parameters and gathers them in the precision recipe's "
                  f"dtype; bf16 parameters (train.master_dtype {c.train.master_dtype!r}, "
                  f"param_dtype {c.train.param_dtype!r}) are another recipe for the same memory",
        "set train.master_dtype and train.param_dtype: fp32"),
        {**_FSDP, "train": {"master_dtype": "bf16"}, "plugins": {"precision": "bf16"}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.train.optimizer_dtype == "bf16",
        lambda c: "runs torch's AdamW on the sharded parameters; the bf16-moments AdamW "
                  "(train.optimizer_dtype: bf16) does not take sharded tensors",
        "set train.optimizer_dtype: fp32"), {**_FSDP, "train": {"optimizer_dtype": "bf16"}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.runtime.sync_free,
        lambda c: "leaves each expert weight sharded outside the experts' forward; the "
                  "sync-free region (runtime.sync_free) reads the whole weights itself",
        "set runtime.sync_free: false"), {**_FSDP, "runtime": {"sync_free": True}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.runtime.stash,
        lambda c: "leaves each expert weight sharded outside the experts' forward; the paged "
                  "stash (runtime.stash) registers the experts' parameters itself",
        "set runtime.stash: false"), {**_FSDP, "runtime": {"stash": True}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.model.moe.delay_wgrad_compute,
        lambda c: "reduce-scatters a block's weight gradients when its backward ends; "
                  "model.moe.delay_wgrad_compute computes them later",
        "set model.moe.delay_wgrad_compute: false"),
        {**_FSDP, "model": {"moe": {"delay_wgrad_compute": True}}}),
    Rule("fsdp", "config", "ParallelConfig.fsdp", _rule(
        lambda c: c.parallel.pp > 1 and c.model.tie_embeddings,
        lambda c: "cannot sum the last pipeline stage's copy of the tied embedding into the "
                  "first stage's (their grads are sharded by different stages)",
        "set model.tie_embeddings: false, or pp: 1"),
        {**_FSDP, "parallel": {"fsdp": True, "pp": 2}, "model": {"tie_embeddings": True,
                                                               "num_layers": 4}}),
)
