"""Observability: what a run reports beyond its losses, and ways to look at it.

    layer_stats   one optimizer step's per-layer load statistics and router losses, merged over
                  its micro-batches (the ``moe`` entry of every ``train`` record)
    timing        per-stage seconds of a train step (the ``time_breakdown`` entry)
    runlog        reading a run's metrics.jsonl back (RunDirError)
    heatmap       metrics.jsonl -> expert-load heat map (matplotlib, the ``plot`` extra)
    curves        metrics.jsonl -> loss / MFU / per-layer MaxVio over steps
    mpl           matplotlib imported at the point of use, with the install hint
    tensorboard   the records mirrored as TensorBoard events (the ``tensorboard`` extra)
    cli           ``moeplug plot load|loss|mfu|maxvio RUN_DIR... [--out FILE]``
"""

from moeplug.observability.heatmap import LoadPlot, plot_load
from moeplug.observability.layer_stats import StepRouting, add_micro_batch, moe_metrics
from moeplug.observability.runlog import RunDirError

__all__ = ["LoadPlot", "RunDirError", "StepRouting", "add_micro_batch", "moe_metrics",
           "plot_load"]
