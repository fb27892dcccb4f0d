"""TensorBoard mirror of ``metrics.jsonl`` (``train.tensorboard: true`` or ``--tensorboard``).

The trainer hands every record it writes to :class:`TensorBoardWriter` on rank 0 only; event
files go to ``<out_dir>/tb``. Tags (x = the record's step):
    loss/train, loss/lm, loss/aux (scaled, as in the record), loss/z (unscaled router z-loss,
    mean over MoE layers), loss/val
    train/lr, train/grad_norm, perf/tokens_per_s, perf/tflops, perf/mfu
    moe/max_violation/layer_<i>, moe/dropped_fraction/layer_<i>   per MoE layer
    time/<stage>   seconds per step (time_breakdown, moeplug.observability.timing)
    train/<key>    any other number a train record carries (e.g. an MTP loss)
    moe/expert_load   image: the load heat map of the run so far, at every validation
The heat map is rendered by matplotlib, so the ``tensorboard`` extra installs both.
"""

from __future__ import annotations

import os
from typing import Any

from moeplug.config import ConfigError
from moeplug.observability import mpl
from moeplug.observability.heatmap import load_figure, load_history
from moeplug.observability.runlog import read_records

_TAGS = {"loss": "loss/train", "lm_loss": "loss/lm", "aux_loss": "loss/aux",
         "mtp_loss": "loss/mtp", "lr": "train/lr",
         "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
         "tflops": "perf/tflops", "mfu": "perf/mfu"}


def summary_writer_class() -> Any:
    """torch's SummaryWriter, or a ConfigError saying which extra to install."""
    try:
        import matplotlib  # noqa: F401  (the heat map image)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(f"train.tensorboard = True needs the tensorboard and matplotlib "
                          f"packages ({e}). Fix: pip install \"moeplug[tensorboard]\", or set "
                          f"train.tensorboard=false") from None
    return SummaryWriter


def record_scalars(record: dict) -> dict[str, float]:
    """The scalars a train or val record is logged as, by tag (the module docstring's list):
    what the TensorBoard and the Weights & Biases writers both log."""
    if record.get("kind") == "val":
        return {"loss/val": record["val_loss"]}
    if record.get("kind") != "train":
        return {}
    out = {_TAGS.get(key, f"train/{key}"): value for key, value in record.items()
           if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    moe = record.get("moe") or {}
    z = [v for v in (moe.get("router_losses") or {}).get("z_loss", []) if v is not None]
    if z:
        out["loss/z"] = sum(z) / len(z)
    for name in ("max_violation", "dropped_fraction"):
        for layer, value in enumerate(moe.get(name) or []):
            out[f"moe/{name}/layer_{layer}"] = value
    for name, seconds in (record.get("time_breakdown") or {}).items():
        out[f"time/{name}"] = seconds
    return out


def expert_load_image(run_dir: str) -> Any:
    """The expert-load heat map of the run so far (uint8 [H, W, 3], from its metrics.jsonl),
    or None when no record has per-expert counts yet: logged at every validation."""
    history = load_history(read_records(run_dir))
    return None if history is None else mpl.to_rgb(load_figure(history))


class TensorBoardWriter:
    """Writes records as TensorBoard scalars and images. Holds the event-file writer and the
    run directory (whose metrics.jsonl the heat map is drawn from)."""

    def __init__(self, run_dir: str, start_step: int = 0) -> None:
        self.run_dir = run_dir
        # A resumed run starts a new event file. Steps after the checkpoint (start_step) that
        # a crashed run had logged are logged again, so readers drop the old file's events
        # from start_step + 1 on (purge_step).
        self._tb = summary_writer_class()(os.path.join(run_dir, "tb"),
                                          purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict) -> None:
        step = record.get("step")
        for tag, value in record_scalars(record).items():
            self._tb.add_scalar(tag, value, step)
        if record.get("kind") == "val":
            image = expert_load_image(self.run_dir)
            if image is not None:
                self._tb.add_image("moe/expert_load", image, step, dataformats="HWC")
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()
