"""``moeplug plot-load RUN_DIR [--out load.png]``: the expert-load heat map of a run.

Argument parsing only; the work is in :mod:`moeplug.observability.heatmap`. Its errors are
ConfigErrors, so the CLI reports them like any configuration problem (exit 2, path and fix).
"""

from __future__ import annotations

import argparse


def add_plot_load_parser(sub) -> None:
    p = sub.add_parser("plot-load", help="PNG heat map of each MoE layer's expert load over "
                       "steps, from RUN_DIR/metrics.jsonl")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's train.out_dir")
    p.add_argument("--out", metavar="PNG", help="file to write (default: RUN_DIR/load.png)")
    p.add_argument("--cell", type=int, default=8, metavar="PX",
                   help="cell width in pixels (default 8); the height fits ~512 px in total")


def cmd_plot_load(args: argparse.Namespace) -> int:
    from moeplug.observability.heatmap import plot_load
    plot = plot_load(args.run_dir, args.out, cell_width=args.cell)
    print(f"wrote {plot.path} ({plot.width}x{plot.height} px): rows = {len(plot.steps)} logged "
          f"steps {plot.steps[0]}..{plot.steps[-1]} (top to bottom), columns = experts of "
          f"{len(plot.experts_per_layer)} MoE layers {plot.experts_per_layer} (white gaps between "
          f"layers); colour = share of the layer's tokens, dark 0 .. yellow {plot.max_share:.3f}")
    return 0
