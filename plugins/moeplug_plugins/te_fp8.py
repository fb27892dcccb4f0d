"""``te_fp8`` precision: Transformer Engine FP8 autocast over bf16. Imported only when created."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import transformer_engine.pytorch as te  # the optional dependency; see precision.make_te_fp8

from moeplug.api import Precision


class TEFP8(Precision):
    name = "te_fp8"
    compute_dtype = torch.bfloat16

    def autocast(self, device_type: str) -> ContextManager:
        return _fp8_autocast(device_type)


@contextlib.contextmanager
def _fp8_autocast(device_type: str):
    # Non-FP8 ops run in bf16; TE modules inside switch their GEMMs to FP8.
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16), te.fp8_autocast(enabled=True):
        yield
