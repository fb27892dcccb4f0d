"""``metrics.jsonl`` -> a PNG heat map of expert load per MoE layer over training steps.

Legend: R logged train steps (rows), C columns = experts of every layer plus one gap column
between layers, L MoE layers, E experts of a layer.

Picture: one row of cells per logged ``train`` record (first step at the top); one column of
cells per (layer, expert), layers left to right, separated by a white gap column. A cell's colour
is the expert's *share* of its layer's routed tokens at that step, n_e / sum(n), on a viridis
scale from 0 (dark purple) to the largest share in the whole picture (yellow). Shares, not raw
counts, so layers and steps compare directly: a perfectly balanced layer shows all its cells at
1/E, a collapsed layer one bright column.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from moeplug.config import ConfigError
from moeplug.observability.png import encode_png

# Viridis at 0, 1/4, 1/2, 3/4, 1 (matplotlib's table); linear in between. Its lightness rises
# monotonically, so brighter always means more load, also in greyscale prints.
_VIRIDIS_K3 = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98],
                        [253, 231, 37]], dtype=np.float64)
_GAP_RGB = (255, 255, 255)


class RunDirError(ConfigError):
    """The run directory cannot be plotted; the message names the path and the fix. A
    ConfigError, so the CLI reports it as one paragraph with exit status 2."""


@dataclass(frozen=True)
class LoadHistory:
    """Per logged step, per MoE layer, tokens routed to each expert (``moe.tokens``)."""

    steps: list[int]
    tokens: list[list[list[int]]]  # [R][L][E]


@dataclass(frozen=True)
class LoadPlot:
    """What :func:`plot_load` wrote."""

    path: str
    steps: list[int]
    experts_per_layer: list[int]
    max_share: float  # the share drawn in the hottest colour
    width: int
    height: int


def read_load_history(run_dir: str) -> LoadHistory:
    """The ``moe.tokens`` of every train record in ``run_dir/metrics.jsonl``, by step.

    A resumed run appends to the file and may log a step twice; the later record wins. A
    truncated last line (a crash mid-write) is skipped; a broken line elsewhere is an error.
    """
    if not os.path.isdir(run_dir):
        raise RunDirError(f"run directory {run_dir!r} does not exist. Fix: pass the train.out_dir "
                          f"of a run (the folder holding metrics.jsonl), e.g. runs/default")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise RunDirError(f"{run_dir!r} has no metrics.jsonl. Fix: pass the train.out_dir of a "
                          f"run that `moeplug train` has started (it writes metrics.jsonl there)")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    by_step: dict[int, list] = {}
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the run died while writing its last line
            raise RunDirError(f"{path}: line {i + 1} is not valid JSON. Fix: delete or repair "
                              f"that line (metrics.jsonl holds one JSON object per line)") from None
        tokens = (record.get("moe") or {}).get("tokens") if record.get("kind") == "train" else None
        if tokens:
            by_step[int(record["step"])] = tokens
    if not by_step:
        raise RunDirError(
            f"{path} has no train record with per-expert loads (key moe.tokens). Fix: train past "
            f"the first logging step (train.log_interval) with a model that has MoE layers; "
            f"runs logged by moeplug versions before the load metrics cannot be plotted")
    steps = sorted(by_step)
    shape = [len(layer) for layer in by_step[steps[0]]]
    for s in steps:
        if [len(layer) for layer in by_step[s]] != shape:
            raise RunDirError(
                f"{path}: step {s} logs experts per layer {[len(x) for x in by_step[s]]} but step "
                f"{steps[0]} logs {shape}: the file mixes runs of different models. Fix: give "
                f"each model its own train.out_dir and plot that")
    return LoadHistory(steps=steps, tokens=[by_step[s] for s in steps])


def share_grid(history: LoadHistory) -> np.ndarray:
    """[R, C] float: each expert's share of its layer's tokens per step; NaN in gap columns."""
    rows = []
    for layers in history.tokens:
        row: list[float] = []
        for i, n_E in enumerate(layers):
            n = np.asarray(n_E, dtype=np.float64)
            total = n.sum()
            if i:
                row.append(np.nan)  # the gap column between layers
            row.extend((n / total) if total > 0 else np.zeros_like(n))  # no tokens: all 0
        rows.append(row)
    return np.asarray(rows, dtype=np.float64)


def colorize(grid_RC: np.ndarray, vmax: float) -> np.ndarray:
    """uint8 [R, C, 3]: viridis of grid / vmax (clipped to [0, 1]); gap (NaN) cells white."""
    gap_RC = np.isnan(grid_RC)
    t_RC = np.clip(np.nan_to_num(grid_RC) / vmax if vmax > 0 else np.zeros_like(grid_RC), 0, 1)
    pos_RC = t_RC * (len(_VIRIDIS_K3) - 1)
    lo_RC = np.minimum(np.floor(pos_RC).astype(np.int64), len(_VIRIDIS_K3) - 2)
    frac_RC1 = (pos_RC - lo_RC)[..., None]
    rgb_RC3 = _VIRIDIS_K3[lo_RC] * (1 - frac_RC1) + _VIRIDIS_K3[lo_RC + 1] * frac_RC1
    rgb_RC3[gap_RC] = _GAP_RGB
    return np.rint(rgb_RC3).astype(np.uint8)


def plot_load(run_dir: str, out: str | None = None, cell_width: int = 8,
              cell_height: int | None = None) -> LoadPlot:
    """Write the heat map of ``run_dir/metrics.jsonl`` to ``out`` (default run_dir/load.png).

    Cells are ``cell_width`` x ``cell_height`` pixels; the default height keeps the picture at
    most ~512 pixels tall (1 to 8 pixels per step).
    """
    for name, v in (("cell_width", cell_width), ("cell_height", cell_height)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise RunDirError(f"plot_load: {name} = {v!r} must be a whole number of pixels >= 1. "
                              f"Fix: pass e.g. {name}=8")
    history = read_load_history(run_dir)
    grid_RC = share_grid(history)
    R, C = grid_RC.shape
    if cell_height is None:
        cell_height = max(1, min(8, 512 // R))
    vmax = float(np.nanmax(grid_RC))
    pixels_HW3 = colorize(grid_RC, vmax).repeat(cell_height, axis=0).repeat(cell_width, axis=1)
    H, W = R * cell_height, C * cell_width
    out = out or os.path.join(run_dir, "load.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "wb") as f:
        f.write(encode_png(W, H, np.ascontiguousarray(pixels_HW3).tobytes()))
    return LoadPlot(path=out, steps=history.steps,
                    experts_per_layer=[len(layer) for layer in history.tokens[0]],
                    max_share=vmax, width=W, height=H)
