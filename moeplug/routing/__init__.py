"""Reusable routing math (Megatron-Core router features), as pure functions.

Modules, one job each:
    gating       router logits in fp32/fp64, input jitter, force-balanced logits
    scores       softmax / sigmoid / sqrtsoftplus scores, expert bias, group-limited top-k
    aux_losses   aux_loss, seq_aux_loss, global_aux_loss, z-loss, which counts feed them
    capacity     expert capacity and the ``probs`` / ``position`` drop policies
    expert_bias  aux-loss-free bias update (all-reduced counts)
    rows         dropped/padded rows for dispatchers (sink expert, pad-to-capacity, pad multiple)
    fused        scores + top-k + aux statistics in one C++ kernel (CPU fp32), with backward
The ``topk`` router plugin (plugins/moeplug_plugins/routers.py) composes them; other routers and
dispatchers may reuse any piece.
"""

from moeplug.routing.aux_losses import (AUX_LOSS_COUNTS, AUX_LOSS_TYPES, counts_for_aux,
                                        expert_counts, global_aux_loss, seq_aux_loss,
                                        seq_aux_loss_from_stats, sum_over_group,
                                        switch_aux_loss, switch_aux_loss_from_mean,
                                        switch_aux_loss_from_stats, z_loss)
from moeplug.routing.capacity import (DROP_POLICIES, drop_over_capacity, dropped_fraction,
                                      expert_capacity, kept, zero_dropped)
from moeplug.routing.expert_bias import updated_expert_bias
from moeplug.routing.fused import AuxStats, fused_routing_applies, fused_topk_routing
from moeplug.routing.gating import ROUTER_DTYPES, force_balanced_logits, input_jitter, router_logits
from moeplug.routing.rows import (append_sink_rows, cat_rows, first_rows, pad_rows,
                                  padded_counts, row_range, rows_as, sink_dropped,
                                  token_rows, unpad_rows)
from moeplug.routing.scores import (GROUP_SCORES, NORM_EPS, SCORE_FUNCTIONS, aux_scores,
                                    group_limited_topk, group_members, score, select_topk,
                                    topk_routing)

__all__ = [
    "AUX_LOSS_COUNTS", "AUX_LOSS_TYPES", "AuxStats", "DROP_POLICIES", "GROUP_SCORES", "NORM_EPS",
    "ROUTER_DTYPES", "SCORE_FUNCTIONS", "append_sink_rows", "aux_scores", "cat_rows",
    "counts_for_aux",
    "drop_over_capacity", "dropped_fraction", "expert_capacity", "expert_counts", "first_rows",
    "force_balanced_logits",
    "fused_routing_applies", "fused_topk_routing", "global_aux_loss", "group_limited_topk",
    "group_members", "input_jitter", "kept", "pad_rows", "padded_counts", "router_logits",
    "row_range", "rows_as", "score",
    "select_topk", "seq_aux_loss", "seq_aux_loss_from_stats", "sink_dropped", "sum_over_group",
    "switch_aux_loss", "switch_aux_loss_from_mean", "switch_aux_loss_from_stats",
    "token_rows", "topk_routing", "unpad_rows",
    "updated_expert_bias", "z_loss", "zero_dropped",
]
