"""fp32 sums of bf16 grads over a step's micro-batches (Megatron's fp32 main grads).

The trainer enters one per multi-micro-batch step; the pipeline schedules call its ``add``
after each backward op. Its own module because the dry run (moeplug.plan.dry_run) wraps it to
mark the sums as gradients.
"""

from __future__ import annotations

from typing import Any

import torch


class Fp32GradAccumulation:
    """Sums the bf16 grads of bf16 parameters (``train.param_dtype`` / ``master_dtype: bf16``)
    over a step's micro-batches in fp32, as Megatron accumulates bf16 grads into fp32 main
    grads: autograd would add each micro-batch's grad into the bf16 ``.grad`` and round every
    partial sum. Inside ``with``, a post-accumulate-grad hook on each such parameter moves its
    grad into the fp32 sum as soon as autograd has accumulated it (dropping ``.grad``), so a
    backward never holds a whole bf16 grad set beside the fp32 sums (Megatron's main_grad
    hooks: 4 bytes a parameter at the peak, not 6). :meth:`add` after each micro-batch's
    backward moves what no hook saw (weight grads summed in by hand, moeplug.ops.delayed_wgrad);
    after the last it writes the sums back, rounded once. fp32 grads are left to autograd. The
    pipeline schedules call ``add`` after each of their backward ops
    (``forward_backward_pipeline(grad_accumulation=...)``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.dtype == torch.bfloat16]
        self.sums: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def __enter__(self) -> "Fp32GradAccumulation":
        self._hooks = [p.register_post_accumulate_grad_hook(self.move)
                       for p in self.params if p.requires_grad]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def move(self, p: torch.Tensor) -> None:
        """``p``'s grad into its fp32 sum (the first one makes the sum)."""
        if p.grad is None:
            return
        total = self.sums.get(id(p))
        if total is None:
            self.sums[id(p)] = p.grad.float()
        else:
            total.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def add(self, last: bool) -> None:
        for p in self.params:
            self.move(p)
        if last:
            for p in self.params:
                total = self.sums.pop(id(p), None)
                if total is not None:
                    p.grad = total.to(p.dtype)
