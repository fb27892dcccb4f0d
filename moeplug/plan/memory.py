"""Per-rank memory: weights, gradients, optimizer state, activations per module, comm buffers.

Conventions (Megatron-Core with the distributed optimizer, what P26 Table 3 assumes):
    weights BF16 (2 B) + main gradients FP32 (4 B) = 6 B per parameter on its rank;
    FP32 master weights + Adam moments = 12 B per parameter (8 with BF16 moments), sharded
    ZeRO-1 style over DP x CP (dense parameters) and over EDP (expert parameters).
Activations are the tensors autograd saves for backward, per transformer layer and per token
(:func:`layer_activations`), in BF16 (2 B; FP8 runs keep linear-layer inputs in 1 B), with the
routing weights applied inside the activation (Megatron's memory-efficient permutation and
moeplug's fused weighted SwiGLU), so expert outputs are not saved. A pipeline stage holds the
activations of its in-flight micro-batches: ``pp - rank`` of them under 1F1B, Megatron's
interleaved warm-up ``((pp - rank - 1) * 2 + (vpp - 1) * pp + 1) / vpp`` stage-equivalents
with VPP. Recompute drops the tensors of the named modules (Megatron ``recompute_modules``);
offloaded tensors stay on the device for one layer only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeplug.config import (GATED_ACTIVATIONS, OFFLOAD_MODULES, RECOMPUTE_MODULES, ConfigError,
                            ModelConfig)
from moeplug.modules.flops import attention_macs

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Mapping:
    """A parallel mapping and the batch it trains (``dp``/``edp`` derive from ``world``)."""
    world: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    mbs: int = 1
    gbs: int = 0      # 0: one micro-batch per DP rank
    seq: int = 4096
    # A config's parallel.num_layers_in_first_stage / _last_stage (None: moeplug train's even
    # split, or the uneven one train_layer_split picks when the layers do not divide evenly).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("world", "tp", "cp", "pp", "ep", "etp", "vpp", "mbs", "seq", "gbs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "gbs" else 1):
                # world, seq and gbs come from their own flags, the degrees from --mapping.
                flag, fix = {"world": ("--gpus", "pass the device count, e.g. --gpus 8"),
                             "seq": ("--seq", "pass the sequence length, e.g. --seq 4096"),
                             "gbs": ("--gbs", "pass the global batch in sequences, e.g. "
                                     "--gbs 256")}.get(
                    name, (f"--mapping {name}", "write e.g. --mapping tp=1,ep=8,pp=2"))
                raise ConfigError(f"{flag} {v!r}: must be a positive integer. Fix: {fix}")
        if self.world % (self.tp * self.cp * self.pp):
            raise ConfigError(f"mapping tp·cp·pp = {self.tp * self.cp * self.pp} does not divide "
                              f"{self.world} GPUs. Fix: choose degrees whose product divides "
                              "--gpus")
        if self.world % (self.etp * self.ep * self.pp):
            raise ConfigError(f"mapping ep={self.ep}: etp·ep·pp = {self.etp * self.ep * self.pp} "
                              f"does not divide {self.world} GPUs. Fix: choose ep dividing "
                              f"{self.world // self.pp}")
        per_step = self.dp * self.mbs
        if self.gbs % per_step:
            # Each DP rank trains whole micro-batches: GBS = DP x MBS x micro-batches.
            lo = self.gbs // per_step * per_step
            ok = " or ".join(f"--gbs {g}" for g in (lo, lo + per_step) if g > 0)
            raise ConfigError(f"--gbs {self.gbs}: not a multiple of DP x micro-batch size = "
                              f"{self.dp} x {self.mbs} = {per_step} (each of the {self.dp} DP "
                              f"ranks trains whole micro-batches of {self.mbs}). Fix: use a "
                              f"multiple of {per_step}, e.g. {ok}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def microbatches(self) -> int:
        """Micro-batches per DP rank per step."""
        return max(1, (self.gbs or self.dp * self.mbs) // (self.dp * self.mbs))

    def short(self) -> str:
        s = f"TP{self.tp} EP{self.ep} PP{self.pp}"
        return s + (f" CP{self.cp}" if self.cp > 1 else "") + \
            (f" VPP{self.vpp}" if self.vpp > 1 else "") + \
            (f" ETP{self.etp}" if self.etp > 1 else "") + f" MBS{self.mbs}"


@dataclass(frozen=True, kw_only=True)
class Options:
    precision: str = "bf16"          # GEMM precision: bf16, fp8 or fp32 (CPU runs)
    recompute: tuple = ()            # module names, or ("full",): whole blocks (granularity full)
    offload: tuple = ()
    a2a_overlap: bool = False
    dispatcher: str = "flex"          # "flex" (token-based DeepEP/HybridEP) or "alltoall"
    route_groups: int = 0            # group-limited routing: expert groups per token (0: top_k)
    distributed_optimizer: bool = True
    bf16_moments: bool = False
    param_bytes: int = 2             # weights as trained (fp32 CPU runs: 4)
    grad_bytes: int = 4              # main gradients
    # Sync-free MoE (runtime.sync_free): its token budget, 0 = the dynamic path. The static
    # region exchanges and keeps every budget slot (E*C ~ routed rows x budget, padding
    # included) and keeps FC1's output, never the activation (moe_act recompute built in).
    token_budget: float = 0.0

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp8", "fp32"):
            raise ConfigError(f"--precision {self.precision!r}: unknown. Fix: use bf16, fp8 or "
                              "fp32")
        if "full" in self.recompute and len(self.recompute) > 1:
            raise ConfigError(f"--recompute {','.join(self.recompute)}: full recomputes whole "
                              "blocks, it takes no module names. Fix: --recompute full, or "
                              "the module names alone")
        for name, allowed in (("recompute", RECOMPUTE_MODULES + ("full",)),
                              ("offload", OFFLOAD_MODULES)):
            bad = [m for m in getattr(self, name) if m not in allowed]
            if bad:
                raise ConfigError(f"--{name} {','.join(bad)}: unknown module. Fix: use any of "
                                  f"{', '.join(allowed)}")
        b = self.token_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0 \
                or b == float("inf"):
            raise ConfigError(f"token_budget {b!r}: must be a finite number >= 0. Fix: 0 for "
                              "the dynamic path, or runtime.token_budget (e.g. 2.0)")
        if self.dispatcher not in ("flex", "alltoall", "allgather"):
            raise ConfigError(f"--dispatcher {self.dispatcher!r}: unknown. Fix: use flex, "
                              "alltoall or allgather")

    @property
    def full_recompute(self) -> bool:
        """Megatron's recompute granularity full: every block rebuilt in backward."""
        return "full" in self.recompute

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


# ---------------------------------------------------------------- parameters

def _gated(cfg: ModelConfig) -> int:
    return 3 if cfg.moe.activation in GATED_ACTIVATIONS else 2


def layer_params(cfg: ModelConfig, moe: bool) -> tuple[float, float]:
    """(dense, expert) parameters of one layer. Attention projections are reused from the
    FLOPs count: per token, each projection weight is one multiply-add."""
    h = cfg.hidden_size
    attn = attention_macs(cfg)[0] + 2 * h  # projections + the two norms
    if not moe:
        return attn + 3 * h * cfg.dense_ffn_hidden_size, 0.0
    m = cfg.moe
    g = _gated(cfg)
    shared = g * h * m.shared_expert_ffn_hidden_size + (h if m.shared_expert_gate else 0)
    return attn + shared + m.num_experts * h, float(m.num_experts * g * h * m.ffn_hidden_size)


def stage_layers(cfg: ModelConfig, pp: int) -> list[list[bool]]:
    """Per pipeline stage, its layers' MoE flags: as even as possible, earlier stages take the
    remainder (Megatron-style uneven split; MTP layers ride on the last stage)."""
    pattern = list(cfg.moe_layer_pattern)
    base, extra = divmod(len(pattern), pp)
    out, i = [], 0
    for r in range(pp):
        n = base + (1 if r < extra else 0)
        out.append(pattern[i:i + n])
        i += n
    out[-1] = out[-1] + [bool(pattern[-1])] * cfg.mtp_num_layers
    return out


def stage_params(cfg: ModelConfig, mp: Mapping, rank: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of pipeline stage ``rank``."""
    h, V = cfg.hidden_size, cfg.vocab_size
    dense = expert = 0.0
    for moe in stage_layers(cfg, mp.pp)[rank]:
        d, e = layer_params(cfg, moe)
        dense, expert = dense + d, expert + e
    if rank == 0:
        dense += V * h                                   # embedding
    if rank == mp.pp - 1:
        dense += h + (0 if cfg.tie_embeddings else V * h)  # final norm + output head
        dense += cfg.mtp_num_layers * (2 * h * h + 3 * h)  # MTP eh_proj + norms
    return dense / mp.tp, expert / (mp.ep * mp.etp)


# ---------------------------------------------------------------- activations

def layer_activations(cfg: ModelConfig, moe: bool, mp: Mapping, opt: Options) -> dict:
    """Bytes one rank saves for backward in one layer for one micro-batch, per module."""
    h, b = cfg.hidden_size, opt.act_bytes
    lin = 1 if opt.precision == "fp8" else b      # FP8 keeps linear-layer inputs in one byte
    tok = mp.mbs * mp.seq / mp.cp                 # tokens of this rank's micro-batch
    sp = tok / mp.tp                              # sequence-parallel shard (norms, residual)
    rc = set(opt.recompute)
    out: dict[str, float] = {}

    def put(name: str, elems_per_token: float, tokens: float, nbytes: int, drop: bool = False):
        if not drop:
            out[name] = out.get(name, 0.0) + elems_per_token * tokens * nbytes

    put("attn_norm", h, sp, b)                                  # residual / norm input
    put("layernorm", h, tok, lin, "layernorm" in rc)            # norm out = QKV input
    n = cfg.num_heads
    if cfg.attention == "mla":
        a = cfg.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        down = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim
        put("mla_down", down + (a.q_lora_rank or 0) + a.kv_lora_rank, tok, lin)
        put("mla_up_proj", n * (2 * qk + a.v_head_dim) / mp.tp, tok, b, "mla_up_proj" in rc)
        v = a.v_head_dim
    else:
        d = cfg.head_dim
        put("qkv_linear", (n + 2 * cfg.num_kv_heads) * d / mp.tp, tok, b)
        v = d
    put("core_attn", n * v / mp.tp, tok, lin, "core_attn" in rc)  # output = o_proj input
    put("mlp_norm", h, sp, b)
    put("layernorm", h, sp if moe else tok, lin, "layernorm" in rc)
    if not moe:
        f = cfg.dense_ffn_hidden_size / mp.tp
        put("mlp", 3 * f, tok, b, "mlp" in rc)                  # fc1 out (2f) + act out (f)
        return out
    m = cfg.moe
    gated = 2 if m.activation in GATED_ACTIVATIONS else 1
    routed = sp * m.top_k                                       # rows this rank computes
    slots = routed * (opt.token_budget or 1.0)                  # sync-free: the budget slots
    drop_moe = "moe" in rc
    put("router", 2 * m.num_experts, sp, 4, drop_moe)            # fp32 logits + scores
    put("expert_fc1", h, slots, lin, drop_moe)                   # permuted tokens
    put("moe_fc1_out", gated * m.ffn_hidden_size / mp.etp, slots, b, drop_moe)
    put("moe_act", m.ffn_hidden_size / mp.etp, routed, lin,
        drop_moe or "moe_act" in rc or bool(opt.token_budget))
    fs = m.shared_expert_ffn_hidden_size
    if fs:
        drop = drop_moe or "shared_experts" in rc
        put("shared_experts", (gated + 1) * fs, sp, b, drop)
    return out


def inflight(mp: Mapping, rank: int) -> float:
    """Micro-batches whose activations stage ``rank`` holds at its peak (in whole-stage units)."""
    m = mp.microbatches
    if mp.vpp == 1:
        return float(min(mp.pp - rank, m))
    chunks = (mp.pp - rank - 1) * 2 + (mp.vpp - 1) * mp.pp + 1
    return min(chunks, m * mp.vpp) / mp.vpp


@dataclass
class MemoryBreakdown:
    """One rank's bytes, by part; ``activations`` maps module -> bytes."""
    rank: int
    weights_grads: float
    optimizer: float
    activations: dict = field(default_factory=dict)
    comm_buffers: float = 0.0

    @property
    def activations_total(self) -> float:
        return sum(self.activations.values())

    @property
    def total(self) -> float:
        return self.weights_grads + self.optimizer + self.activations_total + self.comm_buffers


def stage_memory(cfg: ModelConfig, mp: Mapping, opt: Options, rank: int) -> MemoryBreakdown:
    dense, expert = stage_params(cfg, mp, rank)
    wg = (dense + expert) * (opt.param_bytes + opt.grad_bytes)
    state = 4 + (4 if opt.bf16_moments else 8)     # master weights + two moments
    if opt.distributed_optimizer:
        optim = state * (dense / (mp.dp * mp.cp) + expert / mp.edp)
    else:
        optim = state * (dense + expert)
    if opt.param_bytes == 4:                       # fp32 training: the weights are the master
        optim -= 4 * (dense + expert) / ((mp.dp * mp.cp) if opt.distributed_optimizer else 1)
    acts: dict[str, float] = {}
    held = inflight(mp, rank)
    layers = stage_layers(cfg, mp.pp)[rank]
    if opt.full_recompute:
        # Each block keeps its input (the sequence-parallel shard of the residual stream); the
        # one block being rebuilt in backward holds its tensors again, once.
        tok_sp = mp.mbs * mp.seq / mp.cp / mp.tp
        acts["block_input"] = len(layers) * held * tok_sp * cfg.hidden_size * opt.act_bytes
        plain = replace(opt, recompute=())
        acts["rebuilt_block"] = max(sum(layer_activations(cfg, moe, mp, plain).values())
                                    for moe in set(layers))
    for moe in (False, True):
        count = sum(1 for x in layers if x == moe)
        if opt.full_recompute:
            break
        for k, v in (layer_activations(cfg, moe, mp, opt).items() if count else ()):
            # Offloaded tensors stay on the device for the layer being computed only.
            mult = count / len(layers) if k in opt.offload else count * held
            acts[k] = acts.get(k, 0.0) + v * mult
    tok = mp.mbs * mp.seq / mp.cp
    if rank == mp.pp - 1:  # fp32 logits saved by the cross-entropy, one micro-batch at a time
        acts["logits"] = tok * cfg.vocab_size / mp.tp * 4 * (1 + cfg.mtp_num_layers)
    comm = 0.0
    if cfg.moe.num_experts and mp.ep > 1 and any(layers):
        # Dispatch + combine buffers of one layer's worth of routed rows (double-buffered).
        comm = 2 * tok / mp.tp * cfg.moe.top_k * cfg.hidden_size * opt.act_bytes \
            * (opt.token_budget or 1.0)
    return MemoryBreakdown(rank=rank, weights_grads=wg, optimizer=optim, activations=acts,
                           comm_buffers=comm)


def peak_memory(cfg: ModelConfig, mp: Mapping, opt: Options) -> MemoryBreakdown:
    """The pipeline stage with the most bytes (the one that decides whether a mapping fits)."""
    return max((stage_memory(cfg, mp, opt, r) for r in range(mp.pp)), key=lambda m: m.total)


def _layer_split_config(mp: Mapping, first: int | None = None, last: int | None = None):
    from moeplug.config import ParallelConfig
    return ParallelConfig(tp=mp.tp, cp=mp.cp, pp=mp.pp, ep=mp.ep, etp=mp.etp, vpp=mp.vpp,
                          sequence_parallel=mp.tp > 1, num_layers_in_first_stage=first,
                          num_layers_in_last_stage=last)


def train_layer_split(num_layers: int, mp: Mapping) -> tuple[list[int], int | None, int | None]:
    """How ``moeplug train`` would split ``num_layers`` over ``mp``'s pipeline: (layers per
    pipeline rank, num_layers_in_first_stage, num_layers_in_last_stage).

    The rules are train's own (ParallelConfig.rank_layer_counts: an even split over PP·VPP, or
    uneven first / last stages with the middle ones even, every rank a multiple of VPP). A
    config's first / last stage (mp.first_stage_layers / last_stage_layers) is taken as given;
    otherwise, when the layers do not split evenly, the most balanced first / last stage
    train accepts is proposed (the run then sets them in its parallel section). Raises
    ConfigError (train's refusal) when no split exists."""
    first, last = mp.first_stage_layers, mp.last_stage_layers
    if first is not None or last is not None:
        return _layer_split_config(mp, first, last).rank_layer_counts(num_layers), first, last
    try:
        return _layer_split_config(mp).rank_layer_counts(num_layers), None, None
    except ConfigError as even_error:
        refusal = even_error
    pp, v, n = mp.pp, mp.vpp, num_layers
    best = None
    if pp > 1:
        # Middle stages hold m layers each (a multiple of vpp); the rest goes to the first and
        # last stage, as evenly as multiples of vpp allow. rank_layer_counts judges each.
        for m in sorted({n // pp // v * v, -(-n // pp // v) * v}) if pp > 2 else [0]:
            rest = n - (pp - 2) * m
            if rest < 0:
                continue
            l = rest // 2 // v * v
            try:
                counts = _layer_split_config(mp, rest - l, l).rank_layer_counts(n)
            except ConfigError:
                continue
            # the fullest rank decides; then the least spread
            if best is None or (max(counts), max(counts) - min(counts)) < \
                    (max(best[0]), max(best[0]) - min(best[0])):
                best = (counts, rest - l, l)
    if best is None:
        raise refusal
    return best


def check_model(cfg: ModelConfig, mp: Mapping) -> None:
    """The layout rules ``moeplug train`` applies (moeplug.config.validate_model and
    ParallelConfig.rank_layer_counts): shards split evenly (heads over TP, experts over EP,
    sequence over CP·TP) and the layers split over PP·VPP chunks as train splits them
    (:func:`train_layer_split`: uneven first / last stages allowed, every rank a multiple of
    VPP). The planner's own stage split (:func:`stage_layers`) stays Megatron's "earlier
    stages take the remainder"; it differs from train's by at most a few layers per stage."""
    from moeplug.parallel.layout import validate_model
    pc = _layer_split_config(mp)
    validate_model(pc.resolve(mp.world), num_experts=cfg.moe.num_experts,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   num_layers=None, vpp=mp.vpp, ffn_hidden_size=cfg.moe.ffn_hidden_size,
                   seq_len=mp.seq)
    if cfg.num_layers < mp.pp * mp.vpp:
        raise ConfigError(f"mapping pp·vpp = {mp.pp * mp.vpp} exceeds num_layers "
                          f"{cfg.num_layers}. Fix: lower pp or vpp")
    try:
        train_layer_split(cfg.num_layers, mp)
    except ConfigError as e:
        ok = [v for v in range(1, cfg.num_layers // mp.pp + 1)
              if _splits(cfg.num_layers, replace(mp, vpp=v, first_stage_layers=None,
                                                 last_stage_layers=None))]
        given = mp.first_stage_layers is not None or mp.last_stage_layers is not None
        uneven = "" if given or mp.pp == 1 else \
            " (and no uneven num_layers_in_first_stage / _last_stage fixes it)"
        vpps = ", ".join(map(str, ok[:-1])) + (" or " if len(ok) > 1 else "") + str(ok[-1])
        fix = (str(e).split(". Fix: ", 1)[-1] + " (the config's parallel section)" if given
               else f"use vpp {vpps} with pp={mp.pp} (every pipeline rank holds a multiple of "
               "vpp layers), or another pp")
        raise ConfigError(
            f"--mapping pp={mp.pp},vpp={mp.vpp}: moeplug train refuses this layer split: "
            f"{_reason(e)}{uneven}. Fix: {fix}") from None


def _splits(num_layers: int, mp: Mapping) -> bool:
    try:
        train_layer_split(num_layers, mp)
        return True
    except ConfigError:
        return False


def _reason(e: ConfigError) -> str:
    """The middle of train's "<field> = <value>: <reason>. Fix: ..." line."""
    text = str(e).split(". Fix:")[0]
    return text.split(": ", 1)[1] if ": " in text else text


def calibrated_cpu_memory(cfg: ModelConfig, mp: Mapping, opt: Options, costs) -> MemoryBreakdown:
    """Peak bytes of one rank of a run on a CPU calibrated for it (moeplug.plan.calibrate_cpu):
    weights, gradients and optimizer state as :func:`stage_memory` counts them; activations
    from the units as this implementation runs them. The forward leaves every unit's saved
    tensors (``saved_bytes``); the backward then walks the units in reverse, and while unit
    *i* runs the rank holds the saved tensors of the units before it, unit *i*'s own peak
    (``peak_bytes``: its saved tensors, backward temporaries and new gradients) and the
    gradients of the units after it. The peak is the largest of those moments (pp = 1). Under
    full recompute a block is rebuilt whole, so its attention unit's tensors are live again
    while its MLP or MoE unit runs backward."""
    base = stage_memory(cfg, mp, opt, 0)
    order = []  # forward order
    for moe in stage_layers(cfg, 1)[0]:
        order += [costs.units["attn"], costs.units["moe" if moe else "mlp"]]
    order.append(costs.units["head"])
    grads = base.weights_grads * opt.grad_bytes / (opt.param_bytes + opt.grad_bytes)
    full = cfg.recompute.granularity == "full"
    worst, name = 0.0, ""
    # The ops' workspace cache keeps what a unit's backward freed for the units before it: its
    # footprint, once the backward of unit j has run, is the pool bytes live then (the saved
    # ones of the units before j and j's own); the free part of it is held on top of what
    # unit i (< j) holds live (moeplug.ops.workspace bounds it by that live peak).
    saved_pool = [sum(u.saved_pool_bytes for u in order[:i]) for i in range(len(order) + 1)]
    for i in range(len(order)):
        held = sum(u.saved_bytes for u in order[:i]) + order[i].peak_bytes \
            + grads * (len(order) - 1 - i) / len(order)
        footprint = max((saved_pool[j] + order[j].pool_bytes
                         for j in range(i + 1, len(order))), default=0)
        held += max(0.0, footprint - saved_pool[i] - order[i].pool_bytes)
        if full and i % 2 == 1 and i < len(order) - 1:
            # A checkpointed block is rebuilt whole: its attention unit's tensors are back
            # (and its kept input is part of them) while its MLP / MoE unit runs backward.
            held += order[i - 1].saved_plain_bytes - order[i - 1].saved_bytes
        if held > worst:
            worst, name = held, f"backward of unit {i} of {len(order)}"
    weights = base.weights_grads - grads  # gradients are in the walk above
    # The units run without expert parallelism: the all-to-all's send and receive rows
    # (stage_memory's comm_buffers) come on top, twice: on the CPU the dispatcher's re-sort by
    # local expert writes workspace buffers of the same rows (expert-major on the way there,
    # arrival order on the way back), which the workspace cache keeps with the exchange's.
    # When the MoE layer's forward is recomputed, its exchange runs again inside the backward,
    # beside the backward's own: twice that.
    rerun = full or "moe" in cfg.recompute.modules
    return MemoryBreakdown(rank=0, weights_grads=weights, optimizer=base.optimizer,
                           activations={f"activations + grads ({name})": worst},
                           comm_buffers=(4 if rerun else 2) * base.comm_buffers)
