"""Hardware entries: peak dense TFLOP/s per precision, HBM, links, GPUs per node.

Datasheet numbers (dense, no sparsity), per GPU:
    H100 SXM   989.5 BF16 / 1979 FP8, 80 GB HBM3 3.35 TB/s, NVLink4 450 GB/s per direction,
               8 GPUs per NVLink domain, 400 Gb/s InfiniBand (50 GB/s) per GPU
    H200       same compute as H100, 141 GB HBM3e 4.8 TB/s
    GB200      2500 BF16 / 5000 FP8, 186 GB HBM3e 8 TB/s, NVLink5 900 GB/s per direction,
               72-GPU NVLink domain (NVL72), 4 GPUs per node, 400 Gb/s per GPU off the rack
    GB300      same BF16/FP8 peaks as GB200, 288 GB HBM3e 8 TB/s
"cpu" is this machine: its peak is a measured fp32 matmul (moeplug.training.flops), its
"links" are loopback gloo (an order-of-magnitude constant, see CPU_LINK_GBPS).

The efficiency constants live in :mod:`moeplug.plan.perf`, not here: hardware entries stay
datasheet facts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moeplug.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    peak_tflops: dict  # precision ("bf16", "fp8", "fp32") -> dense TFLOP/s per device
    hbm_gb: float           # device memory, GB (1e9 bytes)
    hbm_tbps: float         # device memory bandwidth, TB/s
    nvlink_gbps: float      # per-direction bandwidth inside the NVLink domain, GB/s
    inter_gbps: float       # per-device bandwidth across domains, GB/s
    nvlink_domain: int      # devices that share the fast fabric
    gpus_per_node: int
    num_gpus: int = 8
    latency_us: float = 10.0  # per collective call (launch + fabric), microseconds
    generation: str = "hopper"  # which efficiency constants apply (perf.EFFICIENCY)
    # "cpu" calibrated for one run (moeplug.plan.calibrate_cpu.CpuCosts): the plan then costs
    # the run's units, collectives and optimizer with what this machine measured.
    costs: object = None

    def peak(self, precision: str) -> float:
        if precision not in self.peak_tflops:
            raise ConfigError(f"precision {precision!r}: cluster {self.name} has no peak for it. "
                              f"Fix: use one of {', '.join(self.peak_tflops)}")
        return self.peak_tflops[precision]


CLUSTERS: dict[str, Cluster] = {
    "h100": Cluster(name="h100", peak_tflops={"bf16": 989.5, "fp8": 1979.0}, hbm_gb=80,
                    hbm_tbps=3.35, nvlink_gbps=450, inter_gbps=50, nvlink_domain=8,
                    gpus_per_node=8, generation="hopper"),
    "h200": Cluster(name="h200", peak_tflops={"bf16": 989.5, "fp8": 1979.0}, hbm_gb=141,
                    hbm_tbps=4.8, nvlink_gbps=450, inter_gbps=50, nvlink_domain=8,
                    gpus_per_node=8, generation="hopper"),
    "gb200": Cluster(name="gb200", peak_tflops={"bf16": 2500.0, "fp8": 5000.0}, hbm_gb=186,
                     hbm_tbps=8.0, nvlink_gbps=900, inter_gbps=50, nvlink_domain=72,
                     gpus_per_node=4, generation="blackwell"),
    "gb300": Cluster(name="gb300", peak_tflops={"bf16": 2500.0, "fp8": 5000.0}, hbm_gb=288,
                     hbm_tbps=8.0, nvlink_gbps=900, inter_gbps=50, nvlink_domain=72,
                     gpus_per_node=4, generation="blackwell"),
}

# gloo over loopback TCP moves a few GB/s between two local processes (moe_frontier.md: gloo's
# allreduce is ~50x slower than a shared-memory one); the per-call latency is the part that
# dominates tiny CPU runs.
CPU_LINK_GBPS = 2.0
CPU_LATENCY_US = 200.0


def cpu_cluster(num_procs: int = 1, peak_tflops: float | None = None,
                mem_gb: float | None = None) -> Cluster:
    """"This CPU", calibrated by a short fp32 matmul (:func:`measure_peak_tflops`) with the
    intra-op threads torch has now, i.e. one process's peak (each rank of a run brings its
    own threads: ``train.threads``, or OMP_NUM_THREADS=1 under ``--nproc``)."""
    if peak_tflops is None:
        from moeplug.training.flops import measure_peak_tflops
        peak_tflops = measure_peak_tflops(budget_s=0.3)
    if mem_gb is None:
        import os
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    per = peak_tflops
    return Cluster(name="cpu", peak_tflops={"fp32": per, "bf16": per}, hbm_gb=mem_gb / num_procs,
                   hbm_tbps=measure_copy_tbps(), nvlink_gbps=CPU_LINK_GBPS,
                   inter_gbps=CPU_LINK_GBPS,
                   nvlink_domain=max(num_procs, 1), gpus_per_node=max(num_procs, 1),
                   num_gpus=num_procs, latency_us=CPU_LATENCY_US, generation="cpu")


def measure_copy_tbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` TB/s of a ``nbytes`` tensor copy (read + write) with torch's threads:
    the bandwidth the bandwidth-bound ops of a CPU run see."""
    import time

    import torch
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e12


def get_cluster(name: str, num_gpus: int | None = None) -> Cluster:
    """A built-in entry (``cpu`` is measured now) sized to ``num_gpus`` devices."""
    if name == "cpu":
        return cpu_cluster(num_gpus or 1)
    if name not in CLUSTERS:
        raise ConfigError(f"--cluster {name!r}: unknown cluster. Fix: use one of "
                          f"{', '.join([*CLUSTERS, 'cpu'])}")
    c = CLUSTERS[name]
    if num_gpus is not None:
        if num_gpus < 1:
            raise ConfigError(f"--gpus {num_gpus}: must be >= 1. Fix: pass the device count")
        c = replace(c, num_gpus=num_gpus)
    return c
