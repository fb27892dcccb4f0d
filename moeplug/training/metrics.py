"""What a run reports: a JSONL metrics file, expert-load statistics, and human progress output.

JSONL records (one JSON object per line, ``metrics.jsonl`` in the run directory):
    {"kind": "run",   ...}   once per start/resume: plugins, peak TFLOP/s, FLOPs per token, config
    {"kind": "train", "step", "loss", "lm_loss", "aux_loss", ["mtp_loss",] "lr", "grad_norm",
                      "tokens_per_s", "tflops", "mfu",
                      "expert_load": [{"layer", "max", "mean", "max_over_mean"}],
                      "plugins": {"router": ..., ...},
                      "moe": {"tokens": [[per expert] per layer], "tokens_min", "tokens_mean",
                              "tokens_max", "max_violation", "cv", "dropped_fraction": [per layer],
                              "router_losses": {type: [per layer]}}}   every ``log_interval`` steps
                      (``moe``: see moeplug.observability.layer_stats for the definitions)
                      "time_breakdown": {stage: mean seconds per step}   (observability.timing)
    {"kind": "val",   "step", "val_loss"}                     every ``eval_interval`` steps + at the end
    {"kind": "skip",  "step", "loss", "grad_norm", "where", "skipped_steps"}   a non-finite step
                      not applied (train.nonfinite = skip; moeplug.training.faults)
``step`` counts completed optimizer steps (1 after the first update). ``loss`` is the sum of
its terms: ``lm_loss + aux_loss`` (the routers' load-balancing and z losses times their
coefficients) ``+ mtp_loss`` (present only with multi-token prediction, already scaled).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Sequence

import torch


def expert_load(counts_per_layer: Sequence[torch.Tensor]) -> list[dict]:
    """Per MoE layer: max and mean tokens per expert, and their ratio (1.0 = perfectly balanced).

    counts_per_layer: list over MoE layers of ``counts_E`` (tokens routed to each expert,
    summed over the micro-batches of the step).
    """
    load = []
    for layer, counts_E in enumerate(counts_per_layer):
        counts_E = counts_E.detach().to(torch.float64)
        mean = float(counts_E.mean()) if counts_E.numel() else 0.0
        peak = float(counts_E.max()) if counts_E.numel() else 0.0
        load.append({"layer": layer, "max": peak, "mean": mean,
                     "max_over_mean": peak / mean if mean > 0 else 0.0})
    return load


class MetricsWriter:
    """Appends JSON records to a file, flushing each line so a crash loses at most one record.

    Holds only the open file handle; the values come in with every ``write`` call.
    """

    def __init__(self, path: str, append: bool) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        if append:
            _drop_torn_record(path)
        self._file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_torn_record(path: str) -> None:
    """Cut a last line without its newline: a record half-written when the previous run was
    killed (a long one is more than one write). Appending after it would corrupt both."""
    if not os.path.isfile(path) or not os.path.getsize(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_train_line(record: dict) -> str:
    # Every term of the loss, so the printed loss is visibly their sum.
    mtp = f", mtp {record['mtp_loss']:.4f}" if "mtp_loss" in record else ""
    return (f"step {record['step']:>6} | loss {record['loss']:.4f} (lm {record['lm_loss']:.4f}, "
            f"aux {record['aux_loss']:.4f}{mtp}) | lr {record['lr']:.2e} "
            f"| grad {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s "
            f"| {record['tflops']:.4f} TFLOP/s | MFU {100 * record['mfu']:.1f}%")


class Progress:
    """A tqdm bar when stderr is a terminal; otherwise plain log lines (CI logs, pipes, files).

    ``log`` receives every line that must be seen either way (run header, validation, summary).
    """

    def __init__(self, total: int, initial: int, log: Callable[[str], None],
                 use_bar: bool | None = None) -> None:
        self.log = log
        if use_bar is None:
            use_bar = sys.stderr.isatty()
        self._bar = None
        if use_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def step(self, record: dict | None) -> None:
        """Advance one step; ``record`` is the train record when this step was a logging step."""
        if self._bar is not None:
            self._bar.update(1)
            if record is not None:
                self._bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.1e}",
                                      tok_s=f"{record['tokens_per_s']:.0f}")
        elif record is not None:
            self.log(format_train_line(record))

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            self.log(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
