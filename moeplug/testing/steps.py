"""Forward and backward of a few random micro-batches through a built model, as the
recompute and offloading tests compare them (on vs off must give the same losses and grads)."""

from __future__ import annotations

import torch

from moeplug.training.memory import ActivationMeter


def backward_micro_batches(model, vocab: int, micro_batches: int = 2) -> tuple:
    """(loss per micro-batch, the parameters' grads by name, the peak bytes held for backward)
    for ``micro_batches`` batches of 2 x 16 random tokens (fixed seed), grads accumulated."""
    g = torch.Generator().manual_seed(1)
    meter, losses = ActivationMeter(model), []
    with meter.active():
        for _ in range(micro_batches):
            tok = torch.randint(0, vocab, (2, 16), generator=g)
            out = model(tok, torch.randint(0, vocab, (2, 16), generator=g))
            (out.loss / micro_batches).backward()
            losses.append(out.loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads, meter.peak
