"""The emulated low-precision recipes (moeplug.quant) against bf16, on one MoE layer.

    step time   forward+backward of MoELayer(topk, alltoall, grouped) under each recipe's
                autocast + block scope, timed interleaved with bf16; reported as
                bf16 time / recipe time (emulation costs time: < 1 means slower than bf16)
    wire bytes  bytes per token that the alltoall dispatcher puts on the wire under each recipe,
                measured by moeplug.quant.wire.WIRE on a real dispatch, against bf16 rows
                (K rows of 2*D bytes per token); allgather does not quantize (bf16, one row of
                2*D bytes per token), reported for comparison

    wire bytes  per dispatcher (alltoall, allgather) and recipe, on 2 real gloo ranks (EP2):
    per dispatcher  every byte this rank hands to a collective in one forward (dispatch + combine)
                and one backward, counted from the process-group calls themselves (a dispatch
                trace, moeplug.plan.calibrate_cpu.trace_collectives), per token of the rank;
                rows, scales, routing metadata and counts all included

Run: pytest -q benchmarks/test_bench_precision.py -s -k "not 300_steps"   (2-3 min on 2 cores)
"""

from __future__ import annotations

import torch

from benchmarks.conftest import interleave
from moeplug.config import ModelConfig, MoEConfig
from moeplug.moe import MoELayer
from moeplug.plugin_host import PluginHost
from moeplug.quant import block_scope
from moeplug.quant.wire import WIRE, reset_wire

T, D, F, E, K = 1024, 512, 704, 8, 2
RECIPES = ("fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4")


def _layer(host: PluginHost) -> MoELayer:
    m = ModelConfig(hidden_size=D, num_heads=8, num_kv_heads=8, num_layers=1, first_k_dense=0,
                    moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F))
    d = host.create("dispatcher", "alltoall", {}, m, None)
    return MoELayer(host.create("router", "topk", {}, m), d,
                    host.create("experts", "grouped", {}, m, E))


def _step(layer, precision, x, g):
    def run():
        layer.zero_grad(set_to_none=True)
        with precision.autocast("cpu"), block_scope(0, 1):
            y = layer(x)[0]
        y.float().backward(g)
    return run


def test_emulated_recipes_step_time_and_wire_bytes(report):
    torch.manual_seed(0)
    host = PluginHost.load()
    layer = _layer(host)
    x, g = torch.randn(T, D), torch.randn(T, D)
    precisions = {n: host.create("precision", n, {}) for n in ("bf16",) + RECIPES}
    times = interleave({n: _step(layer, p, x, g) for n, p in precisions.items()}, repeats=3)
    bf16_bytes = K * 2 * D
    report.row("precision", "allgather bytes/token (bf16)", 2 * D, unit="B")
    for n in RECIPES:
        report.row("precision", f"{n} step time vs bf16", times["bf16"] / times[n],
                   note=f"{times[n] * 1e3:.0f} ms vs {times['bf16'] * 1e3:.0f} ms")
        reset_wire()
        _step(layer, precisions[n], x, g)()
        per_token = WIRE["bytes"] / T
        assert WIRE["rows"] == T * K
        report.row("precision", f"{n} alltoall bytes/token", per_token, unit="B",
                   note=f"bf16: {bf16_bytes} B ({bf16_bytes / per_token:.2f}x more)")


def _ep2_wire(rank: int, world: int) -> dict:
    """Bytes per token this rank puts into collectives, per dispatcher and recipe (EP2)."""
    import torch.distributed as dist

    from moeplug.plan.calibrate_cpu import trace_collectives
    host = PluginHost.load()
    m = ModelConfig(hidden_size=D, num_heads=8, num_kv_heads=8, num_layers=1, first_k_dense=0,
                    moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F))
    tokens = T // 4  # per rank
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(tokens, D, generator=gen), torch.randn(tokens, D, generator=gen)
    out = {}
    for disp in ("alltoall", "allgather"):
        torch.manual_seed(0)
        d = host.create("dispatcher", disp, {}, m, dist.group.WORLD)
        layer = MoELayer(host.create("router", "topk", {}, m), d,
                         host.create("experts", "grouped", {}, m, d.num_local_experts))
        for name in ("bf16",) + RECIPES:
            precision = host.create("precision", name, {})
            xr = x.clone().requires_grad_()
            with precision.autocast("cpu"), block_scope(0, 1):
                fwd = trace_collectives(lambda: layer(xr))
            with precision.autocast("cpu"), block_scope(0, 1):
                y = layer(xr)[0]
            bwd = trace_collectives(lambda: y.float().backward(g))
            out[(disp, name)] = (sum(b for _, b in fwd) / tokens, sum(b for _, b in bwd) / tokens)
    return out


def test_wire_bytes_per_token_per_dispatcher_and_recipe(report):
    from moeplug.testing.distributed import run_distributed
    ranks = run_distributed(_ep2_wire, 2, timeout=600)
    for (disp, name), (fwd, bwd) in ranks[0].items():
        bf16_fwd = ranks[0][(disp, "bf16")][0]
        report.row("precision wire (EP2, rank 0)", f"{disp} {name} bytes/token fwd", fwd,
                   unit="B", note=f"backward {bwd:.0f} B; bf16 fwd / this "
                                  f"{bf16_fwd / fwd:.2f}x")
        if disp == "alltoall" and name != "bf16":  # rows go quantized: fewer bytes than bf16
            assert fwd < bf16_fwd, (name, fwd, bf16_fwd)
        if disp == "allgather":  # allgather does not quantize
            assert fwd == bf16_fwd, (name, fwd, bf16_fwd)


# ---- 300 steps of the default model per recipe, against bf16 ---------------------------------
# Final validation loss at most these nats above bf16's (measured on 2 shared cores: see
# README). One-sided: a recipe that ends below bf16 tracks it too. Other numerics move this
# tiny model's 300-step loss both ways by more than the bounds (2026-11-28, one run each: fp32
# 4.720, bf16 4.738, the five recipes 4.662-4.717), so a two-sided bound failed on runs that
# were fine.
VAL_TOLERANCE = {"fp8_tensorwise": 0.05, "fp8_delayed": 0.1, "fp8_blockwise": 0.05,
                 "mxfp8": 0.05, "nvfp4": 0.15}


def test_default_model_300_steps_per_recipe_tracks_bf16(tmp_path, report):
    """`moeplug train` (the default config, 300 steps) once per recipe and once in bf16, then
    `moeplug plot loss` draws the curves (loss.png in the bf16 run). About 40 minutes."""
    import subprocess
    import sys

    from moeplug.training.metrics import read_metrics

    runs = {}
    for name in ("bf16",) + RECIPES:
        runs[name] = out = tmp_path / name
        subprocess.run([sys.executable, "-m", "moeplug", "train", "--precision", name,
                        "--set", "train.steps=300", "--out", str(out)], check=True,
                       capture_output=True)
    png = tmp_path / "loss.png"
    subprocess.run([sys.executable, "-m", "moeplug", "plot", "loss", "--out", str(png),
                    *map(str, runs.values())], check=True, capture_output=True)
    assert png.stat().st_size > 0
    # The tolerance is stated (and was measured) for the last evaluation; the largest gap along
    # the curve (steps 100, 200, 300) is reported beside it.
    val = {n: {r["step"]: r["val_loss"] for r in read_metrics(str(d / "metrics.jsonl"))
               if r["kind"] == "val"} for n, d in runs.items()}
    for name in RECIPES:
        gaps = {s: val[name][s] - val["bf16"][s] for s in val["bf16"]}
        worst = max(gaps, key=lambda s: abs(gaps[s]))
        report.row("precision", f"{name} 300-step val loss - bf16", gaps[max(gaps)], unit="",
                   note=f"{val[name][max(gaps)]:.4f} vs {val['bf16'][max(gaps)]:.4f}; "
                        f"largest |gap| {gaps[worst]:+.4f} at step {worst}")
        assert gaps[max(gaps)] < VAL_TOLERANCE[name], (name, gaps)
