"""Precision contract: a name and a compute dtype, an ``autocast`` that computes in that dtype, is
re-enterable and restores the previous state, while parameters and their grads stay fp32 — also
inside a transformer block, where a low-precision recipe (``moeplug.quant``) takes the GEMMs;
``row_alignment`` a positive int; ``end_step`` runs after each step (and after an evaluation)
in one process, and the step-to-step state is JSON-ready and loads back."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from moeplug.interfaces import Precision
from moeplug.quant import block_scope
from moeplug.testing._common import build, expect
from moeplug.testing.capabilities import check_declared


def check_precision(source: Any, name: str | None = None, *, options: Any = None,
                    device_type: str = "cpu") -> None:
    prec, label = build(source, "precision", name, options)
    expect(isinstance(prec, Precision), label, f"is a {type(prec).__name__}, not a Precision")
    check_declared(prec, Precision, label)
    expect(isinstance(prec.name, str) and prec.name, label,
           f"name must be a non-empty str, got {prec.name!r}")
    expect(isinstance(prec.compute_dtype, torch.dtype) and prec.compute_dtype.is_floating_point, label,
           f"compute_dtype must be a floating torch.dtype, got {prec.compute_dtype!r}")

    align = prec.row_alignment
    expect(isinstance(align, int) and not isinstance(align, bool) and align >= 1, label,
           f"row_alignment must be a positive int, got {align!r}")
    layer = nn.Linear(8, 8).to(device_type)
    x = torch.randn(4, 8, device=device_type)
    was_enabled = torch.is_autocast_enabled(device_type)
    for attempt in ("first", "second"):  # one Precision object wraps every step
        with prec.autocast(device_type), block_scope(0, 1):  # as the model runs a block
            y = layer(x)
        expect(y.dtype == prec.compute_dtype, label,
               f"{attempt} use: a Linear under autocast produced {y.dtype}, expected {prec.compute_dtype}")
        expect(torch.is_autocast_enabled(device_type) == was_enabled, label,
               "autocast did not restore the previous autocast state on exit")
        y.float().sum().backward()
        # called as the trainer calls them (groups None: one process)
        ends = _call(label, prec.end_step, "end_step(model, groups, train=True)", layer, None), \
            _call(label, prec.end_step, "end_step(model, groups, train=False)", layer, None,
                  train=False)
        expect(ends == (None, None), label, "end_step must return None")
    expect(layer.weight.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32, label,
           "parameters and their gradients must stay fp32 (master weights)")
    state = _call(label, prec.state_dict, "state_dict(model, groups)", layer, None)
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        expect(False, label, f"state_dict() must be JSON-ready (it goes into meta.json): {e}")
    _call(label, prec.load_state_dict, "load_state_dict(state, model, groups)",
          json.loads(json.dumps(state)), layer, None)


def _call(label: str, method: Any, signature: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return method(*args, **kwargs)
    except TypeError as e:  # an override with another signature than the interface's
        expect(False, label, f"{signature} must accept the interface's arguments: {e}")
