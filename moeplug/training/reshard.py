"""Resuming a checkpoint under another parallel layout (resharding): one process, data
parallelism with or without the distributed optimizer, expert and tensor parallelism
(TP2 x EP2 -> EP2 -> one process...), in any combination; cp = pp = etp = 1 on both sides.

The checkpoint is first turned into the one-process state: rank 0's model file, each expert
parameter concatenated over the EP ranks' files (experts by global index), each TP-split one
over the TP ranks' files along the dim meta.json's ``tp_dims`` records. The optimizer
state is turned into a layout-free form first — AdamW's ``step``, ``exp_avg`` and
``exp_avg_sq`` per parameter *name*, at the parameter's full shape — and then cut for the new
layout:

- a plain AdamW file keys its state by parameter index in ``param_groups`` order;
- the distributed optimizer (moeplug.training.dist_optim) keeps, per bucket of
  ``bucket_plan``, the slice ``[r*n, (r+1)*n)`` of the bucket's flattened moments on its rank
  ``r`` (every rank is in the one replica group here, in rank order): the slices of all ranks
  concatenated are the flat moments, which split back into the parameters in bucket order.

Then each rank cuts its shard with the rules the model was built with
(moeplug.parallel.tensor_parallel.shard_state_dict). A saved TP or EP layout with the
distributed optimizer, and CP, PP or ETP layouts, still load only under the same layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from moeplug.training.optim import param_groups

SPLITTING = ("cp", "pp", "etp")  # degrees not resharded here
MOMENTS = ("exp_avg", "exp_avg_sq")
TP_DIMS = "tp_dims"  # meta.json: {parameter name: the dim TP split it along} of a TP run


def can_reshard(saved: dict | None, now: dict | None, tp_dims: dict | None = None) -> bool:
    """True when a checkpoint written under layout ``saved`` (with meta.json's ``tp_dims``)
    loads under ``now`` (None: one process): neither uses CP, PP or ETP; a saved TP layout
    recorded its split dims; a saved TP or EP layout used the plain optimizer (its ZeRO-1
    buckets hold local shards, not reassembled here)."""
    def ok(layout: dict | None) -> bool:
        return all((layout or {}).get(k, 1) == 1 for k in SPLITTING)
    saved = saved or {}
    split = saved.get("ep", 1) > 1 or saved.get("tp", 1) > 1
    return (ok(saved) and ok(now) and not (split and saved.get("distributed_optimizer"))
            and (saved.get("tp", 1) == 1 or isinstance(tp_dims, dict)))


def _group_of_rank0(layout: dict, kind: str) -> list[int]:
    """Global ranks of rank 0's ``kind`` group ("ep", "tp") under ``layout``, in group order."""
    from moeplug.parallel.layout import ParallelConfig, layout_rank_groups
    pc = ParallelConfig(tp=layout["tp"], cp=layout["cp"], dp=layout["dp"], pp=layout["pp"],
                        ep=layout["ep"], etp=layout["etp"], order=layout["order"],
                        sequence_parallel=layout.get("sequence_parallel", False))
    return layout_rank_groups(pc.resolve(layout["world_size"]))[kind][0]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _unsplit(layout: dict | None, model: nn.Module, files: list[str],
             load: Callable[[str], dict], key: Callable[[str], list[str]],
             tp_dims: dict | None) -> dict:
    """Rank 0's tensors, with each expert tensor (keys ``key(name)`` of expert parameter
    ``name``) concatenated along dim 0 over the EP ranks' files (all experts by global index)
    and each TP-split one along its ``tp_dims`` dim over the TP ranks' files."""
    from moeplug.parallel.experts import expert_param_names
    out = dict(load(files[0]))
    for kind, names in (("ep", {n: 0 for n in expert_param_names(model)}),
                        ("tp", tp_dims or {})):
        if layout and layout.get(kind, 1) > 1:
            per_rank = [load(files[r]) for r in _group_of_rank0(layout, kind)]
            for name, dim in names.items():
                for k in key(name):
                    out[k] = torch.cat([t[k] for t in per_rank], dim=dim)
    return out


def global_model_state(layout: dict | None, model: nn.Module, files: list[str],
                       load: Callable[[str], dict],
                       tp_dims: dict | None = None) -> dict[str, torch.Tensor]:
    """The one-process state dict (all experts) of a checkpoint written under ``layout``
    (``files[r]``: rank r's model file; ``load`` reads a verified file)."""
    return _unsplit(layout, model, files, load, lambda name: [name], tp_dims)


def tp_dims_of(model: nn.Module) -> dict[str, int]:
    """{name: partition_dim} of this rank's TP-split parameters (saved as meta ``tp_dims``)."""
    return {n: p.partition_dim for n, p in model.named_parameters()
            if hasattr(p, "partition_dim")}


def global_optimizer_state(layout: dict | None, model: nn.Module, optim_files: list[str],
                           load: Callable[[str], dict], tp_dims: dict | None = None
                           ) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW state per parameter name at full shape, from the optimizer files of a checkpoint
    written under ``layout`` (``optim_files[r]``: rank r's; ``load`` reads a verified file).
    Raises KeyError naming a missing tensor when the files do not hold this model's state."""
    from moeplug.training.dist_optim import bucket_plan

    names, out = _names(model), {}
    if not any(k.startswith("state.") for k in load(optim_files[0])):
        return out  # saved before the first optimizer step: no state to carry over
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
    # plain AdamW: state keyed by the index in param_groups order, the same on every rank;
    # replicas hold the same state, EP ranks their own experts'
    params = [p for g in param_groups(model, 0.0) for p in g["params"]]
    index = {names[id(p)]: i for i, p in enumerate(params)}
    tensors = _unsplit(layout, model, optim_files, load,
                       lambda name: [f"state.{index[name]}.{k}" for k in MOMENTS], tp_dims)
    for name, i in index.items():
        out[name] = {k: tensors[f"state.{i}.{k}"] for k in ("step", *MOMENTS)}
    return out


def local_model_state(model: nn.Module, full: dict[str, torch.Tensor],
                      groups: Any) -> dict[str, torch.Tensor]:
    """``full`` (:func:`global_model_state`) with each parameter cut to this rank's shard."""
    from moeplug.parallel.sharding import shard_state_dict
    return full if groups is None else {**full, **shard_state_dict(model, full, groups)}


def load_global_optimizer_state(optimizer: Any, model: nn.Module,
                                state: dict[str, dict[str, torch.Tensor]], groups: Any) -> None:
    """Cut ``state`` (:func:`global_optimizer_state`) for this rank's ``optimizer`` — a torch
    AdamW or a DistributedAdamW over ``model`` built with ``groups`` (None: one process) — and
    load it. Load the model first: the distributed optimizer re-reads its fp32 master slices
    from the parameters."""
    from moeplug.parallel.comm import group_rank, group_size
    from moeplug.training.dist_optim import DistributedAdamW, _flat

    if not state:  # saved before the first optimizer step: the fresh optimizer is right
        return
    names = _names(model)
    if groups is not None:  # this rank's experts (and any other shard) of every moment
        from moeplug.parallel.sharding import shard_state_dict
        cut = {k: shard_state_dict(model, {n: v[k] for n, v in state.items()}, groups)
               for k in MOMENTS}
        state = {n: {"step": v["step"], **{k: cut[k][n] for k in MOMENTS}}
                 for n, v in state.items()}
    if isinstance(optimizer, DistributedAdamW):
        per_bucket = {}
        for b, bucket in enumerate(optimizer.buckets):
            W, r, n = group_size(bucket.group), group_rank(bucket.group), bucket.slice_len
            mine = {k: _flat([state[names[id(p)]][k].float() for p in bucket.params],
                             n * W)[r * n:(r + 1) * n].clone() for k in MOMENTS}
            per_bucket[b] = {"step": state[names[id(bucket.params[0])]]["step"].clone(), **mine}
        inner_groups = optimizer.inner.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": per_bucket, "param_groups": inner_groups})
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per_param = {i: {k: v.clone() for k, v in state[names[id(p)]].items()}
                 for i, p in enumerate(params)}
    optimizer.load_state_dict({"state": per_param,
                               "param_groups": optimizer.state_dict()["param_groups"]})
