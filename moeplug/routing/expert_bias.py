"""Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection
only, nudged once per optimizer step towards balance.

Legend: E experts.

    b_i <- b_i + rate * sign(mean_j n_j - n_i)
n_i are the tokens routed to expert i during the step, summed over ``group`` (the ranks that
see different tokens: data/context parallel) before the update so every rank applies the same
bias. Over-loaded experts get a lower bias, under-loaded ones a higher bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def updated_expert_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float,
                        group=None) -> torch.Tensor:
    """The new fp32 bias; ``counts_E`` is all-reduced (summed) over ``group`` when given."""
    counts_E = counts_E.to(torch.float32).clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_E, group=group)
    step_E = torch.sign(counts_E.mean() - counts_E)
    return (bias_E.to(torch.float32) + rate * step_E).to(torch.float32)
