"""The plan as text (memory and step-time breakdowns, the search table) and as a PNG."""

from __future__ import annotations

import os

from moeplug.config import ConfigError
from moeplug.plan.memory import GB, MemoryBreakdown
from moeplug.plan.perf import StepTime
from moeplug.plan.search import Candidate


def memory_text(mem: MemoryBreakdown, limit_gb: float) -> str:
    unit, div = ("GB", GB) if mem.total >= GB else ("MB", 1e6)
    lines = [f"per-rank memory (pipeline stage {mem.rank}, the largest), {unit}:",
             f"  weights + grads      {mem.weights_grads / div:8.1f}",
             f"  optimizer            {mem.optimizer / div:8.1f}",
             f"  activations          {mem.activations_total / div:8.1f}"]
    for k, v in sorted(mem.activations.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {k:<18} {v / div:8.1f}")
    if mem.fsdp_gathered:
        lines.append(f"  FSDP gathered        {mem.fsdp_gathered / div:8.1f}")
    if mem.grad_landing:  # the largest bf16 grad as it lands beside the fp32 main grads
        lines.append(f"  grad landing         {mem.grad_landing / div:8.1f}")
    lines += [f"  comm buffers         {mem.comm_buffers / div:8.1f}",
              f"  total                {mem.total / div:8.1f}  (device {limit_gb:.0f} GB)"]
    return "\n".join(lines)


def step_text(st: StepTime) -> str:
    lines = [f"step time {st.total:.3f} s:"]
    lines += [f"  {k:<14} {v:9.4f} s" for k, v in st.parts.items() if v > 0]
    lines.append(f"{rate_text(st.tflops_per_gpu, 'per GPU')}   MFU {st.mfu:.1%}   "
                 f"tokens/s per GPU {st.tokens_per_s_per_gpu:,.0f}")
    return "\n".join(lines)


def rate_text(tflops: float, what: str) -> str:
    """A FLOP rate at a scale that shows it: TFLOP/s from 1 TFLOP/s (a GPU), else GFLOP/s
    (a CPU process: "TFLOP/s per GPU 0.0" said nothing)."""
    return f"TFLOP/s {what} {tflops:.1f}" if tflops >= 1 else \
        f"GFLOP/s {what} {tflops * 1e3:.1f}"


def calibration_text(costs) -> str:
    """What "this CPU" measured for the run (moeplug.plan.calibrate_cpu.CpuCosts)."""
    eff = ", ".join(f"{u} {costs.gemm_efficiency(u):.2f}" for u in costs.units
                    if costs.units[u].gemm_flops)
    lines = [f"calibrated cpu: peak {costs.peak_tflops * 1e3:.1f} GFLOP/s per CPU second, the "
             f"best GEMM rate measured (512^2 fp32 matmul {costs.matmul_tflops * 1e3:.1f}); "
             f"GEMM efficiency at the run's shapes: {eff}"]
    for name, u in costs.units.items():
        lines.append(f"  unit {name:<5} {u.total * 1e3:8.2f} ms per micro-batch (gemm "
                     f"{u.gemm * 1e3:.2f}, attention {u.attention * 1e3:.2f}, elementwise "
                     f"{u.elementwise * 1e3:.2f}, kernels {u.kernels * 1e3:.2f}, host "
                     f"{u.host * 1e3:.2f}); saved {u.saved_bytes / 1e6:.1f} MB")
    for kind, (lat, bw) in costs.links.items():
        lines.append(f"  {kind:<14} latency {lat * 1e6:.0f} us, {bw / 1e9:.2f} GB/s")
    return "\n".join(lines)


def search_table(cands: list[Candidate], top: int = 10) -> str:
    fit = [k for k in cands if k.fits]
    scale, unit = (1, "TFLOP/s") if any(k.step.tflops_per_gpu >= 1 for k in cands) else \
        (1e3, "GFLOP/s")
    head = f"{'mapping':<34} {unit:>8} {'MFU':>6} {'mem GB':>7}  fits"
    rows = [head, "-" * len(head)]
    for k in (fit or cands)[:top]:
        rows.append(f"{k.mapping.short():<34} {k.step.tflops_per_gpu * scale:8.1f} "
                    f"{k.step.mfu:6.1%} "
                    f"{k.memory.total / GB:7.1f}  {'yes' if k.fits else 'no'}")
    rows.append(f"{len(fit)} of {len(cands)} valid mappings fit the memory limit")
    return "\n".join(rows)


def require_png(path: str) -> None:
    """ConfigError, naming --out, unless a search PNG can be written to ``path``: matplotlib
    (the optional ``plot`` extra, checked as ``moeplug plot`` checks it) and a directory for
    it. Called before the search, so a missing extra costs no search."""
    from moeplug.observability.mpl import new_figure
    try:
        new_figure(1, 1)
    except ConfigError as e:
        raise ConfigError(f"--out {path}: {e}") from None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # plot's mpl.save creates the missing directories
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path}: cannot write under {parent}. Fix: choose a path in a "
                          "writable directory")


def search_png(cands: list[Candidate], path: str, title: str) -> bool:
    """Predicted TFLOP/s against per-rank memory, one point per mapping, the limit as a line.
    ConfigError (naming the extra) when matplotlib is missing: see :func:`require_png`."""
    require_png(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, colour, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "over limit")):
        pts = [k for k in cands if k.fits == fits]
        ax.scatter([k.memory.total / GB for k in pts], [k.step.tflops_per_gpu for k in pts],
                   s=14, c=colour, label=f"{label} ({len(pts)})")
    if cands:
        ax.axvline(cands[0].limit / GB, color="tab:red", ls="--", label="memory limit")
        best = next((k for k in cands if k.fits), None)
        if best:
            ax.annotate(best.mapping.short(), (best.memory.total / GB, best.step.tflops_per_gpu),
                        fontsize=8)
    ax.set_xlabel("predicted peak memory per rank (GB)")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
