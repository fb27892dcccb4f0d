"""Resuming a checkpoint under another parallel layout (resharding), where both keep the model
whole: one process, or pure data parallelism (tp = cp = pp = ep = etp = 1), with or without the
distributed optimizer, any number of replicas.

Every rank of such a run saved the whole model, so rank 0's model file is taken. The optimizer
state is turned into a layout-free form first — AdamW's ``step``, ``exp_avg`` and
``exp_avg_sq`` per parameter *name*, at the parameter's full shape — and then cut for the new
layout:

- a plain AdamW file keys its state by parameter index in ``param_groups`` order;
- the distributed optimizer (moeplug.training.dist_optim) keeps, per bucket of
  ``bucket_plan``, the slice ``[r*n, (r+1)*n)`` of the bucket's flattened moments on its rank
  ``r`` (every rank is in the one replica group here, in rank order): the slices of all ranks
  concatenated are the flat moments, which split back into the parameters in bucket order.

Layouts that split the model (TP, PP, EP, ETP, CP) are still refused under another layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from moeplug.training.optim import param_groups

SPLITTING = ("tp", "cp", "pp", "ep", "etp")
MOMENTS = ("exp_avg", "exp_avg_sq")


def model_is_whole(layout: dict | None) -> bool:
    """True when every rank of ``layout`` (None: one process) holds the whole model."""
    return all((layout or {}).get(k, 1) == 1 for k in SPLITTING)


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def global_optimizer_state(layout: dict | None, model: nn.Module, optim_files: list[str],
                           load: Callable[[str], dict]) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW state per parameter name at full shape, from the optimizer files of a checkpoint
    written under ``layout`` (``optim_files[r]``: rank r's; ``load`` reads a verified file).
    Raises KeyError naming a missing tensor when the files do not hold this model's state."""
    from moeplug.training.dist_optim import bucket_plan

    names, out = _names(model), {}
    if layout and layout.get("distributed_optimizer"):
        shards = [load(f) for f in optim_files]
        # the weight decay value only labels the groups; it does not change the plan
        for b, (_, params, _) in enumerate(bucket_plan(model, 0.0)):
            flat = {k: torch.cat([s[f"state.{b}.{k}"] for s in shards]) for k in MOMENTS}
            offset = 0
            for p in params:
                out[names[id(p)]] = {"step": shards[0][f"state.{b}.step"], **{
                    k: flat[k][offset:offset + p.numel()].view_as(p) for k in MOMENTS}}
                offset += p.numel()
        return out
    tensors = load(optim_files[0])  # plain AdamW: every replica holds the same whole state
    params = [p for g in param_groups(model, 0.0) for p in g["params"]]
    for i, p in enumerate(params):
        out[names[id(p)]] = {k: tensors[f"state.{i}.{k}"] for k in ("step", *MOMENTS)}
    return out


def load_global_optimizer_state(optimizer: Any, model: nn.Module,
                                state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Cut ``state`` (:func:`global_optimizer_state`) for this rank's ``optimizer`` — a torch
    AdamW or a DistributedAdamW over ``model`` — and load it. Load the model first: the
    distributed optimizer re-reads its fp32 master slices from the parameters."""
    from moeplug.parallel.comm import group_rank, group_size
    from moeplug.training.dist_optim import DistributedAdamW, _flat

    names = _names(model)
    if isinstance(optimizer, DistributedAdamW):
        per_bucket = {}
        for b, bucket in enumerate(optimizer.buckets):
            W, r, n = group_size(bucket.group), group_rank(bucket.group), bucket.slice_len
            mine = {k: _flat([state[names[id(p)]][k].float() for p in bucket.params],
                             n * W)[r * n:(r + 1) * n].clone() for k in MOMENTS}
            per_bucket[b] = {"step": state[names[id(bucket.params[0])]]["step"].clone(), **mine}
        groups = optimizer.inner.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": per_bucket, "param_groups": groups})
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per_param = {i: {k: v.clone() for k, v in state[names[id(p)]].items()}
                 for i, p in enumerate(params)}
    optimizer.load_state_dict({"state": per_param,
                               "param_groups": optimizer.state_dict()["param_groups"]})
