"""Quantized token exchange: a dispatcher sends rows in the recipe's row format (FP8 payload +
scales), dequantizes on receipt, and sends gradients back in full precision (as Megatron-Core's
FP8 dispatch). ``WIRE`` counts what went on the wire, for the benchmark and the logs."""

from __future__ import annotations

from typing import Callable

import torch

WIRE = {"rows": 0, "bytes": 0}  # rows sent quantized, and their payload + scale bytes


def reset_wire() -> None:
    WIRE.update(rows=0, bytes=0)


def wire_bytes_per_row(recipe, hidden: int) -> float:
    """Bytes a dispatched row of ``hidden`` features takes on the wire under ``recipe``."""
    q, s = recipe.quantize_rows(torch.zeros(1, hidden))
    return float(q.numel() * q.element_size() + s.numel() * s.element_size())


class _QuantizedExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, recipe, send, send_back):
        q, scales = recipe.quantize_rows(x_SD.detach())
        WIRE["rows"] += q.shape[0]
        WIRE["bytes"] += q.numel() * q.element_size() + scales.numel() * scales.element_size()
        q = send(q.view(torch.uint8)).view(q.dtype)  # fp8 travels as bytes (any backend)
        ctx.send_back = send_back
        return recipe.dequantize_rows(q, send(scales)).to(x_SD.dtype)

    @staticmethod
    def backward(ctx, grad_SD):
        with torch.no_grad():
            return ctx.send_back(grad_SD), None, None, None


def quantized_exchange(x_SD: torch.Tensor, recipe, send: Callable, send_back: Callable):
    """``send(rows)`` moves rows (any trailing shape, any dtype) to their ranks; ``send_back``
    is its inverse, used for the gradient. Returns the received rows, dequantized."""
    return _QuantizedExchange.apply(x_SD, recipe, send, send_back)
