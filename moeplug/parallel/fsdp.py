"""FSDP2 over moeplug's layout: torch's ``fully_shard`` applied to a built rank model, from
outside its modules (``parallel.fsdp``; moeplug.training.distributed.build_rank_model calls
:func:`apply_fsdp` once the rank's TP/EP/ETP shards and pipeline chunks are in place).

What is sharded over which ranks (torchtitan's MoE recipe):

* each Experts module (the routed experts of a MoE layer) over the expert-DP group
  (``groups.edp``): the ranks holding the same experts. FSDP's reduce-scatter averages their
  grads over EDP; moeplug.parallel.grad_sync.sync_gradients then rescales them by
  |EDP| / |DP x CP|, to its rule for expert grads: summed over EDP, divided by |DP x CP|
  (every EP rank's tokens are already in them; Megatron's expert_gradient_scaling_factor).
  (FSDP's own set_gradient_divide_factor needs PREMUL_SUM, which gloo lacks.) With EDP = 1
  the experts stay whole, ignored by FSDP, and grad_sync scales them as without FSDP.
* every other parameter of a transformer block (attention, norms, router, dense MLP, shared
  experts) over DP x CP (``groups.dp_cp``): the ranks holding the same dense parameters. FSDP's
  mean over the mesh is grad_sync's average over DP x CP.
* the root (the model, or each pipeline chunk): what the blocks leave (embedding, final norm,
  head), over DP x CP.

A TP, EP or ETP shard is a plain tensor to FSDP: it shards this rank's slice along dim 0 over
the DP mesh and the model's own TP/EP collectives run unchanged on the gathered slices. Grads
of TP-partial parameters (``sequence_parallel``) are summed over TP after the reduce-scatter
(moeplug.parallel.tensor_parallel.sum_partial_grads_over_tp, on the local shards): both are
sums, so their order does not matter.

fully_shard puts new (DTensor) parameters in place; the attributes the rest of moeplug reads
(``partition_dim``, ``sequence_parallel``, ``pipeline_copy``) are copied onto them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Attributes moeplug sets on parameters (tensor_parallel, parallelize.tp, pipeline) and reads later
# (grad sync, grad norm, sharding, checkpoints).
PARAM_ATTRS = ("partition_dim", "sequence_parallel", "pipeline_copy")


def is_sharded(t: torch.Tensor | None) -> bool:
    """``t`` is one of FSDP's DTensors (a managed parameter or its gradient)."""
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a managed tensor (the tensor itself when not managed)."""
    return t.to_local() if is_sharded(t) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """The tensor a managed parameter (or grad, or AdamW moment) shards: this rank's TP/EP
    slice as without FSDP. A collective over the tensor's mesh when it is sharded."""
    return t.full_tensor() if is_sharded(t) else t


def mixed_precision(precision: Any) -> Any:
    """FSDP's policy from the precision recipe: gather the parameters in its compute dtype when
    that is bf16 (fp32 shards stay the master weights), reduce the gradients in fp32 (Megatron's
    accumulate_allreduce_grads_in_fp32); fp32 recipes keep fp32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if precision.compute_dtype == torch.bfloat16:  # declared on moeplug.interfaces.Precision
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def gathered_dtype(module: nn.Module, param: torch.Tensor) -> torch.dtype:
    """The dtype ``param`` of ``module`` computes in: FSDP's policy's (the recipe's bf16) when
    ``module`` is an FSDP unit that gathers in another dtype, else the parameter's own."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    policy = getattr(state, "_mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    return dtype if dtype is not None else param.dtype


def _mesh(group: Any, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group, device.type)


def _roots(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP's root units wrap: the model, or each pipeline chunk of a rank (the
    ModuleList build_rank_model returns with pipeline parallelism)."""
    return list(model) if isinstance(model, nn.ModuleList) else [model]


def _blocks(root: nn.Module) -> list[nn.Module]:
    """The transformer blocks (and MTP layers) of a model or pipeline chunk, each one unit."""
    blocks = getattr(root, "blocks", None)
    found = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks or [])
    return found + list(getattr(root, "mtp", None) or [])


def apply_fsdp(model: nn.Module, groups: Any, precision: Any, reshard_after_forward: bool
               ) -> nn.Module:
    """Shard ``model`` (this rank's model or pipeline ModuleList) in place, as the module
    docstring says; returns it. Collective-free: each rank wraps its own modules."""
    from torch.distributed.fsdp import fully_shard

    from moeplug.interfaces import Experts

    attrs = {n: {a: getattr(p, a) for a in PARAM_ATTRS if hasattr(p, a)}
             for n, p in model.named_parameters()}
    first = next(model.parameters(), None)
    if first is None:  # a pipeline rank whose stages hold nothing (a layout's empty stages)
        return model
    device = first.device
    dense_mesh = _mesh(groups.dp_cp, device)
    expert_mesh = _mesh(groups.edp, device) if groups.edp is not None else None
    policy = mixed_precision(precision)
    kw = dict(mp_policy=policy, reshard_after_forward=reshard_after_forward)
    whole_experts: set[nn.Parameter] = set()  # EDP = 1: left to grad_sync
    done: set[int] = set()  # a block shared by two chunks of one rank is wrapped once
    for root in _roots(model):
        for block in _blocks(root):
            if id(block) in done:
                continue
            done.add(id(block))
            for m in block.modules():
                if not isinstance(m, Experts) or not any(True for _ in m.parameters()):
                    continue
                if expert_mesh is None:
                    whole_experts.update(m.parameters())
                    continue
                # (FSDP averages over EDP; grad_sync rescales to the sum / |DP x CP|: gloo has
                # no PREMUL_SUM for set_gradient_divide_factor.)
                fully_shard(m, mesh=expert_mesh, **kw)
            fully_shard(block, mesh=dense_mesh, ignored_params=whole_experts or None, **kw)
        if any(True for _ in root.parameters()):
            # The root's own parameters (embedding, norm, head) are used again right after
            # the forward by the backward's start: keep them gathered between the two.
            fully_shard(root, mesh=dense_mesh, ignored_params=whole_experts or None,
                        mp_policy=policy, reshard_after_forward=False)
    for n, p in model.named_parameters():
        for a, v in attrs.get(n, {}).items():
            setattr(p, a, v)
    return model


def whole_state(state: dict) -> dict:
    """``state`` (a model's or an AdamW state's tensors) with every sharded tensor made whole:
    what the same layout without FSDP holds, so checkpoints keep one format and reshard to
    and from every layout (moeplug.training.checkpoint, reshard). Collective over each
    tensor's mesh: every rank of it calls this with the same keys in the same order."""
    return {k: whole(v) if is_sharded(v) else v for k, v in state.items()}


def shard_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a whole tensor, as :func:`whole_state` leaves it) laid out
    as the managed tensor ``like`` (``t`` itself when ``like`` is not managed). Every rank
    holds all of ``t``: each keeps its own chunk, nothing is sent."""
    if not is_sharded(like) or is_sharded(t) or tuple(t.shape) != tuple(like.shape):
        return t  # (a misshapen tensor goes on to load_state_dict, which names it)
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(t.to(like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def shard_state(model: nn.Module, state: dict) -> dict:
    """A model state dict of whole tensors as ``model`` (FSDP-sharded) holds them."""
    own = model.state_dict()
    return {k: shard_like(v, own[k]) if k in own else v for k, v in state.items()}
