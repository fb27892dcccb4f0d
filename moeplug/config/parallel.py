"""The ``parallel:`` section (degrees, rank order, pipeline split) and the model-dependent
checks of a layout (:func:`validate_model`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moeplug.config._checks import ConfigError, _check_fields, _fail
from moeplug.config.pipeline_layout import (LayoutError, PipelineLayout, from_letters,
                                            from_stage_sizes, layout_of_string, parse_layout)

# Parallel dimension names of ParallelConfig.order (first name fastest in the rank numbering).
DIM_NAMES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """The ``parallel:`` section, every parallel field declared once: degrees, rank order,
    pipeline split, distributed optimizer, timeout. ``dp = 0``: derived in :meth:`resolve`.

    tp: tensor parallel (attention / dense MLP)    etp: tensor parallel inside each expert
    cp: context parallel (sequence split)           ep:  expert parallel (experts split)
    dp: data parallel of the dense grid             edp: data parallel of the expert grid (derived)
    pp: pipeline parallel (shared by both grids)    vpp: model chunks per pipeline rank
    sequence_parallel: shard activations outside TP regions along the sequence (tp > 1).

    Only arithmetic lives here (this module imports nothing of moeplug outside the config
    package); the rank tables and process groups are moeplug.parallel's. Model-dependent checks
    run in RootConfig; checks that need the world size in :meth:`resolve` (the CLI calls it
    before launching any rank).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 0  # 0: world size / (tp * cp * pp)
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    # How CP ranks exchange K/V (moeplug.parallel.context_parallel): "allgather" (one collective
    # per layer; the default because gloo pays per message) or "ring" (send/recv per step).
    cp_comm: str = "allgather"
    # Pipeline split: vpp model chunks per rank (interleaved 1F1B when > 1); layers on pipeline
    # rank 0 / P-1 (None: an even share), useful as those also carry the embedding / the head.
    vpp: int = 1
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None
    # Megatron's --pipeline-model-parallel-layout (moeplug.config.pipeline_layout): what every
    # virtual stage holds, e.g. "Et*3|(tt|)*29m|L"; sets vpp (stages / pp) when vpp is 1.
    pipeline_layout: str | None = None
    # Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding (loss) takes a
    # layer's place in the first (last) virtual stage of an even split over PP·VPP.
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # ZeRO-1: AdamW state sharded over DP (dense params) / expert-DP (expert params).
    distributed_optimizer: bool = False
    # FSDP2 (torch's fully_shard, moeplug.parallel.fsdp): parameters, gradients and AdamW state
    # sharded over DP x CP (dense params) / expert-DP (expert params); ZeRO-1's alternative.
    fsdp: bool = False
    # Free each block's gathered parameters after its forward and gather them again for its
    # backward (less memory, one more all-gather per block and micro-batch); fsdp only.
    fsdp_reshard_after_forward: bool = True
    # Combined 1F1B EP overlap (Megatron overlap_moe_expert_parallel_comm; see
    # moeplug.parallel.ep_overlap): the backward of micro-batch m-1 runs on a second thread, over
    # a twin of every process group, while micro-batch m runs forward, so each one's exchanges
    # hide behind the other's compute. Needs grad_accum_steps >= 2; composes with tp (with or
    # without sequence_parallel), cp, ep, dp, and with pp > 1 every "backward, then forward"
    # step of the 1F1B op list runs side by side.
    overlap_moe_expert_parallel_comm: bool = False
    # Process-group timeout: a rank waiting this long on a dead or hung peer stops instead of
    # hanging (moeplug.training.faults). 90 s keeps a CPU run's abort under 2 minutes; raise it
    # when one rank may legitimately work alone longer (e.g. a slow checkpoint save).
    timeout_s: float = 90.0

    def __post_init__(self) -> None:
        _check_fields(self)
        for n in ("tp", "cp", "pp", "ep", "etp", "vpp"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(self, n, v, "must be a positive integer", f"set {n} to an integer >= 1")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 0:
            _fail(self, "dp", self.dp, "must be an integer >= 0",
                  "set dp to 0 (derive from the world size) or to the data-parallel degree")
        for n in ("num_layers_in_first_stage", "num_layers_in_last_stage"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                _fail(self, n, v, "must be null or an integer >= 0",
                      f"leave {n} unset for an even split, or give a layer count")
        for n in ("sequence_parallel", "distributed_optimizer", "overlap_moe_expert_parallel_comm",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  "fsdp", "fsdp_reshard_after_forward"):
            if not isinstance(getattr(self, n), bool):
                _fail(self, n, getattr(self, n), "must be a boolean", f"write {n}: true or false")
        self._check_split_fields()
        self._check_fsdp()
        if self.cp_comm not in ("allgather", "ring"):
            _fail(self, "cp_comm", self.cp_comm, "is not a context-parallel K/V exchange",
                  "use 'allgather' or 'ring'")
        names = self.order.split("-") if isinstance(self.order, str) else None
        if names is None or sorted(names) != sorted(DIM_NAMES):
            _fail(self, "order", self.order, f"must name each of {'-'.join(DIM_NAMES)} exactly "
                  "once, joined by '-'", "use e.g. 'tp-cp-ep-dp-pp' (Megatron's default)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            _fail(self, "timeout_s", self.timeout_s, "must be a number of seconds > 0",
                  "set timeout_s to e.g. 300")

    def _check_split_fields(self) -> None:
        """The pipeline split's own rules (Megatron's: a layout string replaces the other split
        fields, uneven first / last stages exclude accounting the embedding / loss), and the
        layout string's grammar and stage count; the layer counts need the model (RootConfig)."""
        counts = [n for n in ("num_layers_in_first_stage", "num_layers_in_last_stage")
                  if getattr(self, n) is not None]
        accounts = [n for n in ("account_for_embedding_in_pipeline_split",
                                "account_for_loss_in_pipeline_split") if getattr(self, n) is True]
        if self.pipeline_layout is not None:
            if counts or accounts:
                _fail(self, "pipeline_layout", self.pipeline_layout, f"says what every virtual "
                      f"stage holds, so {' and '.join(counts + accounts)} cannot be set with it",
                      f"unset {' and '.join(counts + accounts)}, or pipeline_layout")
                return
            if not isinstance(self.pipeline_layout, str) or not all(
                    isinstance(v, int) and v >= 1 for v in (self.pp, self.vpp)):
                return  # _check_fields / the degree rules reported it
            try:
                stages = from_letters(parse_layout(self.pipeline_layout), self.pp, self.vpp)
            except LayoutError as e:
                _fail(self, "pipeline_layout", self.pipeline_layout, e.rule, e.fix)
                return
            if self.pp == 1 and stages.vpp > 1:
                _fail(self, "pipeline_layout", self.pipeline_layout, f"has {stages.vpp} virtual "
                      "stages, which need pipeline parallelism (pp = 1)",
                      "remove the '|', or set pp > 1")
                return
            # Derived like dp: Megatron sets the virtual pipeline size from the layout.
            self.vpp = stages.vpp
        elif counts and accounts:
            _fail(self, accounts[0], True, f"counts the embedding / loss in an even split, which "
                  f"{counts[0]} replaces", f"unset {counts[0]}, or {accounts[0]}")

    def _check_fsdp(self) -> None:
        """FSDP's own switch (moeplug.parallel.fsdp); what it cannot be combined with is
        moeplug.config.modes.fsdp's, what the world size must give :meth:`resolve`'s."""
        if not self.fsdp:
            if self.fsdp_reshard_after_forward is False:
                _fail(self, "fsdp_reshard_after_forward", False, "acts only with fsdp: true",
                      "set fsdp: true, or drop fsdp_reshard_after_forward")
            return
        # Against the other parallel options and the other modes: moeplug.config.modes.fsdp.

    def layout(self) -> "ParallelConfig":
        """This section (the degrees); kept so ``cfg.parallel.layout()`` reads as before."""
        return self

    def pipeline(self) -> "ParallelConfig":
        """This section (the layer split); kept so ``cfg.parallel.pipeline()`` reads as before."""
        return self

    @property
    def world_size(self) -> int:
        """TP·CP·DP·PP; only meaningful after :meth:`resolve`."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Data parallel of the expert grid: world / (ETP·EP·PP); 0 while dp is unresolved."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def min_world_size(self) -> int:
        """The fewest processes these degrees fit: TP·CP·DP·PP when dp is set, else the least
        common multiple of TP·CP·PP and ETP·EP·PP (both must divide the world in resolve)."""
        dense = self.tp * self.cp * self.pp * max(self.dp, 1)
        return dense if self.dp else math.lcm(dense, self.etp * self.ep * self.pp)

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``dp`` (hence ``edp``) filled for ``world_size``; raise ConfigError
        if the degrees do not tile the world or the two grids disagree on the pipeline groups."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size {world_size!r} must be a positive integer. "
                              "Fix: launch at least one process")
        tp, cp, pp, ep, etp = self.tp, self.cp, self.pp, self.ep, self.etp
        if self.dp == 0:
            if world_size % (tp * cp * pp):
                _fail(self, "dp", 0, f"cannot derive dp: TP·CP·PP = {tp}·{cp}·{pp} = "
                      f"{tp * cp * pp} does not divide world size {world_size}",
                      f"choose tp, cp, pp whose product divides {world_size}, or change the "
                      "number of processes")
            dp = world_size // (tp * cp * pp)
        else:
            dp = self.dp
            if tp * cp * dp * pp != world_size:
                _fail(self, "dp", dp, f"TP·CP·DP·PP = {tp}·{cp}·{dp}·{pp} = "
                      f"{tp * cp * dp * pp} ≠ world size {world_size}",
                      "set dp = 0 to derive it, or change the degrees or the number of processes")
        if world_size % (etp * ep * pp):
            _fail(self, "ep", ep, f"ETP·EP·PP = {etp}·{ep}·{pp} = {etp * ep * pp} does not "
                  f"divide world size {world_size}",
                  f"choose etp, ep, pp whose product divides {world_size}")
        if tp > 1 and ep > 1 and not self.sequence_parallel:
            # Megatron's rule: with TP and EP together the token dispatcher expects activations
            # already split along the sequence across TP ranks, or each TP rank routes duplicates.
            _fail(self, "sequence_parallel", False, f"tp = {tp} and ep = {ep} are both > 1, "
                  "which needs sequence parallelism",
                  "set sequence_parallel: true (or tp = 1 / ep = 1)")
        if self.fsdp and dp * cp == 1:
            _fail(self, "fsdp", True, f"shards over DP·CP = {dp}·{cp} = 1 rank at world size "
                  f"{world_size}: nothing to shard", "set fsdp: false, or use more processes "
                  "(dp > 1)")
        out = dataclasses.replace(self, dp=dp)
        # Both grids number ranks with one order; with pp > 1 their pipeline groups agree iff
        # the sizes of the names before 'pp' multiply to the same stride (dense: ep = 1;
        # expert: cp = 1, tp = ETP, dp = EDP). tests/test_config.py checks this rule against
        # the rank tables of moeplug.parallel.layout.
        before = self.order.split("-")[:self.order.split("-").index("pp")]
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp}
        expert = {"tp": etp, "cp": 1, "ep": ep, "dp": out.edp}
        if pp > 1 and math.prod(dense[n] for n in before) != math.prod(expert[n] for n in before):
            _fail(self, "order", out.order, f"the dense grid (DP = {dp}) and the expert grid "
                  f"(EDP = {out.edp}) give different pipeline groups, so a pipeline stage would "
                  "hold attention and experts of different layers",
                  "put 'pp' last in order (e.g. 'tp-cp-ep-dp-pp') or make EDP equal DP")
        return out

    def layer_layout(self, num_layers: int, mtp_num_layers: int | None = None,
                     pp: int | None = None) -> PipelineLayout:
        """What every virtual stage holds (moeplug.config.pipeline_layout), from
        ``pipeline_layout``, or from the layer counts as Megatron splits them: an even split over
        PP·VPP, uneven first / last stages (the middle ranks even, every rank a multiple of
        VPP), or the embedding / loss counted as a layer each. ``mtp_num_layers``: the model's
        (None: a layout string's MTP blocks are not counted; the count rules put them on the
        last stage). Raises ConfigError naming the field and the fix."""
        pp = self.pp if pp is None else pp
        mtp = mtp_num_layers or 0
        if self.pipeline_layout is not None:
            try:
                return layout_of_string(self.pipeline_layout, pp, self.vpp,
                                        num_layers=num_layers, mtp_num_layers=mtp_num_layers)
            except LayoutError as e:
                raise _error(self, "pipeline_layout", self.pipeline_layout, e.rule,
                             e.fix) from None
        counts, chunks = self.rank_layer_counts(num_layers, pp), pp * self.vpp
        embedding, loss = (self.account_for_embedding_in_pipeline_split,
                           self.account_for_loss_in_pipeline_split)
        if embedding or loss:  # every virtual stage the same share, E and L included
            sizes = [(num_layers + embedding + loss) // chunks] * chunks
            sizes[0] -= embedding
            sizes[-1] -= loss
        else:  # virtual stage v = c * pp + r holds rank r's share of each of its chunks
            sizes = [counts[v % pp] // self.vpp for v in range(chunks)]
        return from_stage_sizes(sizes, pp, mtp)

    def rank_layer_counts(self, num_layers: int, pp: int | None = None) -> list[int]:
        """Decoder layers held by each of the ``pp`` (default self.pp) pipeline ranks; raises
        ConfigError when they cannot tile num_layers. With the embedding / loss accounted for
        in the split, rank 0 / PP-1 hold one layer fewer than their share."""
        pp = self.pp if pp is None else pp
        if self.pipeline_layout is not None:
            return self.layer_layout(num_layers, pp=pp).rank_layer_counts()
        first, last = self.num_layers_in_first_stage, self.num_layers_in_last_stage
        if pp == 1:
            if self.vpp != 1:
                raise _error(self, "vpp", self.vpp, "virtual stages need pipeline parallelism "
                             "(pp = 1)", "set vpp = 1, or pp > 1")
            for name in ("num_layers_in_first_stage", "num_layers_in_last_stage",
                         "account_for_embedding_in_pipeline_split",
                         "account_for_loss_in_pipeline_split"):
                if getattr(self, name) not in (None, False):
                    raise _error(self, name, getattr(self, name), "uneven stages need pp > 1",
                                 f"unset {name}")
            return [num_layers]
        extra = self.account_for_embedding_in_pipeline_split + \
            self.account_for_loss_in_pipeline_split
        if extra:
            # Megatron's account_for_embedding/loss_in_pipeline_split: the embedding and the
            # loss each take a layer's place, so rank 0 / PP-1 build one layer fewer.
            units, chunks = num_layers + extra, pp * self.vpp
            name = "account_for_embedding_in_pipeline_split" if \
                self.account_for_embedding_in_pipeline_split else \
                "account_for_loss_in_pipeline_split"
            if units % chunks:
                raise _error(self, name, True, f"num_layers {num_layers} + {extra} (the "
                             f"embedding / loss as layers) = {units} is not divisible by "
                             f"PP·VPP = {pp}·{self.vpp} = {chunks}",
                             "choose pp and vpp whose product divides that, or set "
                             "pipeline_layout")
            counts = [units // pp] * pp
            counts[0] -= self.account_for_embedding_in_pipeline_split
            counts[-1] -= self.account_for_loss_in_pipeline_split
            return counts
        if first is None and last is None:
            if num_layers % (pp * self.vpp):
                raise _error(self, "vpp", self.vpp, f"num_layers {num_layers} is not divisible "
                             f"by PP·VPP = {pp}·{self.vpp} = {pp * self.vpp}", "choose pp and "
                             "vpp whose product divides num_layers, or set "
                             "num_layers_in_first_stage / _last_stage or pipeline_layout")
            return [num_layers // pp] * pp
        fixed = {r: n for r, n in {0: first, pp - 1: last}.items() if n is not None}
        rest, middle = num_layers - sum(fixed.values()), pp - len(fixed)
        name = "num_layers_in_first_stage" if first is not None else "num_layers_in_last_stage"
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            raise _error(self, name, fixed.get(0, fixed.get(pp - 1)),
                         f"with first = {first}, last = {last} the other {middle} stage(s) get "
                         f"{rest} of num_layers {num_layers} layers, which does not split evenly",
                         f"choose first/last so that num_layers - first - last is a multiple of "
                         f"the {middle} middle stage(s)" if middle else
                         f"make num_layers_in_first_stage + num_layers_in_last_stage = "
                         f"{num_layers}")
        counts = [fixed.get(r, rest // middle if middle else 0) for r in range(pp)]
        for r, n in enumerate(counts):
            if n % self.vpp:
                raise _error(self, "vpp", self.vpp, f"pipeline rank {r} holds {n} layers "
                             f"(per-rank counts {counts}), not divisible into {self.vpp} chunks",
                             "choose stage layer counts that are multiples of vpp, or set "
                             "pipeline_layout (any layers per virtual stage)")
        return counts

    def chunk_layers(self, num_layers: int, pp: int | None = None) -> list[list[range]]:
        """``[rank][chunk]`` -> the global layer indices of that model chunk."""
        return self.layer_layout(num_layers, pp=pp).chunk_layers()


def _error(obj: object, name: str, value: object, rule: str, fix: str) -> ConfigError:
    """The one-line ConfigError of :func:`_fail`, to raise where a caller needs the result."""
    return ConfigError(f"{type(obj).__name__}.{name} = {value!r}: {rule}. Fix: {fix}")


def validate_model(pcfg: ParallelConfig, *, num_experts: int, num_heads: int, num_kv_heads: int,
                   num_layers: int | None, vpp: int = 1, ffn_hidden_size: int | None = None,
                   seq_len: int | None = None) -> None:
    """Model-dependent checks of a layout: shards must split evenly. Raises ConfigError.
    ``num_layers=None`` leaves the layer split to :meth:`ParallelConfig.rank_layer_counts`."""

    def need(value: int, what: str, degree: int, label: str, field_name: str, fix: str) -> None:
        # ``degree`` may be a product (2·CP·TP): the field's own value is named after it
        if value % degree:
            raise ConfigError(f"{what} {value} not divisible by {label} {degree} "
                              f"(ParallelConfig.{field_name} = {getattr(pcfg, field_name)}). "
                              f"Fix: {fix}")

    need(num_heads, "num_heads", pcfg.tp, "TP", "tp",
         "choose tp dividing num_heads, or change num_heads")
    need(num_kv_heads, "num_kv_heads", pcfg.tp, "TP", "tp",
         "choose tp dividing num_kv_heads (each TP rank needs whole KV heads)")
    need(num_experts, "num_experts", pcfg.ep, "EP", "ep",
         "choose ep dividing num_experts, or change num_experts")
    if not isinstance(vpp, int) or vpp < 1:
        raise ConfigError(f"vpp {vpp!r} must be a positive integer. Fix: use 1 for no "
                          "interleaving")
    if num_layers is not None:
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

