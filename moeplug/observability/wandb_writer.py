"""Weights & Biases mirror of ``metrics.jsonl`` (``train.wandb: true`` or ``--wandb``).

The trainer hands every record it writes to :class:`WandbWriter` on rank 0 only, as it does to
the TensorBoard writer, and W&B gets the same tags (moeplug.observability.tensorboard:
``loss/train``, ``train/lr``, ``perf/mfu``, ``moe/...``, ``time/...``, ``loss/val``) at the
record's step, and the expert-load heat map (``moe/expert_load``) at every validation. The run's
config is the W&B run's config.

``train.wandb_mode``: ``offline`` writes the run under ``<out_dir>/wandb`` with no network
(``wandb sync`` uploads it later); ``online``; ``disabled``; empty: wandb's own choice
($WANDB_MODE, else online). Each start of a run, a resume included, is a W&B run of its own,
named ``train.wandb_name`` (empty: wandb's generated name), whose steps continue from the
checkpoint's; its config records which checkpoint it resumed from.

``wandb`` is optional (the ``wandb`` extra, with matplotlib for the heat map) and imported only
when the writer is built; the CLI checks it before any work (:func:`wandb_module`).
"""

from __future__ import annotations

import os
from typing import Any

from moeplug.config import ConfigError
from moeplug.observability.tensorboard import expert_load_image, record_scalars

INSTALL_WANDB = 'pip install "moeplug[wandb]"'


def wandb_module() -> Any:
    """The ``wandb`` package, or a ConfigError saying which extra to install."""
    try:
        import matplotlib  # noqa: F401  (the heat map image)
        import wandb
    except ImportError as e:
        raise ConfigError(f"train.wandb = True needs the wandb and matplotlib packages ({e}). "
                          f"Fix: {INSTALL_WANDB}, or set train.wandb=false") from None
    return wandb


class WandbWriter:
    """Logs records to one W&B run. Holds the run and the run directory (whose metrics.jsonl
    the heat map is drawn from)."""

    def __init__(self, run_dir: str, tc: Any, config: dict, start_step: int = 0,
                 resumed_from: str | None = None) -> None:
        wandb = wandb_module()
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        try:
            self._run = wandb.init(
                project=tc.wandb_project, name=tc.wandb_name or None, dir=run_dir,
                mode=tc.wandb_mode or None, reinit="create_new",
                config={**config, "moeplug": {"start_step": start_step,
                                              "resumed_from": resumed_from}},
                # moeplug prints its own progress; wandb would otherwise wrap stdout/stderr.
                settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # noqa: BLE001 - wandb's errors (login, network) have no base
            raise ConfigError(f"train.wandb = True: wandb.init failed ({type(e).__name__}: "
                              f"{e}). Fix: run `wandb login`, or set train.wandb_mode=offline "
                              f"(no network; `wandb sync` uploads later), or train.wandb=false"
                              ) from None

    def write(self, record: dict) -> None:
        step = record.get("step")
        data: dict[str, Any] = dict(record_scalars(record))
        if record.get("kind") == "val":
            image = expert_load_image(self.run_dir)
            if image is not None:
                import wandb
                data["moe/expert_load"] = wandb.Image(image)
        if data and step is not None:
            self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()
        import wandb
        # finish() returns before wandb's service has written the run's last records (offline:
        # the .wandb file can still be only its header). Stopping the service waits for them;
        # only when no other run of this process (a library user's own) still needs it.
        if wandb.run is None:
            wandb.teardown()
