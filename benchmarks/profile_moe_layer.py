"""Where the MoE layer's CPU time goes: a torch profile of its fwd+bwd at the standard shape.

Shape: T=4096 tokens, D=1024, F=1408, E=16 experts, top-4 (benchmarks/test_bench_moe_layer.py's
grouped layer, same weights' scale). Three steady-state steps after three warm-up steps; prints
the ops by self CPU time, then the casts (aten::copy_) by input shape: the experts' weight
casts are those of [2F, D] and [D, F].

Run: python benchmarks/profile_moe_layer.py [autocast|bf16_weights|fp32]
    autocast      bf16 autocast over fp32 weights (plugins.precision: bf16), the default
    bf16_weights  expert weights and input in bf16 under autocast (Megatron's bf16 module)
    fp32          no autocast
A diagnostic, not a benchmark: the profiler's own overhead is in the times.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.test_bench_moe_layer import D, T, _moeplug_layer
from moeplug.plugin_host import PluginHost

MODES = ("autocast", "bf16_weights", "fp32")


def main(mode: str) -> None:
    if mode not in MODES:
        raise SystemExit(f"mode {mode!r}: want one of {', '.join(MODES)}")
    torch.manual_seed(0)
    layer = _moeplug_layer(PluginHost.load(), "grouped")
    with torch.no_grad():
        for w in (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
            w.normal_(0.0, 0.02)
    x, g = torch.randn(T, D), torch.randn(T, D)
    if mode == "bf16_weights":
        layer.experts.to(torch.bfloat16)
        x, g = x.bfloat16(), g.bfloat16()
    x.requires_grad_(True)

    def step() -> None:
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
            out = layer(x)[0]
        out.backward(g)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    total = sum(e.self_cpu_time_total for e in averages)
    print("aten::copy_ (casts) by input shape, share of the total self CPU time:")
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::copy_":
            print(f"  {e.input_shapes}  x{e.count // 3} a step  "
                  f"{e.self_cpu_time_total / total:.1%}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "autocast")
