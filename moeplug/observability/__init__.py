"""Observability: per-layer MoE routing metrics for the JSONL log, and a load heat map.

    layer_stats   one optimizer step's per-layer load statistics and router losses, merged over
                  its micro-batches (the ``moe`` entry of every ``train`` record)
    heatmap       metrics.jsonl -> token-share matrix (steps x layer.expert) -> colours -> PNG
    png           a minimal RGB PNG encoder (zlib + struct; no imaging library needed)
    cli           ``moeplug plot-load RUN_DIR [--out load.png]``
"""

from moeplug.observability.heatmap import LoadPlot, RunDirError, plot_load
from moeplug.observability.layer_stats import StepRouting, add_micro_batch, moe_metrics
from moeplug.observability.png import encode_png

__all__ = ["LoadPlot", "RunDirError", "StepRouting", "add_micro_batch", "encode_png",
           "moe_metrics", "plot_load"]
