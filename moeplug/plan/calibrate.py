"""The published rows as planner inputs, and the one global fit of perf.CONSTANTS.

``fit`` minimises the summed squared log error of predicted vs published TFLOP/s over *all*
rows at once (coordinate descent, golden-section per constant, within physical bounds), so no
row gets a constant of its own; rows that still miss are reported, not tuned away.
"""

from __future__ import annotations

import math

from moeplug.config import ParallelConfig
from moeplug.plan import perf
from moeplug.plan.cluster import get_cluster
from moeplug.plan.memory import Mapping, Options
from moeplug.plan.models import Row, model_config, route_groups

# Physical bounds of each constant (GEMM efficiency of BF16 peak, FP8 speed-up over BF16,
# microseconds per layer and micro-batch).
BOUNDS = {"eff_hopper": (0.3, 0.9), "eff_blackwell": (0.3, 0.9), "fp8_speedup": (1.0, 2.0),
          "layer_overhead_us": (0.0, 3000.0)}


def row_inputs(row: Row):
    """(model config, mapping, options, cluster) of a published row."""
    cfg = model_config(row.model)
    # the published split (moeplug train's parallel fields) as the layout train runs
    layout = ParallelConfig(pp=row.pp, vpp=row.vpp, **row.split).layer_layout(
        cfg.num_layers, cfg.mtp_num_layers).text() if row.split else None
    mp = Mapping(world=row.gpus, tp=row.tp, cp=row.cp, pp=row.pp, ep=row.ep, vpp=row.vpp,
                 mbs=row.mbs, gbs=row.gbs, seq=row.seq, layout=layout)
    opt = Options(precision=row.precision, recompute=row.recompute, offload=row.offload,
                  a2a_overlap=row.a2a_overlap, dispatcher=row.dispatcher,
                  route_groups=route_groups(row.model))
    return cfg, mp, opt, get_cluster(row.cluster, row.gpus)


def target(row: Row) -> float:
    """Published TFLOP/s per GPU (an MFU row times its BF16 peak)."""
    return row.tflops or row.mfu * get_cluster(row.cluster).peak("bf16")


def predict(row: Row, constants: dict | None = None) -> perf.StepTime:
    cfg, mp, opt, c = row_inputs(row)
    return perf.step_time(cfg, mp, opt, c, constants)


def loss(rows, constants: dict) -> float:
    return _loss([(row_inputs(r), target(r)) for r in rows], constants)


def _loss(inputs, constants: dict) -> float:
    """``loss`` over rows already turned into (planner inputs, target): building a row's model
    config is ~40 % of a prediction, and the fit predicts every row thousands of times."""
    return sum(math.log(perf.step_time(*args, constants).tflops_per_gpu / t) ** 2
               for args, t in inputs)


def _golden_min(f, a: float, b: float, iters: int = 30) -> float:
    """Golden-section search for the minimum of ``f`` on [a, b]: each iteration shrinks the
    bracket by 1/phi and reuses one of the two interior values (one new evaluation)."""
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:  # the minimum lies in [a, d]; the old c becomes the new d
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:  # in [c, b]; the old d becomes the new c
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit(rows, start: dict | None = None, sweeps: int = 15) -> dict:
    inputs = [(row_inputs(r), target(r)) for r in rows]
    k = dict(start or perf.CONSTANTS)
    for _ in range(sweeps):
        for name, (lo, hi) in BOUNDS.items():
            k[name] = _golden_min(lambda x: _loss(inputs, {**k, name: x}), lo, hi)
    return k
