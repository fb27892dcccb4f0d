"""Distributed optimizer (ZeRO-1): AdamW state sharded over the data-parallel replicas.

Legend: N elements of a bucket (padded to a multiple of W), W ranks of the bucket's group,
n = N / W elements owned by one rank.

Parameters are grouped into buckets by (expert or dense, TP-sharded or not, pipeline copy or
not, weight decay, dtype).
A bucket's replicas live on the ranks of one group: ``dp_cp`` for dense parameters (DP and CP
ranks hold the same ones), ``edp`` for expert parameters. Each rank owns the contiguous slice
``[r*n, (r+1)*n)`` of the bucket's flattened parameters and keeps the AdamW moments of that
slice only (Megatron's DistributedOptimizer layout). A step:

  1. ``reduce_gradients``: TP-partial grads summed over TP (as sync_gradients does), then each
     bucket's flat grad is reduce-scattered over its group and scaled by 1 / |dp_cp| (the same
     scaling sync_gradients applies, so the owned slice equals the all-reduced grad's slice).
  2. ``clip_grad_norm``: the global norm from the owned slices: squares summed over the bucket's
     group (the slices tile the bucket), then over TP for TP-sharded dense buckets, over EP x ETP
     for expert buckets, over PP for everything, pipeline-copy buckets (the last stage's
     embedding twin) left out: the norm ``global_grad_norm`` computes.
  3. ``step``: AdamW on the owned slices (elementwise, so identical to AdamW on the whole
     tensors), then each bucket's slices are all-gathered and copied back into the parameters.

The model's own ``.grad`` tensors keep the unreduced local gradients; only the slices are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeplug.config import TrainConfig
from moeplug.parallel.comm import _all_gather_single, _reduce_scatter_single, group_rank, group_size
from moeplug.parallel.experts import expert_param_names
from moeplug.parallel.tensor_parallel import sum_partial_grads_over_tp
from moeplug.training.optim import MAIN, adamw, param_groups


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: Any            # the replicas' process group (None: this rank only)
    is_expert: bool
    tp_sharded: bool
    pipeline_copy: bool   # a pipeline stage's twin of another stage's params: norm counts it once
    shard: torch.Tensor   # this rank's master slice [n] (fp32; bf16 with train.master_dtype;
                          # fp32 under bf16 parameters with train.param_dtype: bf16)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def slice_len(self) -> int:
        return self.shard.numel()

    @property
    def holds_main(self) -> bool:
        """The slice is the only full-precision copy of its parameters: fp32 slices of bf16
        parameters (train.param_dtype: bf16), which checkpoints must save."""
        return self.shard.dtype != self.params[0].dtype


def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())]) if padded > flat.numel() else flat


def bucket_plan(model: nn.Module, weight_decay: float) -> list[tuple[tuple, list, float]]:
    """The buckets, in order, as (key, parameters, weight decay): the order of the inner
    optimizer's state, which a checkpoint's resharding (moeplug.training.reshard) replays."""
    expert_ids = {id(p) for n, p in model.named_parameters() if n in expert_param_names(model)}
    plan = []
    for pg in param_groups(model, weight_decay):
        keyed: dict[tuple, list[nn.Parameter]] = {}
        for p in pg["params"]:
            key = (id(p) in expert_ids, hasattr(p, "partition_dim"),
                   getattr(p, "pipeline_copy", False), str(p.dtype))
            keyed.setdefault(key, []).append(p)
        plan += [(key, ps, pg["weight_decay"]) for key, ps in sorted(keyed.items(),
                                                                   key=lambda kv: kv[0])]
    return plan


class DistributedAdamW:
    """AdamW whose state is sharded over each parameter's data-parallel replicas (see module
    docstring). Exposes ``param_groups`` (the trainer sets ``lr`` there), ``zero_grad``,
    ``step``, ``state_dict`` / ``load_state_dict`` like a torch optimizer."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, groups: Any) -> None:
        self.model, self.groups = model, groups
        self._dense_scale = 1.0 / groups.size("dp_cp")
        self.buckets: list[_Bucket] = []
        inner_groups = []
        for (is_expert, tp_sharded, copy, _), ps, weight_decay in bucket_plan(model,
                                                                             cfg.weight_decay):
            group = groups.edp if is_expert else groups.dp_cp
            W, r = group_size(group), group_rank(group)
            n = math.ceil(sum(p.numel() for p in ps) / W)
            with torch.no_grad():
                flat = _flat([p.detach() for p in ps], n * W)
            master = torch.bfloat16 if cfg.master_dtype == "bf16" else torch.float32
            shard = flat[r * n:(r + 1) * n].clone().to(master).requires_grad_(True)
            self.buckets.append(_Bucket(ps, group, is_expert, tp_sharded, copy, shard))
            inner_groups.append({"params": [shard], "weight_decay": weight_decay})
        # AdamW (bf16 moments with train.optimizer_dtype: bf16) on the owned slices. A pipeline
        # rank whose stages hold nothing (a layout's empty stages) has one empty group, so the
        # trainer's lr updates and state_dict work as on every other rank.
        self.inner = adamw(inner_groups or [{"params": [], "weight_decay": 0.0}], cfg)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.shard.grad = None
            for p in b.params:
                p.grad = None

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter every bucket's grads over its replicas into the owned slices."""
        sum_partial_grads_over_tp(self.model, self.groups.tp)
        for b in self.buckets:
            W, n = group_size(b.group), b.slice_len
            flat = _flat([p.grad if p.grad is not None else torch.zeros_like(p)
                          for p in b.params], n * W).float()
            if b.group is None:
                owned = flat
            else:
                owned = flat.new_empty(n)
                _reduce_scatter_single(owned, flat, group=b.group)
            b.shard.grad = owned.mul_(self._dense_scale).to(b.shard.dtype)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the reduced gradient (same on every rank); scales the owned slices
        by ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0``. Returns the norm."""
        g = self.groups
        parts = {"dense": torch.zeros((), dtype=torch.float64),
                 "tp": torch.zeros((), dtype=torch.float64),
                 "expert": torch.zeros((), dtype=torch.float64)}
        for b in self.buckets:
            if b.pipeline_copy:
                # The last stage's embedding copy (moeplug.parallelize.pipeline) holds the same
                # grad as the first stage's: summing over PP would count it twice.
                continue
            kind = "expert" if b.is_expert else ("tp" if b.tp_sharded else "dense")
            parts[kind] += b.shard.grad.double().pow(2).sum()
        for kind, group in (("dense", g.dp_cp), ("tp", g.dp_cp), ("expert", g.edp)):
            if group is not None:
                dist.all_reduce(parts[kind], group=group)  # the owned slices tile each bucket
        if g.tp is not None:
            dist.all_reduce(parts["tp"], group=g.tp)
        if g.ep_etp is not None:
            dist.all_reduce(parts["expert"], group=g.ep_etp)
        total = parts["dense"] + parts["tp"] + parts["expert"]
        if g.pp is not None:
            dist.all_reduce(total, group=g.pp)
        norm = total.sqrt()
        if max_norm > 0 and math.isfinite(float(norm)):
            coef = float(max_norm) / (float(norm) + 1e-6)
            if coef < 1.0:
                for b in self.buckets:
                    b.shard.grad.mul_(coef)
        return norm.float()

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for b in self.buckets:
            W, n = group_size(b.group), b.slice_len
            # fp32 slices of bf16 parameters: gather their bf16 image (half the bytes, as
            # Megatron all-gathers its bf16 params), rounded to nearest here as the copy into
            # the parameters would round it, so the parameters get the same bits.
            src = b.shard.detach().to(b.params[0].dtype) if b.holds_main else b.shard.detach()
            if b.group is None:
                flat = src
            else:
                flat = src.new_empty(n * W)
                _all_gather_single(flat, src.contiguous(), group=b.group)
            offset = 0
            for p in b.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def state_dict(self) -> dict:
        """The inner AdamW's state; with bf16 parameters over fp32 slices (``param_dtype:
        bf16``) each bucket's state also holds its slice as ``"main"``: the parameters are
        only its bf16 image, so a resume could not re-read it from them."""
        sd = self.inner.state_dict()
        state = {i: dict(s) for i, s in sd["state"].items()}  # not the live state's dicts
        for i, b in enumerate(self.buckets):
            if i in state and b.holds_main:
                state[i][MAIN] = b.shard.detach()
        return {**sd, "state": state}

    def load_state_dict(self, state: dict) -> None:
        mains = {int(i): s[MAIN] for i, s in state["state"].items() if MAIN in s}
        self.inner.load_state_dict({**state, "state": {
            i: {k: v for k, v in s.items() if k != MAIN} for i, s in state["state"].items()}})
        # The master slices are the parameters' values: re-read them from the (loaded) model,
        # or, where the parameters are their bf16 image, take the saved fp32 slices.
        self.reload_masters(mains)

    def reload_masters(self, mains: dict | None = None) -> None:
        """Set the fp32 master slices from the parameters' current values (``mains``: saved
        fp32 slices by bucket, taken instead where a bucket's parameters are their bf16 image).
        The slices are cut at construction, from whatever the parameters held then: a model
        loaded afterwards (a checkpoint with no optimizer state, e.g. a ``convert import``)
        must call this, or the first step writes the construction-time values back."""
        mains = mains or {}
        with torch.no_grad():
            for i, b in enumerate(self.buckets):
                if i in mains and b.holds_main:
                    b.shard.copy_(mains[i].reshape(b.shard.shape))
                    continue
                W, r, n = group_size(b.group), group_rank(b.group), b.slice_len
                b.shard.copy_(_flat([p.detach() for p in b.params], n * W)[r * n:(r + 1) * n])
