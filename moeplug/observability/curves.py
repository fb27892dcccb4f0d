"""Line plots of ``metrics.jsonl`` over training steps (x = completed optimizer steps):

    loss     several runs on one axis: train loss (solid) and validation loss (dashed, dots),
             one colour per run
    mfu      several runs: model FLOPs utilisation in % of the measured dense-GEMM peak
    maxvio   one run: each MoE layer's MaxVio = max / mean tokens per expert - 1 (0 = balanced)

A run is named by its directory as given. Errors are RunDirErrors naming the file and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from moeplug.observability import mpl
from moeplug.observability.runlog import RunDirError, by_step, read_records


@dataclass(frozen=True)
class CurvePlot:
    """What a ``plot_*`` function wrote: the file and the figure (to inspect)."""

    path: str
    figure: Any


def _series(run_dir: str, kind: str, key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` in the ``kind`` records of one run (later record wins)."""
    points = [(s, r[key]) for s, r in by_step(read_records(run_dir), kind).items()
              if r.get(key) is not None]
    return [s for s, _ in points], [float(v) for _, v in points]


def _require(run_dir: str, steps: list, key: str, fix: str) -> None:
    if not steps:
        raise RunDirError(f"{os.path.join(run_dir, 'metrics.jsonl')} has no train record with "
                          f"{key!r}. Fix: {fix}")


def _axes(title: str, ylabel: str) -> tuple[Any, Any]:
    fig = mpl.new_figure(9, 5)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def loss_figure(run_dirs: Sequence[str]) -> Any:
    fig, ax = _axes("Loss (train: solid, validation: dashed)", "loss (nats/token)")
    for i, run in enumerate(run_dirs):
        steps, loss = _series(run, "train", "loss")
        _require(run, steps, "loss", "train past the first logging step (train.log_interval)")
        colour = f"C{i % 10}"
        ax.plot(steps, loss, color=colour, label=f"{run} train")
        val_steps, val = _series(run, "val", "val_loss")
        if val_steps:
            ax.plot(val_steps, val, "--o", color=colour, markersize=4, label=f"{run} val")
    ax.legend()
    return fig


def mfu_figure(run_dirs: Sequence[str]) -> Any:
    fig, ax = _axes("Model FLOPs utilisation", "MFU (% of the measured dense-GEMM peak)")
    for i, run in enumerate(run_dirs):
        steps, mfu = _series(run, "train", "mfu")
        _require(run, steps, "mfu", "train past the first logging step (train.log_interval)")
        ax.plot(steps, [100 * v for v in mfu], color=f"C{i % 10}", label=run)
    ax.legend()
    return fig


def maxvio_figure(run_dir: str) -> Any:
    records = by_step(read_records(run_dir), "train")
    points = [(s, r["moe"]["max_violation"]) for s, r in records.items()
              if (r.get("moe") or {}).get("max_violation")]
    _require(run_dir, points, "moe.max_violation",
             "train past the first logging step with a model that has MoE layers")
    fig, ax = _axes(f"Per-layer load imbalance of {run_dir}",
                    "MaxVio = max / mean tokens per expert - 1 (0 = balanced)")
    steps = [s for s, _ in points]
    num_layers = len(points[0][1])
    for layer in range(num_layers):
        ax.plot(steps, [v[layer] if layer < len(v) else None for _, v in points],
                color=f"C{layer % 10}", linestyle=("-", "--", ":")[layer // 10 % 3],
                label=f"MoE layer {layer}")
    ax.legend(ncol=max(1, num_layers // 12), fontsize="small")
    return fig


def plot_curves(kind: str, run_dirs: Sequence[str], out: str | None = None) -> CurvePlot:
    """Write the ``kind`` plot ("loss", "mfu": any number of runs; "maxvio": one) to ``out``
    (default: ``KIND.png`` in the first run directory)."""
    if kind == "maxvio":
        if len(run_dirs) != 1:
            raise RunDirError(f"moeplug plot maxvio draws one run, got {len(run_dirs)}: "
                              f"{list(run_dirs)}. Fix: pass one RUN_DIR per call")
        fig = maxvio_figure(run_dirs[0])
    else:
        fig = {"loss": loss_figure, "mfu": mfu_figure}[kind](run_dirs)
    return CurvePlot(path=mpl.save(fig, out or os.path.join(run_dirs[0], f"{kind}.png")),
                     figure=fig)
