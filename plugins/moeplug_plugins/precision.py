"""Built-in precision recipes: ``fp32``, ``bf16``, ``te_fp8`` (needs Transformer Engine), and
the emulated low-precision recipes ``fp8_tensorwise``, ``fp8_delayed``, ``fp8_blockwise``,
``mxfp8`` and ``nvfp4`` (``moeplug.quant``).

Parameters and optimizer state stay fp32 in every recipe; only the forward's compute dtype changes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Literal

import torch

from moeplug.api import (Blockwise, ConfigError, Delayed, hookimpl, MXFP8, NVFP4, Precision,
                         recipe_plan, Tensorwise)


class FP32(Precision):
    name = "fp32"
    compute_dtype = torch.float32

    def autocast(self, device_type: str) -> ContextManager:
        return contextlib.nullcontext()


class BF16(Precision):
    name = "bf16"
    compute_dtype = torch.bfloat16

    def autocast(self, device_type: str) -> ContextManager:
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def make_fp32(options) -> FP32:
    return FP32()


def make_bf16(options) -> BF16:
    return BF16()


def make_te_fp8(options):
    from moeplug_plugins.te_fp8 import TEFP8  # imports transformer_engine: only when chosen
    return TEFP8()


# ---- low-precision recipes (moeplug.quant): exact emulation on any device ---------------------

def _fail(cls: str, name: str, value, rule: str, fix: str) -> None:
    raise ConfigError(f"{cls}.{name} = {value!r}: {rule}. Fix: {fix}")


def _int_at_least(options, name: str, low: int, fix: str) -> None:
    v = getattr(options, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        _fail(type(options).__name__, name, v, f"must be an integer >= {low}", fix)


@dataclass(frozen=True)
class QuantOptions:
    """Shared by every low-precision recipe. The first/last ``bf16_*_layers`` transformer blocks
    (of the model, or of each pipeline chunk) keep bf16 GEMMs; ``quantize_dispatch`` sends
    dispatched token rows in FP8 (the recipe's row format) and dequantizes them on receipt."""

    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    quantize_dispatch: bool = True

    def __post_init__(self) -> None:
        for name in ("bf16_first_layers", "bf16_last_layers"):
            _int_at_least(self, name, 0, "give how many blocks to keep in bf16, e.g. 1")


@dataclass(frozen=True)
class FP8TensorwiseOptions(QuantOptions):
    # hybrid: E4M3 forward, E5M2 gradients (TE's default); e4m3: E4M3 everywhere.
    format: Literal["hybrid", "e4m3"] = "hybrid"
    power_of_2_scales: bool = False


@dataclass(frozen=True)
class FP8DelayedOptions(QuantOptions):
    format: Literal["hybrid", "e4m3"] = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0  # scale = fp8_max / amax / 2^margin (TE's margin, Megatron's --fp8-margin)

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_at_least(self, "amax_history_len", 1,
                      "use e.g. 1024 (TE's default) or 1 (the last step only)")
        _int_at_least(self, "margin", 0,
                      "use 0 (TE's default), or the powers of two of headroom you want")


@dataclass(frozen=True)
class FP8BlockwiseOptions(QuantOptions):
    power_of_2_scales: bool = True


@dataclass(frozen=True)
class MXFP8Options(QuantOptions):
    pass


@dataclass(frozen=True)
class NVFP4Options(QuantOptions):
    weight_2d: bool = True           # 16 x 16 weight tiles (else 1 x 16 like activations)
    random_hadamard: bool = True     # RHT on the weight-gradient GEMM's inputs
    stochastic_rounding: bool = True  # gradients round stochastically
    seed: int = 0                    # RHT signs and stochastic-rounding stream


class QuantizedPrecision(Precision):
    """bf16 autocast with every transformer block's GEMMs through a ``moeplug.quant`` recipe
    (quantize -> dequantize, then the GEMM): the numerics of the low-precision recipe, on any
    device. Parameters, gradients and optimizer state stay fp32."""

    compute_dtype = torch.bfloat16
    quantizes_gemms = True

    def __init__(self, name: str, recipe, options: QuantOptions):
        self.name, self.recipe, self.options = name, recipe, options
        recipe.quantize_dispatch = options.quantize_dispatch  # read by the dispatchers
        self.row_alignment = recipe.row_alignment  # the topk router pads experts' rows to it
        # _naming's result for the last (model, groups, parameters) seen: end_step asks every
        # step, and walking the model's names cost ~0.5 ms a step (79 parameters).
        self._names: tuple | None = None

    def autocast(self, device_type: str) -> ContextManager:
        return _quantized_autocast(device_type, self.recipe, self.options)

    def state_dict(self, model, groups=None):
        if not hasattr(self.recipe, "state_dict"):  # stateless recipes
            return None
        return self.recipe.state_dict(*self._naming(model, groups))

    def load_state_dict(self, state, model, groups=None) -> None:
        if state is not None and hasattr(self.recipe, "load_state_dict"):
            self.recipe.load_state_dict(state, *self._naming(model, groups))

    def end_step(self, model, groups=None, train: bool = True) -> None:
        if not hasattr(self.recipe, "end_step"):  # stateless recipes
            return
        self.recipe.end_step(*self._naming(model, groups),
                             None if groups is None else groups.tp_dp_cp, train)

    def _naming(self, model, groups) -> tuple[dict, dict]:
        # Keyed by the parameters themselves (ids, in order): a model rebuilt or resharded
        # gets other parameter objects, hence a fresh naming.
        key = (id(model), id(groups), tuple(map(id, model.parameters())))
        if self._names is None or self._names[0] != key:
            self._names = (key, _naming(model, groups))
        return self._names[1]


def _naming(model, groups) -> tuple[dict, dict]:
    """What names a GEMM's parameter the same in every layout: ``id(param)`` -> its one-process
    name, and ``id(expert param)`` -> (this rank's first global expert, its local experts)."""
    from moeplug.api import expert_param_names, global_param_names, model_parts
    ep_rank = 0 if groups is None else groups.rank_in("ep")
    experts = {}
    for _, m in model_parts(model):
        params = dict(m.named_parameters())
        for n in expert_param_names(m):  # [L, ...]: global experts ep_rank * L ..
            experts[id(params[n])] = (ep_rank * params[n].shape[0], params[n].shape[0])
    return global_param_names(model), experts


@contextlib.contextmanager
def _quantized_autocast(device_type: str, recipe, o: QuantOptions):
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16), \
            recipe_plan(recipe, o.bf16_first_layers, o.bf16_last_layers):
        yield


def make_fp8_tensorwise(o: FP8TensorwiseOptions) -> QuantizedPrecision:
    return QuantizedPrecision("fp8_tensorwise", Tensorwise(o.format, o.power_of_2_scales), o)


def make_fp8_delayed(o: FP8DelayedOptions) -> QuantizedPrecision:
    return QuantizedPrecision("fp8_delayed",
                              Delayed(o.format, o.amax_history_len, o.amax_compute_algo,
                                      o.margin), o)


def make_fp8_blockwise(o: FP8BlockwiseOptions) -> QuantizedPrecision:
    return QuantizedPrecision("fp8_blockwise", Blockwise(o.power_of_2_scales), o)


def make_mxfp8(o: MXFP8Options) -> QuantizedPrecision:
    return QuantizedPrecision("mxfp8", MXFP8(), o)


def make_nvfp4(o: NVFP4Options) -> QuantizedPrecision:
    return QuantizedPrecision("nvfp4", NVFP4(o.weight_2d, o.random_hadamard,
                                             o.stochastic_rounding, o.seed), o)


QUANTIZED = {
    "fp8_tensorwise": (make_fp8_tensorwise, FP8TensorwiseOptions,
                       "FP8 current (per-tensor) scaling, E4M3 fwd / E5M2 grads (emulated)"),
    "fp8_delayed": (make_fp8_delayed, FP8DelayedOptions,
                    "FP8 delayed scaling from an amax history (emulated)"),
    "fp8_blockwise": (make_fp8_blockwise, FP8BlockwiseOptions,
                      "FP8 1x128 activation / 128x128 weight blocks, DeepSeek-V3 (emulated)"),
    "mxfp8": (make_mxfp8, MXFP8Options,
              "MXFP8: 32-element blocks, E8M0 scales, OCP MX v1.0 (emulated)"),
    "nvfp4": (make_nvfp4, NVFP4Options,
              "NVFP4: E2M1 x 16 blocks, E4M3 + fp32 scales, 16x16 weights, RHT, SR (emulated)"),
}


@hookimpl
def moeplug_register_precisions(registry) -> None:
    registry.add("fp32", make_fp32, description="plain fp32 (no autocast)")
    registry.add("bf16", make_bf16, description="bf16 autocast; fp32 master weights and optimizer state")
    registry.add("te_fp8", make_te_fp8, requires=("transformer_engine",),
                 install_hint="pip install transformer-engine[pytorch] (needs an NVIDIA GPU)",
                 description="FP8 GEMMs through Transformer Engine's fp8_autocast (GPU only)")
    for name, (factory, options_cls, description) in QUANTIZED.items():
        registry.add(name, factory, options_cls=options_cls, description=description)
