"""train.device (moeplug.training.distributed.resolve_device): what a GPU does not run yet.
The device is known for certain only at launch (``auto`` resolves there); a mode's own GPU
rules live in its module (delay_wgrad.py, sync_free.py, overlap.py, recompute.py)."""

from __future__ import annotations

from moeplug.config._checks import ConfigError
from moeplug.config.modes._rule import Facts, Rule


def _no_pipeline(f: Facts) -> None:
    pp = f.cfg.parallel.pp
    if f.device == "cuda" and pp > 1:  # its p2p receive buffers and loss sums are CPU tensors
        raise ConfigError(f"{f.device_field} with parallel.pp = {pp}: pipeline parallelism "
                          "runs on the CPU only so far. Fix: --set train.device=cpu, or "
                          "parallel.pp=1 (tp/ep/dp/cp for the GPUs)")


RULES = (
    Rule("device", "device", "TrainConfig.device", _no_pipeline,
         {"parallel": {"pp": 2}, "model": {"num_layers": 4}}),
)
