"""plugins.precision's recipes (moeplug.quant, the precision plugins): the dtype the model
computes in. (What the sync-free region, capture and delay_wgrad run under a recipe: their
modules.)"""

from __future__ import annotations

from moeplug.config._checks import ConfigError, _fail
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


def _experts_runs_recipe(f: Facts) -> None:
    # A recipe that quantizes GEMMs (Precision.quantizes_gemms) reaches an experts backend's
    # GEMMs only through moeplug.quant.active_recipe(); one that does not declare it runs them
    # (runs_recipe) would silently stay in full precision: refused, never bypassed.
    if f.precision is None or not f.precision.quantizes_gemms or f.experts.runs_recipe:
        return
    name, recipe = f.experts.__name__, f.cfg.plugins.precision
    raise ConfigError(
        f"plugins.experts = {f.cfg.plugins.experts!r}: {name} does not declare runs_recipe, "
        f"which plugins.precision: {recipe} needs (its forward runs its GEMMs through "
        f"moeplug.quant.active_recipe(): quant_expert_mlp, or F.linear, which the recipe "
        f"intercepts; else they would stay in full precision). Fix: declare runs_recipe = True "
        f"on {name} once its forward does (moeplug.interfaces.Experts), use plugins.experts: "
        f"grouped, or plugins.precision: bf16")


RULES = (*(Rule("precision", "config", f"TrainConfig.{name}", _bf16_weights(name),
                {"train": {name: "bf16"}}) for name in ("master_dtype", "param_dtype")),
         Rule("precision", "experts", "plugins.experts", _experts_runs_recipe,
              {"plugins": {"precision": "fp8_tensorwise"}}))
