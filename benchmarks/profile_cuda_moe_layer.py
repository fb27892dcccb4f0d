"""Where the MoE layer's fwd+bwd spends GPU time at the Qwen3-30B-A3B-like shape of
benchmarks/test_bench_cuda.py: a torch.profiler table of 3 steady-state steps (moeplug, then HF's
Qwen3-MoE block), kernels sorted by their own device time. A diagnostic, not a benchmark.

Run (on a GPU): python benchmarks/profile_cuda_moe_layer.py
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from benchmarks.test_bench_cuda import D, T, _qwen3_block, qwen3_layer  # noqa: E402


def main(rows: int = 22) -> None:
    torch.manual_seed(0)
    layer = qwen3_layer()
    hf = _qwen3_block(layer).to("cuda", torch.bfloat16)
    layer.to("cuda")
    layer.experts.to(torch.bfloat16)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

    def ours():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)[0]
        out.backward(dy)

    def theirs():
        out = hf(x.unsqueeze(0))
        (out[0] if isinstance(out, tuple) else out).backward(dy.unsqueeze(0))

    # Where the layer's step waits for the GPU: torch's sync detector, one warning per sync.
    import warnings
    for _ in range(2):
        ours()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        ours()
        torch.cuda.set_sync_debug_mode(0)
    # torch's own notice that the detector is a prototype comes as a warning too: not a sync.
    caught = [w for w in caught if "prototype feature" not in str(w.message)]
    print(f"==== moeplug: {len(caught)} host syncs in one fwd+bwd")
    for w in caught:
        print(f"  {w.filename}:{w.lineno}: {str(w.message)[:80]}")

    for name, step in (("moeplug", ours), ("hf_qwen3", theirs)):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(f"==== {name}: 3 steps")
        keys = prof.key_averages()
        for sort in ("self_device_time_total", "self_cuda_time_total"):
            try:
                print(keys.table(sort_by=sort, row_limit=rows, max_name_column_width=60))
                break
            except (AttributeError, KeyError, ValueError):
                continue


if __name__ == "__main__":
    main()
