"""Context-parallel attention against one process: the harness the CP and document tests share.

Given full-sequence q, k, v and an upstream gradient, each rank runs moeplug's ``cp_attention``
on its load-balanced chunks at CP 4 and CP 2 with both exchanges, and reports the largest
difference of its output and input gradients from the full-sequence reference's rows.
"""

from __future__ import annotations

from typing import Callable

import torch


def cp_attention_errors(rank: int, world: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        dout: torch.Tensor, reference: Callable[..., torch.Tensor],
                        positions: torch.Tensor | None = None) -> dict[str, float]:
    """``{"cp{W}/{comm}/{out|dq|dk|dv}": max |diff|}`` for W in (4, 2), comm in (allgather, ring).

    ``reference(q, k, v)`` is the one-process attention (e.g. SDPA with the matching mask);
    ``positions`` (B, N), when given, are the document positions the CP pieces mask by.
    """
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.context_parallel import cp_attention, shard_sequence

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = reference(*full)
    out_ref.backward(dout)
    want = [out_ref] + [t.grad for t in full]
    errs: dict[str, float] = {}
    for cp in (4, 2):
        groups = ParallelGroups.build(ParallelConfig(cp=cp), world, rank)
        W, r = groups.size("cp"), groups.rank_in("cp")
        extra = () if positions is None else (shard_sequence(positions, W, r),)
        for comm in ("allgather", "ring"):
            local = [shard_sequence(t, W, r, dim=2).requires_grad_() for t in (q, k, v)]
            out = cp_attention(*local, groups.cp, comm, *extra)
            out.backward(shard_sequence(dout, W, r, dim=2))
            for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in local],
                                      want):
                diff = got - shard_sequence(ref, W, r, dim=2)
                errs[f"cp{cp}/{comm}/{name}"] = diff.abs().max().item()
    return errs
