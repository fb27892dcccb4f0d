"""Throughput accounting: measured dense-GEMM peak, achieved TFLOP/s and MFU.

MFU here is "model FLOPs utilisation against what this machine's dense GEMM actually reaches",
not against a datasheet number: on CPUs the datasheet peak is rarely known, and a measured
square matmul in the same dtype and thread count is the honest ceiling for GEMM-bound training.
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


def achieved_tflops(flops_per_token: float, tokens: int, seconds: float) -> float:
    """Model TFLOP/s: the model's FLOPs count times tokens processed, over wall time."""
    return flops_per_token * tokens / max(seconds, 1e-9) / 1e12


def mfu(achieved: float, peak: float) -> float:
    return achieved / peak if peak > 0 else 0.0
