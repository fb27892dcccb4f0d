"""Throughput accounting: measured dense-GEMM peak, achieved TFLOP/s and MFU.

MFU here is "model FLOPs utilisation against what this machine's dense GEMM actually reaches",
not against a datasheet number: on CPUs the datasheet peak is rarely known, and a measured
square matmul in the same dtype and thread count is the honest ceiling for GEMM-bound training.
The trainer measures it at start-up and again whenever a logged MFU reads above 100 % (the
first measure ran beside other work: a compile, another run), keeping the best.
"""

from __future__ import annotations

import statistics
import time

import torch


def measure_peak_tflops(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        size: int | None = None, budget_s: float = 0.5,
                        min_repeats: int = 3) -> float:
    """Median TFLOP/s of a ``size x size`` matmul in ``dtype`` on ``device`` (the run's: MFU
    is against the device that trains), timed for about ``budget_s``.

    One warm-up call first (thread pool start-up, packing buffers, kernel selection), then
    repeated timings; the median is robust to another process stealing the core for one sample.
    ``size`` defaults to 512 on a CPU and 4096 on an accelerator, whose peak small GEMMs miss.
    """
    device = torch.device(device)
    size = size or (512 if device.type == "cpu" else 4096)
    a_NN = torch.randn(size, size).to(device, dtype)
    b_NN = torch.randn(size, size).to(device, dtype)

    def sync() -> None:  # accelerator kernels are asynchronous: time them to completion
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    torch.mm(a_NN, b_NN)
    sync()
    flops = 2.0 * size ** 3
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_repeats or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        torch.mm(a_NN, b_NN)
        sync()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 1000:
            break
    return flops / statistics.median(samples) / 1e12


def slow_bf16_note(bf16_peak: float, device: torch.device | str) -> str | None:
    """A warning when this CPU runs bf16 matmuls below half its fp32 speed, else None.

    oneDNN has fast bf16 GEMMs only with AVX-512 (native with ``avx512_bf16``/AMX); on an
    AVX2-only CPU it emulates them some 60x slower than fp32 (measured on an AMD EPYC
    reporting AVX2: 0.0014 vs 0.085 TFLOP/s at 512), so ``plugins.precision: bf16`` there
    trains far slower than fp32, and MFU against the bf16 peak can read above 100 % (the
    model's fp32 ops outrun the emulated GEMM). Accelerators are not checked.
    """
    if torch.device(device).type != "cpu" or bf16_peak <= 0:
        return None
    fp32_peak = measure_peak_tflops(torch.float32, device, budget_s=0.2)
    if bf16_peak >= 0.5 * fp32_peak:
        return None
    return (f"this CPU runs bf16 matmuls at {bf16_peak / fp32_peak:.2f}x its fp32 speed "
            f"({bf16_peak:.4f} vs {fp32_peak:.4f} TFLOP/s; torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}: no fast bf16 GEMM without AVX-512), so "
            f"plugins.precision: bf16 trains slower here than plugins.precision: fp32, and MFU "
            f"is against that slow bf16 peak")


def achieved_tflops(flops_per_token: float, tokens: int, seconds: float) -> float:
    """Model TFLOP/s: the model's FLOPs count times tokens processed, over wall time."""
    return flops_per_token * tokens / max(seconds, 1e-9) / 1e12


def mfu(achieved: float, peak: float) -> float:
    return achieved / peak if peak > 0 else 0.0
