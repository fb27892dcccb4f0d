"""The parallel layout: degrees, their validation, and which ranks form each group (pure math).

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

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from moeplug.config import ConfigError

DIM_NAMES = ("tp", "cp", "ep", "dp", "pp")

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


def _fail(name: str, value: object, rule: str, fix: str) -> None:
    raise ConfigError(f"ParallelConfig.{name} = {value!r}: {rule}. Fix: {fix}")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel degrees. ``dp = 0`` means derive it from the world size in :meth:`resolve`.

    tp: tensor parallel (attention / dense MLP)    etp: tensor parallel inside each expert
    cp: context parallel (sequence split)           ep:  expert parallel (experts split)
    dp: data parallel of the dense grid             edp: data parallel of the expert grid (derived)
    pp: pipeline parallel (shared by both grids)
    sequence_parallel: shard activations outside TP regions along the sequence (needs tp > 1
    to have any effect).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 0
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    # How CP ranks exchange K/V (moeplug.parallel.context_parallel): "allgather" (one collective
    # per layer; the default because gloo pays per message) or "ring" (send/recv per step).
    cp_comm: str = "allgather"
    # Filled by resolve(); 0 until then. Not an init argument: it is always derived.
    edp: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for n in ("tp", "cp", "pp", "ep", "etp"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(n, v, "must be a positive integer", f"set {n} to an integer >= 1")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 0:
            _fail("dp", self.dp, "must be an integer >= 0",
                  "set dp to 0 (derive from the world size) or to the data-parallel degree")
        if not isinstance(self.sequence_parallel, bool):
            _fail("sequence_parallel", self.sequence_parallel, "must be a bool",
                  "write sequence_parallel: true or false")
        if self.cp_comm not in ("allgather", "ring"):
            _fail("cp_comm", self.cp_comm, "is not a context-parallel K/V exchange",
                  "use 'allgather' or 'ring'")
        names = self.order.split("-") if isinstance(self.order, str) else None
        if names is None or sorted(names) != sorted(DIM_NAMES):
            _fail("order", self.order, f"must name each of {'-'.join(DIM_NAMES)} exactly once, "
                  "joined by '-'", "use e.g. 'tp-cp-ep-dp-pp' (Megatron's default)")

    @property
    def world_size(self) -> int:
        """TP·CP·DP·PP; only meaningful after :meth:`resolve`."""
        return self.tp * self.cp * self.dp * self.pp

    def min_world_size(self) -> int:
        """The fewest processes these degrees fit: TP·CP·DP·PP when dp is set, else the least
        common multiple of TP·CP·PP and ETP·EP·PP (both must divide the world in resolve)."""
        dense = self.tp * self.cp * self.pp * max(self.dp, 1)
        return dense if self.dp else math.lcm(dense, self.etp * self.ep * self.pp)

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``dp`` and ``edp`` filled for ``world_size``; raise ConfigError if
        the degrees do not tile the world or the two grids disagree on the pipeline groups."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size {world_size!r} must be a positive integer. "
                              "Fix: launch at least one process")
        tp, cp, pp, ep, etp = self.tp, self.cp, self.pp, self.ep, self.etp
        if self.dp == 0:
            if world_size % (tp * cp * pp):
                _fail("dp", 0, f"cannot derive dp: TP·CP·PP = {tp}·{cp}·{pp} = {tp * cp * pp} "
                      f"does not divide world size {world_size}",
                      f"choose tp, cp, pp whose product divides {world_size}, or change the "
                      "number of processes")
            dp = world_size // (tp * cp * pp)
        else:
            dp = self.dp
            if tp * cp * dp * pp != world_size:
                _fail("dp", dp, f"TP·CP·DP·PP = {tp}·{cp}·{dp}·{pp} = {tp * cp * dp * pp} "
                      f"≠ world size {world_size}",
                      "set dp = 0 to derive it, or change the degrees or the number of processes")
        if world_size % (etp * ep * pp):
            _fail("ep", ep, f"ETP·EP·PP = {etp}·{ep}·{pp} = {etp * ep * pp} does not divide "
                  f"world size {world_size}",
                  f"choose etp, ep, pp whose product divides {world_size}")
        if tp > 1 and ep > 1 and not self.sequence_parallel:
            # Megatron's rule: with TP and EP together the token dispatcher expects activations
            # already split along the sequence across TP ranks, or each TP rank routes duplicates.
            _fail("sequence_parallel", False, f"tp = {tp} and ep = {ep} are both > 1, which needs "
                  "sequence parallelism", "set sequence_parallel: true (or tp = 1 / ep = 1)")
        out = dataclasses.replace(self, dp=dp)
        out.edp = world_size // (etp * ep * pp)
        dense, expert = _grid_sizes(out)
        if rank_groups(dense, out.order, ("pp",)) != rank_groups(expert, out.order, ("pp",)):
            _fail("order", out.order, f"the dense grid (DP = {dp}) and the expert grid "
                  f"(EDP = {out.edp}) give different pipeline groups, so a pipeline stage would "
                  "hold attention and experts of different layers",
                  "put 'pp' last in order (e.g. 'tp-cp-ep-dp-pp') or make EDP equal DP")
        return out


def validate_model(pcfg: ParallelConfig, *, num_experts: int, num_heads: int, num_kv_heads: int,
                   num_layers: int, vpp: int = 1, ffn_hidden_size: int | None = None,
                   seq_len: int | None = None) -> None:
    """Model-dependent checks of a layout: shards must split evenly. Raises ConfigError."""

    def need(value: int, what: str, degree: int, label: str, field_name: str, fix: str) -> None:
        if value % degree:
            raise ConfigError(f"{what} {value} not divisible by {label} {degree} "
                              f"(ParallelConfig.{field_name} = {degree}). Fix: {fix}")

    need(num_heads, "num_heads", pcfg.tp, "TP", "tp",
         "choose tp dividing num_heads, or change num_heads")
    need(num_kv_heads, "num_kv_heads", pcfg.tp, "TP", "tp",
         "choose tp dividing num_kv_heads (each TP rank needs whole KV heads)")
    need(num_experts, "num_experts", pcfg.ep, "EP", "ep",
         "choose ep dividing num_experts, or change num_experts")
    if not isinstance(vpp, int) or vpp < 1:
        raise ConfigError(f"vpp {vpp!r} must be a positive integer. Fix: use 1 for no "
                          "interleaving")
    need(num_layers, "num_layers", pcfg.pp * vpp, f"PP·VPP = {pcfg.pp}·{vpp} =", "pp",
         "choose pp (and vpp) so every virtual stage gets the same number of layers")
    if ffn_hidden_size is not None:
        need(ffn_hidden_size, "ffn_hidden_size", pcfg.etp, "ETP", "etp",
             "choose etp dividing the expert ffn_hidden_size")
    if seq_len is not None:
        # Context parallel splits each sequence into 2·CP chunks (load-balanced causal attention);
        # sequence parallel then splits each CP shard across TP ranks.
        tp_sp = pcfg.tp if pcfg.sequence_parallel else 1
        cp_chunks = 2 * pcfg.cp if pcfg.cp > 1 else 1
        need(seq_len, "seq_len", cp_chunks * tp_sp,
             f"{'2·CP' if pcfg.cp > 1 else 'CP'}{'·TP' if tp_sp > 1 else ''} =", "cp",
             "choose seq_len a multiple of that product")


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
