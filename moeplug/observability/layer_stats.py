"""Per-MoE-layer routing metrics of one optimizer step, merged over its micro-batches.

Legend: E experts, n_E one layer's token counts (tokens routed to each expert, summed over the
step's micro-batches; choices dropped by capacity reach no expert and are not counted).
Layers are the model's MoE layers in order (``ModelOutput.expert_counts``; MTP layers last).

What :func:`moe_metrics` reports per layer (the ``moe`` entry of a JSONL ``train`` record, one
list entry per layer so a record stays one short line):
    tokens           n_E itself (what ``moeplug plot-load`` draws)
    tokens_min/mean/max   min, mean and max of n_E
    max_violation    max(n) / mean(n) - 1: "MaxVio" of the auxiliary-loss-free balancing paper
                     (Wang et al. 2024, used by DeepSeek-V3) — how far the busiest expert is over
                     its fair share, which is what sets the step time of an expert-parallel run
                     (the slowest expert waits for nobody). 0 = perfectly balanced.
    cv               std(n) / mean(n) (population std), the coefficient of variation: the spread
                     of the whole distribution, not only its peak. 0 = balanced; all tokens on
                     one expert gives sqrt(E - 1).
    dropped_fraction mean over micro-batches of the share of (token, choice) pairs that capacity
                     dropped (micro-batches are equally sized, so: the step's share); a router
                     that reports none dropped nothing (no capacity), which counts as 0.0.
    router_losses    {type: [per layer]}: the mean over micro-batches of each *unscaled* value in
                     RouterOutput.losses (aux_loss, seq_aux_loss, global_aux_loss, z_loss, ...);
                     None for a layer whose router did not report that type.
max_violation and cv are 0.0 for a layer that routed no tokens: there was nothing to balance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

# RouterOutput.losses carries this next to the losses; it gets its own list (not a loss).
_DROPPED = "dropped_fraction"


@dataclass(frozen=True)
class StepRouting:
    """What a step's micro-batches routed, per MoE layer.

    counts:  int64 [E] per layer, summed over micro-batches.
    values:  per layer, {name: (value of micro-batch 1, value of micro-batch 2, ...)} for every
             name the layer's router reported (RouterOutput.losses keys).
    num_micro_batches: how many micro-batches were added.
    """

    counts: tuple[torch.Tensor, ...]
    values: tuple[Mapping[str, tuple[float, ...]], ...]
    num_micro_batches: int = 1


def add_micro_batch(acc: StepRouting | None, expert_counts: Sequence[torch.Tensor],
                    router_losses: Sequence[Mapping[str, object]] = ()) -> StepRouting:
    """``acc`` plus one micro-batch's ``ModelOutput.expert_counts`` and ``.router_losses``.

    A new object is returned (nothing is updated in place), so callers keep no hidden state.
    ``router_losses`` may be shorter than ``expert_counts`` (an older model output, or layers
    that report nothing): missing layers count as reporting nothing.
    """
    counts = tuple(c.detach().to("cpu", torch.int64) for c in expert_counts)
    losses = [dict(router_losses[i]) if i < len(router_losses) else {} for i in range(len(counts))]
    micro_values = tuple({k: (float(v),) for k, v in layer.items()} for layer in losses)
    if acc is None:
        return StepRouting(counts=counts, values=micro_values, num_micro_batches=1)
    if len(acc.counts) != len(counts):
        raise ValueError(
            f"add_micro_batch: this micro-batch has {len(counts)} MoE layers but the step so far "
            f"has {len(acc.counts)}. Fix: accumulate outputs of one model only, and start a new "
            f"StepRouting (acc=None) for each optimizer step")
    merged = tuple(
        {k: old.get(k, ()) + new.get(k, ()) for k in {**old, **new}}
        for old, new in zip(acc.values, micro_values))
    return StepRouting(counts=tuple(a + b for a, b in zip(acc.counts, counts)), values=merged,
                       num_micro_batches=acc.num_micro_batches + 1)


def load_stats(counts_E: torch.Tensor) -> dict[str, float]:
    """min / mean / max tokens per expert, max_violation and cv of one layer (module docstring)."""
    n = counts_E.detach().to(torch.float64)
    if n.numel() == 0:
        return {"tokens_min": 0.0, "tokens_mean": 0.0, "tokens_max": 0.0,
                "max_violation": 0.0, "cv": 0.0}
    mean, peak = float(n.mean()), float(n.max())
    balanced = mean <= 0.0  # no tokens at all: define both coefficients as 0
    std = float(n.std(correction=0))
    return {"tokens_min": float(n.min()), "tokens_mean": mean, "tokens_max": peak,
            "max_violation": 0.0 if balanced else peak / mean - 1.0,
            "cv": 0.0 if balanced else std / mean}


def _mean(values: tuple[float, ...]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def moe_metrics(acc: StepRouting | None, counts: Sequence[torch.Tensor] | None = None) -> dict:
    """The compact per-layer ``moe`` record of one step (see the module docstring).

    ``counts``: per-layer token counts to report instead of ``acc.counts`` — in a parallel run,
    the counts summed over every rank (the router losses stay those of ``acc``'s micro-batches;
    layers ``acc`` does not have, e.g. other pipeline stages', report none).
    """
    if acc is None:  # no micro-batch seen here (or no MoE layers): nothing reported
        acc = StepRouting(counts=(), values=(), num_micro_batches=1)
    if counts is not None:
        values = tuple(acc.values[i] if i < len(acc.values) else {} for i in range(len(counts)))
        acc = StepRouting(counts=tuple(c.detach().to("cpu", torch.int64) for c in counts),
                          values=values, num_micro_batches=acc.num_micro_batches)
    stats = [load_stats(c) for c in acc.counts]
    out: dict = {"tokens": [c.tolist() for c in acc.counts]}
    for key in ("tokens_min", "tokens_mean", "tokens_max", "max_violation", "cv"):
        out[key] = [s[key] for s in stats]
    # A micro-batch without a dropped fraction dropped nothing (its router has no capacity), so
    # it counts as 0 here; a loss a router did not report is unknown instead, hence None below.
    out[_DROPPED] = [math.fsum(v.get(_DROPPED, ())) / acc.num_micro_batches for v in acc.values]
    names = sorted({k for v in acc.values for k in v if k != _DROPPED})
    out["router_losses"] = {k: [_mean(v.get(k, ())) for v in acc.values] for k in names}
    return out
