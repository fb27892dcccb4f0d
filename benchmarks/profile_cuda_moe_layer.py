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
from benchmarks.cuda_profiling import (print_host_syncs, print_kernel_table,  # noqa: E402
                                        require_gpu)
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
    for _ in range(2):
        ours()
    print_host_syncs("moeplug", "one fwd+bwd", ours)

    for name, step in (("moeplug", ours), ("hf_qwen3", theirs)):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(f"==== {name}: 3 steps")
        print_kernel_table(prof, rows, width=60)


if __name__ == "__main__":
    require_gpu("profile_cuda_moe_layer.py")
    main()
