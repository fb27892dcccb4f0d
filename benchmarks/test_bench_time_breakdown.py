"""What the always-on per-stage time breakdown (moeplug.observability.timing) costs.

One process runs the real ``train_step`` of a small MoE model with the breakdown on
(``measure_stages(True)``: every stage marker reads the clock twice) and off
(``measure_stages(False)``: a marker is a compile check and a ContextVar lookup), interleaved
round-robin in one run so machine drift hits both alike. Reported: off / on median step time
(1.0 = free) and the breakdown itself, so the figure and what it measures come from the same
steps.

On a shared machine the step ratio's noise (a few %) dwarfs the markers' cost, so a second row
bounds it precisely: one marker's measured cost times the markers one step passes through, as
a share of the step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.conftest import interleave
from moeplug.observability.timing import STAGES, measure_stages, stage

MICRO, LAYERS = 2, 2
# Markers per step: per micro-batch, attention per layer, router/dispatch/experts/combine per
# MoE layer and one backward; then clipping and the optimizer step, and the logging reduction.
MARKERS_PER_STEP = MICRO * (LAYERS + 4 * LAYERS + 1) + 3


def _setup():
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)
    cfg = config_from_dict({
        "model": {"hidden_size": 128, "num_layers": LAYERS, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 128, "first_k_dense": 0, "dense_ffn_hidden_size": 128,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 128}},
        "train": {"steps": 100, "micro_batch_size": 4, "seq_len": 128, "warmup_steps": 1,
                  "grad_accum_steps": MICRO},
    })
    torch.set_num_threads(1)  # a shared machine: more threads only add scheduling noise
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    seed_everything(0)
    model = build_model(cfg, host, 256)
    opt = build_rank_optimizer(model, cfg)
    ids = np.random.default_rng(0).integers(0, 256, 100_000).astype(np.int64)
    batches = step_batches(ids, cfg.train, 0)
    last: dict = {}

    def step(enabled: bool):
        def run():
            with measure_stages(enabled) as times:
                train_step(model, opt, batches, cfg.train, precision)
            if times:
                last.update(times)
        return run
    return step, last


def test_time_breakdown_overhead(report):
    step, last = _setup()
    times = interleave({"off": step(False), "on": step(True)}, repeats=21, warmup=3)
    ratio = times["off"] / times["on"]
    shares = ", ".join(f"{s} {last[s] / last['step']:.0%}" for s in (*STAGES, "other"))
    print(f"\nstep {times['off'] * 1e3:.1f} ms off, {times['on'] * 1e3:.1f} ms on "
          f"(off / on = {ratio:.3f}); last step: {shares}")
    report.row("time breakdown", "step time off / on", ratio, target=0.97,
               note=f"{times['on'] * 1e3:.1f} ms/step on; 1.0 = no overhead")
    assert abs(sum(last[s] for s in STAGES) + last["other"] - last["step"]) < 1e-9


def _marker_seconds(n: int = 200_000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        with stage("router"):
            pass
    return (time.perf_counter() - start) / n


def test_marker_cost_per_step(report):
    step, _ = _setup()
    step_s = interleave({"on": step(True)}, repeats=5, warmup=1)["on"]
    off_s = _marker_seconds()  # no clock active
    with measure_stages():
        on_s = _marker_seconds()
    share = MARKERS_PER_STEP * on_s / step_s
    print(f"\nmarker {on_s * 1e9:.0f} ns on, {off_s * 1e9:.0f} ns off; {MARKERS_PER_STEP} per "
          f"{step_s * 1e3:.1f} ms step = {share:.2e} of the step")
    report.row("time breakdown", "marker time / step time", 100 * share, unit="%",
               note=f"{MARKERS_PER_STEP} markers x {on_s * 1e9:.0f} ns per step")
    assert share < 0.01
