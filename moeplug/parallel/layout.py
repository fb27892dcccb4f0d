"""The parallel layout: which ranks form each group (pure math over config.ParallelConfig).

Megatron-Core "MoE Parallel Folding" (arXiv 2504.14960): attention and dense layers see the world
as a TP x CP x DP x PP grid, expert layers see the *same* ranks as an ETP x EP x EDP x PP grid.
Both grids enumerate ranks with one order string (default ``tp-cp-ep-dp-pp``, first name fastest):

    rank = sum_d idx_d * stride_d,   stride_d = product of the sizes of the names before d

The dense grid sets ep = 1, the expert grid sets cp = 1 and reads ``tp`` as ETP and ``dp`` as EDP.
Nothing here touches ``torch.distributed``: every check runs before any process group exists, and
:mod:`moeplug.parallel.groups` turns the rank tables into process groups.

Group kinds (keys of :func:`layout_rank_groups`):
    dense grid   tp, cp, dp, pp, tp_cp (aux loss over the sequence), dp_cp (gradient reduction),
                 tp_dp_cp (global aux loss: every rank holding one pipeline stage)
    expert grid  ep, etp, edp (expert gradient reduction), ep_etp (expert model parallel)
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Mapping

# The degrees and their arithmetic (resolve, validate_model) are declared once, in the config
# (the ground floor every module imports); this module turns them into rank tables.
from moeplug.config import DIM_NAMES, ConfigError, ParallelConfig, validate_model

__all__ = ["DIM_NAMES", "GROUP_KINDS", "ParallelConfig", "layout_rank_groups", "rank_groups",
           "validate_model"]

# kind -> (grid, names that vary inside one group). The grid's "tp"/"dp" mean ETP/EDP for "expert".
GROUP_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),
    "cp": ("dense", ("cp",)),
    "dp": ("dense", ("dp",)),
    "pp": ("dense", ("pp",)),
    "tp_cp": ("dense", ("tp", "cp")),
    "dp_cp": ("dense", ("dp", "cp")),
    "tp_dp_cp": ("dense", ("tp", "dp", "cp")),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "edp": ("expert", ("dp",)),
    "ep_etp": ("expert", ("tp", "ep")),
}


def _grid_sizes(pcfg: ParallelConfig) -> tuple[dict[str, int], dict[str, int]]:
    """Sizes of the dense grid (ep = 1) and the expert grid (cp = 1, tp = ETP, dp = EDP)."""
    if pcfg.dp == 0 or pcfg.edp == 0:
        raise ConfigError("ParallelConfig has unresolved dp/edp (0). "
                          "Fix: call pcfg.resolve(world_size) first")
    dense = {"tp": pcfg.tp, "cp": pcfg.cp, "ep": 1, "dp": pcfg.dp, "pp": pcfg.pp}
    expert = {"tp": pcfg.etp, "cp": 1, "ep": pcfg.ep, "dp": pcfg.edp, "pp": pcfg.pp}
    return dense, expert


def rank_groups(dims: Mapping[str, int], order: str, mask: Iterable[str]) -> list[list[int]]:
    """Rank lists of the groups that vary the dims in ``mask`` and fix all others.

    ``dims`` maps each name of ``order`` to its size; ranks are numbered with the first name of
    ``order`` fastest. Groups come sorted by their lowest rank, ranks inside a group ascending
    (the same lists Megatron's generate_masked_orthogonal_rank_groups produces).
    """
    names = order.split("-")
    mask = tuple(mask)
    unknown = [m for m in mask if m not in names]
    if unknown or sorted(dims) != sorted(names):
        raise ValueError(f"rank_groups: mask {mask} and dims {sorted(dims)} must use the names "
                         f"of order {order!r}")
    strides = [math.prod(dims[n] for n in names[:i]) for i in range(len(names))]
    varied = [i for i, n in enumerate(names) if n in mask]
    fixed = [i for i, n in enumerate(names) if n not in mask]

    def ranks_over(axes: list[int]) -> list[int]:
        # Offsets of every index combination over `axes`, ascending (strides grow along order).
        return sorted(sum(c) for c in itertools.product(
            *[[k * strides[a] for k in range(dims[names[a]])] for a in axes]))

    return [[base + off for off in ranks_over(varied)] for base in ranks_over(fixed)]


def layout_rank_groups(pcfg: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group kind of :data:`GROUP_KINDS` for a resolved config -> its list of rank lists."""
    grids = dict(zip(("dense", "expert"), _grid_sizes(pcfg)))
    return {kind: rank_groups(grids[grid], pcfg.order, mask)
            for kind, (grid, mask) in GROUP_KINDS.items()}
