"""``moeplug plot load|loss|mfu|maxvio RUN_DIR... [--out FILE]`` (``plot-load`` = ``plot load``).

Argument parsing only; the work is in :mod:`moeplug.observability.heatmap` and ``curves``.
Their errors (and a missing matplotlib) are ConfigErrors, so the CLI reports them like any
configuration problem (exit 2, path and fix).
"""

from __future__ import annotations

import argparse

_KINDS = {
    "load": ("heat map of each MoE layer's expert load over steps", 1),
    "loss": ("train and validation loss of one or more runs on one axis", "+"),
    "mfu": ("model FLOPs utilisation of one or more runs", "+"),
    "maxvio": ("per-layer MaxVio (max/mean tokens per expert - 1) of one run", 1),
}


def _add_kind(sub, name: str, kind: str, help_text: str, nargs: int | str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.set_defaults(plot_kind=kind)
    p.add_argument("run_dirs", nargs=nargs, metavar="RUN_DIR", help="a run's train.out_dir")
    p.add_argument("--out", metavar="FILE", help=f"image to write, .png/.svg/.pdf (default: "
                   f"{kind}.png in the first RUN_DIR)")


def add_plot_parsers(sub) -> None:
    plot = sub.add_parser("plot", help="plots of runs' metrics.jsonl (needs the plot extra: "
                          'pip install "moeplug[plot]")')
    kinds = plot.add_subparsers(dest="plot_kind", metavar="KIND", required=True)
    for kind, (help_text, nargs) in _KINDS.items():
        _add_kind(kinds, kind, kind, help_text, nargs)
    _add_kind(sub, "plot-load", "load", "same as `moeplug plot load`", 1)


def cmd_plot(args: argparse.Namespace) -> int:
    if args.plot_kind == "load":
        from moeplug.observability.heatmap import plot_load
        plot = plot_load(args.run_dirs[0], args.out)
        print(f"wrote {plot.path}: x = {len(plot.steps)} logged steps {plot.steps[0]}.."
              f"{plot.steps[-1]}, y = experts of {len(plot.experts_per_layer)} MoE layers "
              f"{plot.experts_per_layer}; colour = share of the layer's routed tokens, "
              f"0 .. {plot.max_share:.3f}")
        return 0
    from moeplug.observability.curves import plot_curves
    print(f"wrote {plot_curves(args.plot_kind, args.run_dirs, args.out).path}")
    return 0
