"""Gradient reduction across data-parallel replicas, and the global gradient norm.

Call order in a training step (after ``loss.backward()``, before clipping and ``optimizer.step()``):

    sync_gradients(model, groups)                       # every rank, same order
    norm = clip_grad_norm(model, groups, max_norm)      # global norm: same value on every rank

What each rank's backward leaves in ``.grad`` (each rank's loss is the mean over *its* tokens):
  * non-expert parameters (attention, norms, embeddings, router, dense MLP) are replicated; their
    grad is d(own loss)/dp. Averaging over the DP x CP group gives d(mean of the DP losses)/dp.
  * expert parameters are sharded over EP; the dispatcher's all-to-all / reduce-scatter backward
    already brought in the grads of every EP rank's tokens, so their grad is
    d(sum of the EP group's losses)/dp. Summing over the expert-DP group (the other replicas of
    the same experts) covers every rank's loss once; dividing by the DP x CP size turns that sum
    into the same mean the dense grads get. (Megatron's DDP: expert_gradient_scaling_factor =
    1 / data-parallel size, reduced over the expert-DP group.)
With EP = world (EDP = 1) the expert grads need no communication, only the 1/DP scaling.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from moeplug.parallel.experts import expert_param_names
from moeplug.parallel.fsdp import is_sharded, local
from moeplug.parallel.tensor_parallel import sum_partial_grads_over_tp


def _split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    expert_names = expert_param_names(model)
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (expert if name in expert_names else dense).append(p)
    return dense, expert


def _unsharded(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters FSDP does not manage (parallel.fsdp: the managed ones' grads were already
    reduce-scattered, averaged as below, by FSDP's backward; moeplug.parallel.fsdp)."""
    return [p for p in params if not is_sharded(p)]


def _all_reduce_grads(params: Iterable[nn.Parameter], group: Any, scale: float) -> None:
    """Sum ``p.grad`` over ``group`` (None: this rank only), then multiply by ``scale``.

    One flat buffer per dtype: gloo pays a round trip per collective, and a tiny model has
    dozens of parameters. A missing grad counts as zeros (and becomes a zero tensor) so every
    rank contributes the same buffer layout - otherwise the ranks' buffers would not line up.
    bf16 grads (bf16 parameters) are summed in fp32 and rounded once, as Megatron reduces bf16
    grads in fp32 (``accumulate_allreduce_grads_in_fp32``): a bf16 ring or tree would round
    every partial sum.
    """
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        ps = by_dtype[dtype]
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        if dtype == torch.bfloat16 and group is not None:
            flat = flat.float()
        if group is not None:
            dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for p, g in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p.grad))


@torch.no_grad()
def sync_gradients(model: nn.Module, groups: Any) -> None:
    """Average non-expert grads over DP x CP; sum expert grads over expert-DP and divide by the
    DP x CP size (see the module docstring for why). ``groups`` is a ParallelGroups."""
    dense, expert = _split_params(model)
    # TP: grads of parameters that saw only this rank's token chunk (SP norms, MoE routers) are
    # partial; sum them over TP first (moeplug.parallel.tensor_parallel).
    sum_partial_grads_over_tp(model, groups.tp)
    scale = 1.0 / groups.size("dp_cp")
    _all_reduce_grads(_unsharded(dense), groups.dp_cp, scale)
    _all_reduce_grads(_unsharded(expert), groups.edp, scale)
    # FSDP averaged the expert grads it shards over EDP: the rule is their sum over EDP divided
    # by |DP x CP| (moeplug.parallel.fsdp).
    rescale = groups.size("edp") * scale
    for p in expert:
        if is_sharded(p) and p.grad is not None and rescale != 1.0:
            local(p.grad).mul_(rescale)


@torch.no_grad()
def global_grad_norm(model: nn.Module, groups: Any) -> torch.Tensor:
    """L2 norm of the whole model's gradient (after :func:`sync_gradients`), the same on every
    rank: non-expert grads are replicated, expert grads are summed over the EP x ETP shards,
    and the pipeline stages' sums over ``groups.pp``. Pass the rank's model chunks as one module
    (e.g. ``nn.ModuleList(chunks)``) with pipeline parallelism."""
    dense, expert = _split_params(model)

    def sq(ps: list[nn.Parameter], shard_group: Any) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for p in ps:
            # A pipeline stage's twin of a parameter held by another stage (the last stage's
            # embedding copy, moeplug.parallelize.pipeline) holds the same grad: count it once.
            if p.grad is not None and not getattr(p, "pipeline_copy", False) \
                    and not is_sharded(p):
                total += p.grad.detach().double().pow(2).sum().cpu()
        # FSDP's shards (parallel.fsdp) tile each parameter over its mesh: their squares are
        # summed over that group, which leaves what the whole parameter's grad gives.
        shards = torch.zeros((), dtype=torch.float64)
        for p in ps:
            if p.grad is not None and is_sharded(p) and not getattr(p, "pipeline_copy", False):
                shards += local(p.grad).detach().double().pow(2).sum().cpu()
        if any(is_sharded(p) for p in ps) and shard_group is not None:
            dist.all_reduce(shards, group=shard_group)
        return total + shards

    expert_sq = sq(expert, groups.edp)
    if groups.ep_etp is not None:
        dist.all_reduce(expert_sq, group=groups.ep_etp)
    # TP-sharded dense parameters (``partition_dim``) hold disjoint slices: add their squares
    # over TP; the replicated ones are counted once per rank.
    tp_sq = sq([p for p in dense if hasattr(p, "partition_dim")], groups.dp_cp)
    if groups.tp is not None:
        dist.all_reduce(tp_sq, group=groups.tp)
    total_sq = sq([p for p in dense if not hasattr(p, "partition_dim")], groups.dp_cp) + tp_sq \
        + expert_sq
    if groups.pp is not None:  # pipeline stages hold disjoint parameters: add their squares
        dist.all_reduce(total_sq, group=groups.pp)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, groups: Any, max_norm: float) -> torch.Tensor:
    """Scale every grad by ``min(1, max_norm / (norm + 1e-6))`` (torch.nn.utils.clip_grad_norm_'s
    rule) using the global norm, so every rank applies the same factor. Returns the norm."""
    norm = global_grad_norm(model, groups)
    if max_norm > 0 and math.isfinite(float(norm)):
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm.float()
