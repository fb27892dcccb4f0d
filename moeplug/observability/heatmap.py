"""``metrics.jsonl`` -> a labelled heat map of expert load per MoE layer over training steps.

Legend: R logged train steps, L MoE layers, E experts of a layer, Y = sum of E over layers.

Picture: x = training step (one column per logged ``train`` record); y = one row per
(MoE layer, expert), layer 0 at the top, layers separated by white lines and labelled on the
left. A cell's colour is the expert's *share* of its layer's routed tokens at that step,
n_e / sum(n), on viridis from 0 (dark) to the largest share in the picture (yellow); the colour
bar carries the unit and, when every layer has E experts, a red mark at the balanced share 1/E.
Shares, not raw counts, so layers and steps compare directly: a balanced layer is uniform at
1/E, a collapsed layer one bright row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeplug.observability import mpl
from moeplug.observability.runlog import RunDirError, by_step, read_records


@dataclass(frozen=True)
class LoadHistory:
    """Per logged step, per MoE layer, tokens routed to each expert (``moe.tokens``)."""

    steps: list[int]
    tokens: list[list[list[int]]]  # [R][L][E]


@dataclass(frozen=True)
class LoadPlot:
    """What :func:`plot_load` wrote: the file, the figure (to inspect), what it shows."""

    path: str
    figure: Any
    steps: list[int]
    experts_per_layer: list[int]
    max_share: float  # the share drawn in the hottest colour


def load_history(records: list[dict], where: str = "metrics.jsonl") -> LoadHistory | None:
    """The ``moe.tokens`` of every train record, by step; None when no record has any (no MoE
    layer, or nothing logged yet). ``where`` names the file in errors."""
    loads = {s: (r.get("moe") or {}).get("tokens") for s, r in by_step(records, "train").items()}
    loads = {s: t for s, t in loads.items() if t}
    if not loads:
        return None
    steps = list(loads)
    shape = [len(layer) for layer in loads[steps[0]]]
    for s in steps:
        if [len(layer) for layer in loads[s]] != shape:
            raise RunDirError(
                f"{where}: step {s} logs experts per layer {[len(x) for x in loads[s]]} but step "
                f"{steps[0]} logs {shape}: the file mixes runs of different models. Fix: give "
                f"each model its own train.out_dir and plot that")
    return LoadHistory(steps=steps, tokens=[loads[s] for s in steps])


def read_load_history(run_dir: str) -> LoadHistory:
    """:func:`load_history` of ``run_dir/metrics.jsonl``; an error when it holds no loads."""
    history = load_history(read_records(run_dir), os.path.join(run_dir, "metrics.jsonl"))
    if history is None:
        raise RunDirError(
            f"{os.path.join(run_dir, 'metrics.jsonl')} has no train record with per-expert loads "
            f"(key moe.tokens). Fix: train past the first logging step (train.log_interval) with "
            f"a model that has MoE layers")
    return history


def share_matrix(history: LoadHistory) -> np.ndarray:
    """[Y, R] float: each expert's share of its layer's tokens per step (0 when the layer
    routed nothing at that step); rows are layer 0's experts, then layer 1's, ..."""
    cols = []
    for layers in history.tokens:
        col: list[float] = []
        for n_E in layers:
            n = np.asarray(n_E, dtype=np.float64)
            col.extend(n / n.sum() if n.sum() > 0 else np.zeros_like(n))
        cols.append(col)
    return np.asarray(cols, dtype=np.float64).T


def _step_edges(steps: list[int]) -> np.ndarray:
    """Cell boundaries on the step axis: halfway between logged steps (any spacing)."""
    s = np.asarray(steps, dtype=np.float64)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[2 * s[0] - mid[0]], mid, [2 * s[-1] - mid[-1]]])


def load_figure(history: LoadHistory, title: str = "") -> Any:
    """The heat map (module docstring) as a matplotlib Figure."""
    share_YR = share_matrix(history)
    experts = [len(layer) for layer in history.tokens[0]]
    bounds = np.concatenate([[0], np.cumsum(experts)])
    vmax = float(share_YR.max()) or 1.0
    fig = mpl.new_figure(10, min(12, 3 + 0.08 * len(share_YR) + 0.25 * len(experts)))
    ax = fig.add_subplot()
    mesh = ax.pcolormesh(_step_edges(history.steps), bounds[-1] - np.arange(len(share_YR) + 1),
                         share_YR[::-1], cmap="viridis", vmin=0.0, vmax=vmax)
    for b in bounds[1:-1]:  # white separators between layers
        ax.axhline(bounds[-1] - b, color="white", linewidth=2)
    # Layer labels at the layers' centres; deep models get short labels on every k-th layer
    # (at most ~24) so they never overlap, and per-expert minor ticks only while they fit.
    every = -(-len(experts) // 24)
    shown = range(0, len(experts), every)
    ax.set_yticks(bounds[-1] - (bounds[:-1] + bounds[1:])[::every] / 2,
                  [f"MoE layer {i}\n({experts[i]} experts)" if len(experts) <= 8
                   else f"MoE layer {i}" for i in shown])
    if len(share_YR) <= 256:
        ax.set_yticks(bounds[-1] - np.arange(len(share_YR)) - 0.5, minor=True)
    ax.set_xlabel("training step")
    ax.set_ylabel("MoE layer × expert (expert 0 at the top of each layer)")
    ax.set_title(title or "Expert load: each expert's share of its layer's routed tokens")
    bar = fig.colorbar(mesh, ax=ax)
    bar.set_label("share of the layer's routed tokens (0 .. 1)")
    if len(set(experts)) == 1:  # one balanced share for every layer: mark it
        bar.ax.axhline(1 / experts[0], color="red", linewidth=2)
        bar.set_label(f"share of the layer's routed tokens (red: balanced, 1/{experts[0]})")
    return fig


def plot_load(run_dir: str, out: str | None = None) -> LoadPlot:
    """Write the heat map of ``run_dir/metrics.jsonl`` to ``out`` (default run_dir/load.png)."""
    history = read_load_history(run_dir)
    fig = load_figure(history, f"Expert load of {run_dir}: each expert's share of its layer's "
                               f"routed tokens")
    path = mpl.save(fig, out or os.path.join(run_dir, "load.png"))
    return LoadPlot(path=path, figure=fig, steps=history.steps,
                    experts_per_layer=[len(layer) for layer in history.tokens[0]],
                    max_share=float(share_matrix(history).max()))
