"""Measure a real CPU training run against the plan, both in the same processes.

    python -m moeplug.plan.measure CONFIG            # one process
    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m moeplug.plan.measure CONFIG               # a gloo layout (config's parallel section)

Each rank: trains a tiny model of the same architecture for two steps (warm-up), then the
config's model, and writes ``OUT_DIR/measured_rank{R}.json`` with the measured ``step_s`` /
``rss_delta`` and the plan's ``predicted_step_s`` / ``predicted_memory`` from the mean of two
calibrations of "this CPU" (moeplug.plan.calibrate_cpu), with their parts.

The run's steps come in two halves, each measuring one thing in the regime it needs:

- a first run of half the steps measures memory: glibc's mmap threshold pinned and moeplug's
  buffer cache emptied before each step, so a step's resident-set peak (VmHWM, which the
  trainer resets before each step) minus the resident set just before the model was built
  follows the bytes the step holds (see ``_pin_mmap_threshold``);
- then the threshold is released to where a long run leaves it, "this CPU" is calibrated, a
  second run of the model from its initialisation takes the other half of the steps as
  ``moeplug train`` runs them (its heap and buffer cache reused), and it is calibrated again:
  the two calibrations bracket the load the timed steps saw. Step time is process CPU seconds
  of one ``train_step``, the best of the second run's steps after its first two (packing, the
  heap's first growth); the wall time the trainer logs is kept as ``step_wall_s``. On a machine
  shared with other jobs wall time measures their load; CPU time measures the step.

Timed pinned, every tensor from 128 KiB is a fresh mapping whose pages fault in when first
written and are unmapped when it dies: 0.6-0.8 s of system time per step of the EP2 test layout,
a third of its CPU seconds, which ``moeplug train`` never pays, and which varied by rank and run
(tests/test_plan.py, 2026-12-02). The memory run comes first because a heap that has grown
under the released threshold keeps reusing its free blocks after the threshold is pinned again,
and the resident set would then measure them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import sys

import torch


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _timed_steps(memory: bool):
    """(process CPU seconds, wall seconds, resident-set peak) of each trainer.train_step call
    while active. The trainer resets the peak before each step, so the peak read right after
    one is that step's, not a later checkpoint's or evaluation's. ``memory``: the buffer cache
    is emptied before each step (the memory run of the module docstring)."""
    import time

    from moeplug.training import trainer
    from moeplug.training.memory import process_peak
    from moeplug.runtime import workspace
    real, steps, cached = trainer.train_step, [], []

    def timed(*args, **kwargs):
        if memory:
            # moeplug.runtime.workspace keeps freed activation buffers from 256 KiB mapped for
            # the next step (a reserve, like a CUDA caching allocator's). Emptied before each
            # step, the step's peak is what it holds and what the cache keeps of it within the
            # step: what the plan predicts (moeplug.plan.memory.calibrated_cpu_memory).
            cached.append(workspace.cached_bytes())
            workspace.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            steps.append((time.process_time() - c0, time.perf_counter() - w0,
                          process_peak(torch.device("cpu"))))
    trainer.train_step = timed
    try:
        yield steps, cached
    finally:
        trainer.train_step = real


def predict(path: str, costs):
    """The plan's step for the config at ``path`` on this CPU, calibrated by ``costs``."""
    import dataclasses

    from moeplug.plan import perf
    from moeplug.plan.cli import config_inputs
    from moeplug.plan.cluster import cpu_cluster
    from moeplug.plan.memory import Mapping, Options, calibrated_cpu_memory
    cfg, fields, opts, _ = config_inputs(path)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seq, per_dp = fields.pop("seq"), fields.pop("gbs_per_dp")
    dp = world // (fields["tp"] * fields["cp"] * fields["pp"])
    mp = Mapping(world=world, seq=seq, gbs=per_dp * dp, **fields)
    c = dataclasses.replace(cpu_cluster(world, peak_tflops=costs.peak_tflops), costs=costs)
    o = Options(**opts)
    return perf.step_time(cfg, mp, o, c), calibrated_cpu_memory(cfg, mp, o, costs)


_M_MMAP_THRESHOLD = -3


def _pin_mmap_threshold() -> None:
    """Tensors of 128 KiB and more get their own mapping, returned to the kernel when freed.
    glibc otherwise raises this threshold the first time such a block is freed, after which
    freed tensors stay in its heap: the resident set then measures the heap's fragmentation
    over the run's history, not the bytes the run holds, which is what the plan predicts."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


def _release_mmap_threshold() -> None:
    """The threshold a long run reaches: glibc raises it to the largest block freed, up to
    DEFAULT_MMAP_THRESHOLD_MAX (32 MiB on 64-bit), and freed tensors are reused from the heap."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 32 << 20)


def _return_free_memory() -> None:
    """Collect garbage and hand the heap's free pages back, so the resident set read next
    holds only live bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def main(path: str) -> int:
    _pin_mmap_threshold()
    import torch

    from moeplug.plugin_host import check_plugins, load_host as _load_host
    from moeplug.config import load_config
    from moeplug.data import prepare_corpus
    from moeplug.training import distributed as D
    from moeplug.plan.calibrate_cpu import calibrate_run
    from moeplug.training.memory import reset_process_peak
    from moeplug.training.trainer import seed_everything, train

    cfg = load_config(path)
    if cfg.train.steps < 6:  # before any process group or warm-up run
        raise SystemExit(f"moeplug.plan.measure: {path}: train.steps is {cfg.train.steps}; "
                         "set it to at least 6 (half the steps measure memory, the rest time)")
    host = _load_host(cfg)
    precision = check_plugins(host, cfg)
    groups = D.init_distributed(cfg)
    cpu = torch.device("cpu")
    try:
        corpus = prepare_corpus(cfg.data)
        names = {k: getattr(cfg.plugins, k) for k in ("router", "dispatcher", "experts",
                                                      "precision")}
        m = cfg.model
        small = dataclasses.replace(
            cfg, model=dataclasses.replace(m, hidden_size=8 * m.num_heads, kv_channels=0),
            train=dataclasses.replace(cfg.train, steps=2, warmup_steps=1, micro_batch_size=1,
                                      out_dir=os.path.join(cfg.train.out_dir, "warmup")))
        seed_everything(cfg.train.seed)
        train(small, D.build_rank_model(small, host, corpus.vocab_size, groups, cpu), corpus,
              precision, names, groups=groups)
        _return_free_memory()
        seed_everything(cfg.train.seed)
        reset_process_peak(cpu)  # the warm-up's own peak is not the run's
        before = _rss_now()
        half = cfg.train.steps // 2

        def run(n_steps: int, out_dir: str, memory: bool):
            run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(
                cfg.train, steps=n_steps, out_dir=out_dir))
            seed_everything(cfg.train.seed)
            model = D.build_rank_model(run_cfg, host, corpus.vocab_size, groups, cpu)
            with _timed_steps(memory) as (steps, cached):
                train(run_cfg, model, corpus, precision, names, groups=groups)
            return steps, cached
        memory_steps, cached = run(half, os.path.join(cfg.train.out_dir, "memory"), True)
        _release_mmap_threshold()
        from moeplug.runtime import workspace
        workspace.clear()  # the timed run fills its own cache, as ``moeplug train`` does
        _return_free_memory()
        # Calibrated before and after the timed run: the mean of the two brackets the load it
        # saw. Nothing of the calibration reads the resident set (its bytes are counted from
        # the tensors), so it is timed in the regime of the timed run.
        before_run = calibrate_run(cfg, host, corpus.vocab_size, groups, precision)
        time_steps, _ = run(cfg.train.steps - half, cfg.train.out_dir, False)
        costs = before_run.mean(calibrate_run(cfg, host, corpus.vocab_size, groups, precision))
    finally:
        D.shutdown(groups)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(cfg.train.out_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if '"train"' in line][-1]
    tc, par = cfg.train, cfg.parallel
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (par.tp * par.cp * par.pp)
    tokens = dp * tc.micro_batch_size * tc.seq_len * tc.grad_accum_steps
    pred, mem = predict(path, costs)
    timed = time_steps[2:]  # the first ones warm up (packing, the heap's first growth)
    out = {"rss_delta": max(p for _, _, p in memory_steps) - before,
           "step_s": min(c for c, _, _ in timed),
           "steps_cpu_s": [c for c, _, _ in memory_steps + time_steps],
           "step_wall_s": tokens / last["tokens_per_s"],
           "workspace_cached_before_step": max(cached),
           "predicted_step_s": pred.total, "predicted_parts": pred.parts,
           "predicted_memory": mem.total,
           "predicted_memory_parts": {"weights": mem.weights_grads, "optimizer": mem.optimizer,
                                      **mem.activations},
           "gemm_efficiency": {u: costs.gemm_efficiency(u) for u in costs.units
                               if costs.units[u].gemm_flops},
           "links": costs.links}
    with open(os.path.join(tc.out_dir, f"measured_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
