"""The parallel :class:`moeplug.modules.wiring.Wiring`: what the modules do at the edges of the
TP region and of the CP shard, installed on a built model by the TP and CP steps.

Legend: B batch, S sequence, s = S / W sequence chunk, D hidden, Vl = V / W vocabulary columns,
W ranks in the TP group.

Without SP every TP rank holds the whole [B, S, D] activation: entering a region is the
identity (backward all-reduce). With SP the activations between regions are [B, s, D]: entering
all-gathers the sequence (moeplug.parallel.tensor_parallel has the regions and layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from moeplug.modules.wiring import Wiring
from moeplug.parallel import comm
from moeplug.parallel.context_parallel import cp_ahead, cp_aux_loss, cp_cross_entropy
from moeplug.parallel.tensor_parallel import (enter_tp_region, gather_sequence, scatter_sequence,
                                              vocab_parallel_cross_entropy)


@dataclass(frozen=True)
class ParallelWiring(Wiring):
    """The hooks for a TP group (``sequence_parallel``: SP on) and a CP group; either may be
    None. Configuration only: one instance is shared by every module of a model."""

    tp_group: Any = None
    sequence_parallel: bool = False
    cp_group: Any = None
    cp_attention: Callable | None = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`enter_tp_region` (all-gather the sequence under SP), identity at TP = 1."""
        return x if self.tp_group is None else enter_tp_region(x, self.tp_group,
                                                               self.sequence_parallel)

    def moe_tokens_in(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """The MoE layer always works on this TP rank's sequence chunk: under SP it already
        holds it; without SP every rank holds all tokens, so it keeps its chunk (Megatron
        instead refuses MoE + TP without SP). Routing each token once keeps expert grads from
        being counted TP times when sync_gradients sums them over expert-DP."""
        tp = self.tp_group
        return x_BSD if tp is None or self.sequence_parallel else scatter_sequence(x_BSD, tp)

    def moe_tokens_out(self, y_BsD: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`moe_tokens_in`: all-gather the chunks; the consumer is replicated
        over TP, so the backward keeps this rank's chunk of the (identical) grads."""
        tp = self.tp_group
        return (y_BsD if tp is None or self.sequence_parallel
                else gather_sequence(y_BsD, tp, grad_is_partial=False))

    def aux_loss(self, aux: torch.Tensor) -> torch.Tensor:
        """CP: the aux loss's grad times CP (sync_gradients averages over CP; cp_aux_loss)."""
        return aux if self.cp_group is None else cp_aux_loss(aux, self.cp_group)

    def lm_loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """CP first (under TP x CP too the mean is the CP group's), else the vocab-parallel
        cross-entropy (the full logits are never built), else the plain one."""
        if self.cp_group is not None:
            return cp_cross_entropy(logits_BSV, targets_BS, self.cp_group, tp_group=self.tp_group)
        if self.tp_group is not None:
            return vocab_parallel_cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]),
                                                targets_BS.reshape(-1), self.tp_group).mean()
        return super().lm_loss(logits_BSV, targets_BS)

    def ahead(self, ids_BS: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
        """CP: this rank's chunks are not contiguous, so the ids ahead come from the whole
        sequence (cp_ahead all-gathers the ids over CP); else the local shift."""
        if self.cp_group is None:
            return super().ahead(ids_BS, k, fill)
        return cp_ahead(ids_BS, k, fill, self.cp_group)

    def lm_loss_ahead(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor,
                      k: int) -> torch.Tensor:
        """CP: every held position keeps its logits; the targets k ahead are ignored (-100)
        past the sequence's end, and the mean is over the CP group's S - k targets
        (cp_cross_entropy counts the kept ones), the LM loss's convention."""
        if self.cp_group is None:
            return super().lm_loss_ahead(logits_BSV, targets_BS, k)
        return cp_cross_entropy(logits_BSV, self.ahead(targets_BS, k, fill=-100),
                                self.cp_group, ignore_index=-100, tp_group=self.tp_group)

    def whole_seq_len(self, S: int) -> int:
        return S * comm.group_size(self.cp_group)

    def local_seq_len(self, S: int) -> int:
        return S // comm.group_size(self.tp_group) if self.sequence_parallel else S


def install(roots: Iterable[nn.Module], wiring: Wiring) -> None:
    """Set ``wiring`` on every module under ``roots`` that holds one (the roots too)."""
    for root in roots:
        for module in root.modules():
            if isinstance(getattr(module, "wiring", None), Wiring):
                module.wiring = wiring
