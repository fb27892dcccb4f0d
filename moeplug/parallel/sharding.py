"""A single-process state dict cut into one rank's shards: the one place that knows how each
parameter is split (EP: global experts along dim 0; ETP: each expert's F-slice; TP: the
``partition_dim`` chunk). Building a parallel model, checking its gradients and resharding a
checkpoint (moeplug.training.reshard) all cut with these rules.

Kept apart from moeplug.parallel.tensor_parallel (the TP layers and regions, which model code
imports) and moeplug.parallel.experts (which parameters are experts): the rules need both, and
neither of those needs them, so no import goes back.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from moeplug.parallel.expert_tp import etp_slice
from moeplug.parallel.experts import expert_param_names, local_expert_ids


def tp_slice(full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s contiguous chunk of ``full`` along ``partition_dim``."""
    if full.shape[partition_dim] % tp_size:
        raise ValueError(f"dim {partition_dim} of a tensor of shape {tuple(full.shape)} is not "
                         f"divisible by the tensor-parallel size {tp_size}. Fix: build both "
                         "models from the same config")
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def shard_parameters(model: nn.Module, full_state: Mapping[str, torch.Tensor], *,
                     ep: tuple[int, int] = (0, 1), etp: tuple[int, int] = (0, 1),
                     tp: tuple[int, int] = (0, 1), caller: str = "shard_parameters"
                     ) -> dict[str, torch.Tensor]:
    """This rank's shard of a single-process state dict, for every parameter of ``model``.

    ``ep``/``etp``/``tp`` are (rank, size) pairs. Expert parameters: global experts of this EP
    rank (dim 0), then this ETP rank's F-slice (:func:`moeplug.parallel.expert_tp.etp_slice`).
    Parameters with ``partition_dim``: this TP rank's chunk. Everything else: whole. Works on
    grads too (pass a dict of reference grads). ``caller`` prefixes the error messages.
    """
    expert_names = expert_param_names(model)
    (ep_rank, ep_size), (etp_rank, etp_size), (tp_rank, tp_size) = ep, etp, tp
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name not in full_state:
            raise KeyError(f"{caller}: parameter '{name}' is missing from the source state "
                           "dict. Fix: pass the state_dict of a model built from the same config "
                           "on one process")
        src = full_state[name]
        if name in expert_names:
            ids = local_expert_ids(src.shape[0], ep_size, ep_rank)
            if len(ids) != p.shape[0]:
                raise ValueError(f"{caller}: '{name}' holds {p.shape[0]} local experts here but "
                                 f"the source has {src.shape[0]} experts / EP {ep_size} = "
                                 f"{len(ids)}. Fix: build this model with ep_size {ep_size} and "
                                 "the same num_experts as the source")
            src = etp_slice(name, src[ids.start:ids.stop], full_state, etp_rank, etp_size)
        elif hasattr(p, "partition_dim"):
            src = tp_slice(src, p.partition_dim, tp_rank, tp_size)
        if src.shape != p.shape:
            raise ValueError(f"{caller}: '{name}' has shape {tuple(p.shape)} here but "
                             f"{tuple(src.shape)} in the source (this rank's shard of it). Fix: "
                             "build both models from the same ModelConfig (and this one with "
                             "these groups)")
        out[name] = src
    return out


def shard_state_dict(model: nn.Module, full_state: Mapping[str, torch.Tensor],
                     groups: Any) -> dict[str, torch.Tensor]:
    """This rank's shard of a single-process state dict, for ``model`` built with ``groups``
    (:func:`shard_parameters` at this rank's EP, ETP and TP coordinates)."""
    return shard_parameters(
        model, full_state, caller="shard_state_dict",
        ep=(groups.rank_in("ep"), groups.size("ep")),
        etp=(groups.rank_in("etp"), groups.size("etp")),
        tp=(groups.rank_in("tp"), groups.size("tp")))


@torch.no_grad()
def load_parallel_shard(model: nn.Module, full_state: Mapping[str, torch.Tensor],
                        groups: Any) -> None:
    """Copy :func:`shard_state_dict` into ``model`` (buffers are left alone: they are derived)."""
    shards = shard_state_dict(model, full_state, groups)
    for name, p in model.named_parameters():
        p.copy_(shards[name])


@torch.no_grad()
def load_expert_shard(model: nn.Module, full_state: Mapping[str, torch.Tensor], ep_rank: int,
                      ep_size: int) -> None:
    """Copy a single-process state dict (all E experts) into an EP rank's ``model``.

    Expert parameters take global experts ``ep_rank*L .. (ep_rank+1)*L - 1`` (rows of dim 0);
    every other parameter is copied whole. Buffers are left alone (they are derived, e.g. RoPE).
    """
    shards = shard_parameters(model, full_state, ep=(ep_rank, ep_size), caller="load_expert_shard")
    for name, p in model.named_parameters():
        p.copy_(shards[name])
