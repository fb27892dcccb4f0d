"""Where a GPU ``train_step`` spends its time: the model of benchmarks/test_bench_cuda.py's
``test_cuda_train_step_mfu`` (two Qwen3-shape MoE layers, bf16 parameters, fp32 main weights).
A diagnostic, not a benchmark. Prints, for the default router and for ``fused_cuda``:
- the host syncs of one step (torch's sync detector), by source line;
- the step's wall time and the optimizer step's (CUDA events);
- a torch.profiler table of 2 steady-state steps, kernels sorted by their own device time,
  and the device's busy time against the wall time.

Run (on a GPU): python benchmarks/profile_cuda_train_step.py
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from benchmarks.cuda_profiling import (print_host_syncs, print_kernel_table,  # noqa: E402
                                        require_gpu)
from benchmarks.test_bench_cuda import cuda_train_step_setup, set_fused_cuda  # noqa: E402


def _timed(fn, times: list):
    def run(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        times.append((start, end))
        return out
    return run


def main(rows: int = 25) -> None:
    from moeplug.training import trainer
    cfg, model, opt, precision, batches, step_flop, routers = cuda_train_step_setup()
    opt_times: list = []
    opt.step = _timed(opt.step, opt_times)

    def step():
        trainer.train_step(model, opt, batches, cfg.train, precision)

    for fused in (False, True):
        set_fused_cuda(routers, fused)
        name = "fused_cuda router" if fused else "torch router"
        for _ in range(2):
            step()
        print_host_syncs(name, "one train_step", step)
        torch.cuda.synchronize()
        opt_times.clear()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3
        opt_ms = sum(s.elapsed_time(e) for s, e in opt_times) / len(opt_times)
        print(f"==== {name}: step {wall * 1e3:.1f} ms ({step_flop / wall / 1e12:.0f} model "
              f"TFLOP/s); optimizer.step {opt_ms:.1f} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        keys = prof.key_averages()
        busy = sum(getattr(k, "self_device_time_total", getattr(k, "self_cuda_time_total", 0))
                   for k in keys if k.device_type == torch.autograd.DeviceType.CUDA)
        print(f"==== {name}: 2 steps, device busy {busy / 2e3:.1f} ms per step "
              f"(kernels' own time, µs sum / 2)")
        print_kernel_table(prof, rows)
        print(keys.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    require_gpu("profile_cuda_train_step.py")
    main()
