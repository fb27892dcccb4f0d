"""plugins.precision's recipes (moeplug.quant, the precision plugins): the dtype the model
computes in. (What the sync-free region, capture and delay_wgrad run under a recipe: their
modules.)"""

from __future__ import annotations

from moeplug.config._checks import _fail
from moeplug.config.modes._rule import Facts, Rule


def _bf16_weights(name: str):
    # master_dtype and param_dtype bf16 both make the parameters bf16, which are computed with
    # under bf16 autocast only.
    def check(f: Facts) -> None:
        train, precision = f.cfg.train, f.cfg.plugins.precision
        if getattr(train, name) == "bf16" and precision != "bf16":
            _fail(train, name, "bf16", f"needs plugins.precision bf16 (got {precision!r}): bf16 "
                  f"weights are computed with under bf16 autocast",
                  f"set plugins.precision: bf16 or train.{name}: fp32")
    return check


RULES = tuple(Rule("precision", "config", f"TrainConfig.{name}", _bf16_weights(name),
                   {"train": {name: "bf16"}}) for name in ("master_dtype", "param_dtype"))
