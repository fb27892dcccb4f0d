"""Built-in precision recipes: ``fp32``, ``bf16``, and ``te_fp8`` (needs Transformer Engine).

Parameters and optimizer state stay fp32 in every recipe; only the forward's compute dtype changes.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from moeplug import hookimpl
from moeplug.interfaces import Precision


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


@hookimpl
def moeplug_register_precisions(registry) -> None:
    registry.add("fp32", make_fp32, description="plain fp32 (no autocast)")
    registry.add("bf16", make_bf16, description="bf16 autocast; fp32 master weights and optimizer state")
    registry.add("te_fp8", make_te_fp8, requires=("transformer_engine",),
                 install_hint="pip install transformer-engine[pytorch] (needs an NVIDIA GPU)",
                 description="FP8 GEMMs through Transformer Engine's fp8_autocast (GPU only)")
