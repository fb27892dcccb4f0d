"""Step 2 of moeplug.parallelize: context parallelism (moeplug.parallel.context_parallel) on a
built model, after TP: each CP rank holds a load-balanced shard of every sequence, so attention
exchanges K/V over the CP group (RoPE at global positions) and the loss is the mean over the
whole CP group's tokens, with the aux loss's grad scaled to match. Multi-token prediction
reads its tokens k ahead through the wiring (ParallelWiring.ahead: all-gathered over CP)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from moeplug.modules.mla import MLAttention
from moeplug.parallel.context_parallel import cp_attention_for
from moeplug.parallelize.wiring import ParallelWiring


def apply_cp(model: nn.Module, groups: Any, wiring: ParallelWiring | None
             ) -> ParallelWiring | None:
    """``wiring`` (the TP step's, or None) with the CP hooks added; unchanged without CP.
    Refuses what CP does not support yet, as a config error would."""
    if groups is None or groups.cp is None:
        return wiring
    if any(isinstance(block.attn, MLAttention) for block in model.blocks):
        raise ValueError("ModelConfig.attention = 'mla' does not support context "
                         "parallelism yet. Fix: set attention: gqa or cp: 1")
    return dataclasses.replace(wiring or ParallelWiring(), cp_group=groups.cp,
                               cp_attention=cp_attention_for(groups))
