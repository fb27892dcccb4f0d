"""AdamW over FSDP's sharded parameters (``parallel.fsdp``; moeplug.parallel.fsdp).

torch's AdamW runs unchanged on the DTensor shards: each rank updates its own slice, and the
moments are DTensors laid out as their parameters (elementwise, so identical to AdamW on the
whole tensors). Only its state dict differs: whole moments in and out, as the same layout
without FSDP holds them, so a checkpoint keeps one format whatever FSDP does
(moeplug.training.checkpoint and reshard read and write it unchanged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeplug.config import TrainConfig
from moeplug.parallel.fsdp import is_sharded, local, shard_like, whole_state
from moeplug.training.optim import AdamW, lr_at, param_groups


class ShardedAdamW(AdamW):
    """AdamW whose ``step`` updates each rank's shards, whose ``state_dict`` gathers sharded
    moments whole (a collective over each parameter's mesh: call it on every rank) and whose
    ``load_state_dict`` takes whole ones, each rank keeping its shard."""

    # torch's fused AdamW takes no DTensor next to its plain step counts, nor a group that
    # mixes FSDP's shards with the parameters it leaves whole (experts at EDP 1): AdamW's step
    # runs on the local tensors the DTensors hold (elementwise: the same update, bit for bit).
    _local = staticmethod(local)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        return {**sd, "state": {i: whole_state(s) for i, s in sd["state"].items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for g in self.param_groups for p in g["params"]]

        def shard(i: Any, s: dict) -> dict:
            p = params[int(i)]
            return {k: shard_like(v, p) if isinstance(v, torch.Tensor) and is_sharded(p)
                    and tuple(v.shape) == tuple(p.shape) else v for k, v in s.items()}
        super().load_state_dict({**state_dict, "state": {
            i: shard(i, s) for i, s in state_dict["state"].items()}})


def build_fsdp_optimizer(model: nn.Module, cfg: TrainConfig) -> ShardedAdamW:
    """:class:`ShardedAdamW` with moeplug.training.optim.adamw's settings (the bf16-moments
    AdamW is refused with fsdp by the config)."""
    return ShardedAdamW(param_groups(model, cfg.weight_decay), lr=lr_at(0, cfg),
                        betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
