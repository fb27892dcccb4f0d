"""Per-rank memory: weights, gradients, optimizer state, activations per module, comm buffers.

Conventions (Megatron-Core with the distributed optimizer, what P26 Table 3 assumes):
    weights BF16 (2 B) + main gradients FP32 (4 B) = 6 B per parameter on its rank;
    FP32 master weights + Adam moments = 12 B per parameter (8 with BF16 moments), sharded
    ZeRO-1 style over DP x CP (dense parameters) and over EDP (expert parameters).
Where moeplug differs from Megatron the bytes are moeplug's: under sequence parallelism the q/k/v
projections keep their all-gathered input, and a Qwen3-style q/k norm keeps its input beside
the rotated q and k attention keeps.
Activations are the tensors autograd saves for backward, per transformer layer and per token
(:func:`layer_activations`), in BF16 (2 B; FP8 runs keep linear-layer inputs in 1 B), with the
routing weights applied inside the activation (Megatron's memory-efficient permutation and
moeplug's fused weighted SwiGLU), so expert outputs are not saved. A pipeline stage holds the
activations of its in-flight micro-batches: ``pp - rank`` of them under 1F1B; with VPP the
``(pp - rank - 1) * 2 + (vpp - 1) * pp + 1`` chunk forwards of Megatron's interleaved warm-up,
each counted with its own chunk's layers (a layout's chunks may differ in size). The pipeline
split is moeplug train's (moeplug.plan.split). Recompute drops the tensors of the named modules
(Megatron ``recompute_modules``); offloaded tensors are on the device for two layers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeplug.config import (GATED_ACTIVATIONS, OFFLOAD_MODULES, RECOMPUTE_MODULES, ConfigError,
                            ModelConfig)
from moeplug.modules.flops import attention_macs
from moeplug.plan.split import model_blocks, plan_layout, rank_parts, split_config

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
    # Megatron's layout string (parallel.pipeline_layout): what every virtual stage holds;
    # sets vpp when vpp is 1 (moeplug.plan.split).
    layout: str | None = None
    # FSDP2 (parallel.fsdp): 1 shards parameters, gradients and optimizer state over DP x CP /
    # EDP (fsdp_memory); fsdp_reshard = parallel.fsdp_reshard_after_forward.
    fsdp: int = 0
    fsdp_reshard: int = 1

    def __post_init__(self) -> None:
        for name in ("fsdp", "fsdp_reshard"):
            if getattr(self, name) not in (0, 1) or isinstance(getattr(self, name), bool):
                raise ConfigError(f"--mapping {name}={getattr(self, name)!r}: must be 0 or 1. "
                                  f"Fix: write {name}=1 (on) or {name}=0 (off)")
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
        if self.layout is not None:
            self._take_vpp_from_layout()
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

    def _take_vpp_from_layout(self) -> None:
        """vpp = the layout's stages / pp, as train sets it (parallel.pipeline_layout)."""
        from moeplug.config.pipeline_layout import LayoutError, from_letters, parse_layout
        if not isinstance(self.layout, str):
            raise ConfigError(f"--mapping layout={self.layout!r}: must be a layout string. "
                              "Fix: write e.g. layout=Et|tt|tL (last in --mapping)")
        try:
            stages = from_letters(parse_layout(self.layout), self.pp, self.vpp)
        except LayoutError as e:
            raise ConfigError(f"--mapping layout={self.layout}: {e.rule}. Fix: {e.fix}") from None
        object.__setattr__(self, "vpp", stages.vpp)  # frozen: derived once, here

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
            (f" ETP{self.etp}" if self.etp > 1 else "") + f" MBS{self.mbs}" + \
            ((" FSDP" + ("" if self.fsdp_reshard else " (kept gathered)")) if self.fsdp else "")


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
    return attn + _moe_dense(cfg), float(m.num_experts * _gated(cfg) * h * m.ffn_hidden_size)


def _moe_dense(cfg: ModelConfig) -> float:
    """An MoE layer's non-expert parameters: the shared experts (and their gate), the router."""
    h, m = cfg.hidden_size, cfg.moe
    shared = _gated(cfg) * h * m.shared_expert_ffn_hidden_size + (h if m.shared_expert_gate else 0)
    return shared + m.num_experts * h


def tp_whole(cfg: ModelConfig, moe: bool) -> float:
    """Parameters of one layer that every TP rank holds whole (moeplug.parallelize.tp): its
    two norms; MLA's down projections and latent norms (q_a_proj, kv_a_proj with the shared
    rope key, q_a_norm, kv_a_norm), which Megatron duplicates too while splitting the heads;
    and an MoE layer's router, shared experts and their gate, which run on this rank's
    sequence chunk (Megatron splits the shared experts over TP instead). The GQA attention's
    projections and the dense MLP are split."""
    h = cfg.hidden_size
    whole = 2.0 * h
    if cfg.attention == "mla":
        m = cfg.mla
        whole += (m.q_lora_rank * (h + 1) if m.q_lora_rank else 0) \
            + m.kv_lora_rank * (h + 1) + h * m.qk_rope_head_dim
    if moe:
        whole += _moe_dense(cfg)
    return whole


def stage_params(cfg: ModelConfig, mp: Mapping, rank: int,
                 parts: list | None = None) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of pipeline stage ``rank``: its layers
    and MTP blocks, the embedding where it sits (the first stage's, the copies of an MTP stage
    or a tied head), the final norm and head on the loss stage. ``parts``: rank_parts(cfg,
    mp), when the caller has them."""
    h, V = cfg.hidden_size, cfg.vocab_size
    part = (parts or rank_parts(cfg, mp))[rank]
    dense = expert = 0.0
    for moe in part.layers:
        d, e = layer_params(cfg, moe)
        dense, expert = dense + d, expert + e
    whole = sum(tp_whole(cfg, moe) for moe in part.layers)  # on every TP rank
    dense -= whole
    if part.embedding:
        dense += V * h                                   # embedding (or its copy)
    if part.loss:
        dense += h + (0 if cfg.tie_embeddings else V * h)  # final norm + output head
    dense += part.mtp * (2 * h * h + 3 * h)              # MTP eh_proj + norms
    return dense / mp.tp + whole, expert / (mp.ep * mp.etp)


# ---------------------------------------------------------------- activations

def layer_activations(cfg: ModelConfig, moe: bool, mp: Mapping, opt: Options,
                      megatron: bool = False) -> dict:
    """Bytes one rank saves for backward in one layer for one micro-batch, per module
    (``megatron``: Megatron's where moeplug's differ: under sequence parallelism recompute
    ``layernorm`` drops the norm's output whole, where moeplug's column-parallel projections
    keep the all-gathered copy)."""
    out: dict[str, float] = {}
    for name, nbytes, _ in _layer_parts(cfg, moe, mp, opt, megatron):
        out[name] = out.get(name, 0.0) + nbytes
    return out


def layer_offloaded(cfg: ModelConfig, moe: bool, mp: Mapping, opt: Options) -> dict:
    """The part of :func:`layer_activations` (per module) that ``opt.offload`` moves off the
    device, as moeplug's offload names move it on a GPU (moeplug.modules.offload): the name's
    module inputs, or the tensors its expert ops mark."""
    out: dict[str, float] = {}
    for name, nbytes, by in _layer_parts(cfg, moe, mp, opt):
        if by in opt.offload:
            out[name] = out.get(name, 0.0) + nbytes
    return out


def _layer_parts(cfg: ModelConfig, moe: bool, mp: Mapping, opt: Options,
                 megatron: bool = False) -> list[tuple[str, float, str | None]]:
    """(module, bytes, the offload name that moves them or None) of every tensor one layer
    saves for one micro-batch (see :func:`layer_activations`)."""
    h, b = cfg.hidden_size, opt.act_bytes
    lin = 1 if opt.precision == "fp8" else b      # FP8 keeps linear-layer inputs in one byte
    tok = mp.mbs * mp.seq / mp.cp                 # tokens of this rank's micro-batch
    sp = tok / mp.tp                              # sequence-parallel shard (norms, residual)
    rc = set(opt.recompute)
    out: list[tuple[str, float, str | None]] = []

    def put(name: str, elems_per_token: float, tokens: float, nbytes: int, drop: bool = False,
            off: str | None = None):
        if not drop:
            out.append((name, elems_per_token * tokens * nbytes, off))

    put("attn_norm", h, sp, b, off="attn_norm")                 # residual / norm input
    n = cfg.num_heads
    if cfg.attention == "mla":
        a = cfg.mla
        # norm out = the down projections' input, the sequence shard itself (their latents
        # enter the TP region); without a q LoRA q_proj keeps the gathered copy under SP
        put("layernorm", h, sp, lin, "layernorm" in rc, off="qkv_linear")  # the module's input
        if not a.q_lora_rank and mp.tp > 1 and not megatron:
            put("layernorm", h, tok, lin)
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        down = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim
        # the gathered latents (the latent norms' inputs) and their norms' outputs (the up
        # projections' inputs), whole on every TP rank
        put("mla_down", down + (a.q_lora_rank or 0) + a.kv_lora_rank, tok, lin)
        put("mla_up_proj", n * (2 * qk + a.v_head_dim) / mp.tp, tok, b, "mla_up_proj" in rc,
            off="core_attn")                                    # core attention's q, k, v
        v = a.v_head_dim
    else:
        # norm out = QKV input; under SP moeplug's projections keep the gathered copy, which
        # layernorm's discarding (of the sequence shard) does not reach
        # (the module's input, which qkv_linear moves, unless SP gathered it inside)
        put("layernorm", h, tok, lin, "layernorm" in rc and (megatron or mp.tp == 1),
            off="qkv_linear" if mp.tp == 1 else None)
        d = cfg.head_dim
        put("qkv_linear", (n + 2 * cfg.num_kv_heads) * d / mp.tp, tok, b, off="core_attn")
        if cfg.qk_norm:  # the q / k norms keep their inputs (the projections' outputs)
            put("qk_norm", (n + cfg.num_kv_heads) * d / mp.tp, tok, b)
        v = d
    # output = o_proj input; attn_proj's offload moves nothing: the attention kernel keeps it
    put("core_attn", n * v / mp.tp, tok, lin, "core_attn" in rc)
    put("mlp_norm", h, sp, b, off="mlp_norm")
    put("layernorm", h, sp if moe else tok, lin,
        "layernorm" in rc and (megatron or moe or mp.tp == 1))
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
    put("expert_fc1", h, slots, lin, drop_moe, off="expert_fc1")  # permuted tokens
    # FC1's output, which moe_act offload moves (not under moe_act recompute, whose rebuild
    # holds it on the device)
    put("moe_fc1_out", gated * m.ffn_hidden_size / mp.etp, slots, b, drop_moe,
        off=None if "moe_act" in rc else "moe_act")
    put("moe_act", m.ffn_hidden_size / mp.etp, routed, lin,
        drop_moe or "moe_act" in rc or bool(opt.token_budget))
    fs = m.shared_expert_ffn_hidden_size
    if fs:
        drop = drop_moe or "shared_experts" in rc
        put("shared_experts", (gated + 1) * fs, sp, b, drop)
    return out


def inflight(mp: Mapping, rank: int) -> list[float]:
    """Per model chunk of stage ``rank``, the micro-batches whose activations it holds at the
    rank's peak: the forwards of its warm-up (1F1B: ``pp - rank``; interleaved: Megatron's
    ``(pp - rank - 1) * 2 + (vpp - 1) * pp + 1`` chunk forwards, which walk the chunks in
    groups of ``pp`` micro-batches; with exactly ``pp`` micro-batches every forward runs before
    the first backward), so chunks of unequal size count each their own."""
    m, vpp = mp.microbatches, mp.vpp
    if vpp == 1:
        return [float(min(mp.pp - rank, m))]
    forwards = min((mp.pp - rank - 1) * 2 + (vpp - 1) * mp.pp + 1, m * vpp)
    if m == mp.pp:  # Megatron's schedule (and moeplug's) then runs every forward first
        forwards = m * vpp
    held = [0.0] * vpp
    for k in range(forwards):  # forward k of the schedule runs chunk (k mod pp·vpp) // pp
        held[(k % (mp.pp * vpp)) // mp.pp] += 1
    return held


@dataclass
class MemoryBreakdown:
    """One rank's bytes, by part; ``activations`` maps module -> bytes."""
    rank: int
    weights_grads: float
    optimizer: float
    activations: dict = field(default_factory=dict)
    comm_buffers: float = 0.0
    # FSDP: the parameters (and one gradient) gathered unsharded while blocks compute
    fsdp_gathered: float = 0.0
    # Parameters narrower than their main grads: the largest one's grad in the parameter's
    # dtype, alive beside the main grads while it is added into them (its backward's output)
    grad_landing: float = 0.0

    @property
    def activations_total(self) -> float:
        return sum(self.activations.values())

    @property
    def total(self) -> float:
        return self.weights_grads + self.optimizer + self.activations_total + \
            self.comm_buffers + self.fsdp_gathered + self.grad_landing


def largest_param(cfg: ModelConfig, mp: Mapping, part) -> float:
    """Elements of the largest parameter tensor on a rank of stage ``part``: the embedding or
    head (V x h over TP) where it sits, else a MoE layer's stacked expert weights (moeplug keeps
    the local experts' FC1 in one [L, 2F, h] tensor)."""
    h, V = cfg.hidden_size, cfg.vocab_size
    sizes = [0.0]
    if part.embedding or (part.loss and not cfg.tie_embeddings):
        sizes.append(V * h / mp.tp)
    if any(part.layers) and cfg.moe.num_experts:
        local = cfg.moe.num_experts / mp.ep
        sizes.append(local * (_gated(cfg) - 1) * cfg.moe.ffn_hidden_size * h / mp.etp)
    return max(sizes)


def stage_memory(cfg: ModelConfig, mp: Mapping, opt: Options, rank: int,
                 parts: list | None = None) -> MemoryBreakdown:
    parts = parts or rank_parts(cfg, mp)
    part = parts[rank]
    dense, expert = stage_params(cfg, mp, rank, parts)
    wg = (dense + expert) * (opt.param_bytes + opt.grad_bytes)
    state = 4 + (4 if opt.bf16_moments else 8)     # master weights + two moments
    if opt.distributed_optimizer:
        optim = state * (dense / (mp.dp * mp.cp) + expert / mp.edp)
    else:
        optim = state * (dense + expert)
    if opt.param_bytes == 4:                       # fp32 training: the weights are the master
        optim -= 4 * (dense + expert) / ((mp.dp * mp.cp) if opt.distributed_optimizer else 1)
    gathered = 0.0
    if mp.fsdp:  # everything sharded, plus the unsharded working set (fsdp_memory below)
        wg, optim, gathered = fsdp_memory(cfg, mp, opt, part, dense, expert)
    acts: dict[str, float] = {}
    held = inflight(mp, rank)  # per chunk
    layers = part.layers
    # blocks times the micro-batches whose tensors each is holding, by kind
    held_blocks = {moe: sum(h * chunk.count(moe) for h, chunk in zip(held, part.chunks))
                   for moe in (False, True)}
    if opt.full_recompute and layers:
        # Each block keeps its input (the sequence-parallel shard of the residual stream); the
        # one block being rebuilt in backward holds its tensors again, once.
        tok_sp = mp.mbs * mp.seq / mp.cp / mp.tp
        acts["block_input"] = sum(held_blocks.values()) * tok_sp * cfg.hidden_size \
            * opt.act_bytes
        plain = replace(opt, recompute=())
        acts["rebuilt_block"] = max(sum(layer_activations(cfg, moe, mp, plain).values())
                                    for moe in set(layers))
    for moe in (False, True):
        count = sum(1 for x in layers if x == moe)
        if opt.full_recompute:
            break
        # Offloaded tensors are on the device for two layers at the peak: in backward the one
        # being computed and the one prefetched ahead of it (moeplug.modules.offload, as
        # Megatron's), a layer's worth each.
        on_device = min(held_blocks[moe], 2 * count / len(layers)) if count else 0.0
        for k, v, by in (_layer_parts(cfg, moe, mp, opt) if count else ()):
            mult = on_device if by in opt.offload else held_blocks[moe]
            acts[k] = acts.get(k, 0.0) + v * mult
    tok = mp.mbs * mp.seq / mp.cp
    if part.loss:  # fp32 logits saved by the cross-entropy for every micro-batch the loss's
        # chunk (the last) holds, and in its backward one depth's fp32 and bf16 logit
        # gradients (6 B a logit)
        logits = tok * cfg.vocab_size / mp.tp
        acts["logits"] = logits * (4 * (1 + cfg.mtp_num_layers) * held[-1] + 6)
    comm = 0.0
    if cfg.moe.num_experts and mp.ep > 1 and any(layers):
        # Dispatch + combine buffers of one layer's worth of routed rows (double-buffered).
        comm = 2 * tok / mp.tp * cfg.moe.top_k * cfg.hidden_size * opt.act_bytes \
            * (opt.token_budget or 1.0)
    landing = 0.0
    if opt.param_bytes < opt.grad_bytes and not mp.fsdp:
        landing = largest_param(cfg, mp, part) * opt.param_bytes
    return MemoryBreakdown(rank=rank, weights_grads=wg, optimizer=optim, activations=acts,
                           comm_buffers=comm, fsdp_gathered=gathered, grad_landing=landing)


def peak_memory(cfg: ModelConfig, mp: Mapping, opt: Options) -> MemoryBreakdown:
    """The pipeline stage with the most bytes (the one that decides whether a mapping fits)."""
    parts = rank_parts(cfg, mp)
    return max((stage_memory(cfg, mp, opt, r, parts) for r in range(mp.pp)),
               key=lambda m: m.total)


def check_model(cfg: ModelConfig, mp: Mapping) -> None:
    """The layout rules ``moeplug train`` applies (moeplug.config.validate_model and
    ParallelConfig.layer_layout): shards split evenly (heads over TP, experts over EP,
    sequence over CP·TP), and the layers split over PP·VPP chunks as train splits them
    (moeplug.plan.split.plan_layout: the mapping's own split, else one train accepts, which
    the plan then names)."""
    from moeplug.parallel.layout import validate_model
    pc = split_config(mp)
    validate_model(pc.resolve(mp.world), num_experts=cfg.moe.num_experts,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   num_layers=None, vpp=mp.vpp, ffn_hidden_size=cfg.moe.ffn_hidden_size,
                   seq_len=mp.seq)
    plan_layout(cfg, mp)
    if mp.fsdp:
        check_fsdp(cfg, mp)


def check_fsdp(cfg: ModelConfig, mp: Mapping) -> None:
    """moeplug train's FSDP rules that a mapping and model decide (ParallelConfig.resolve and
    moeplug.config.modes.fsdp): a DP x CP mesh of more than one rank to shard over, and no tied
    embedding split over pipeline stages. (The rules on options - ZeRO-1, the combined 1F1B -
    are the planner's to apply: it plans FSDP in place of ZeRO-1.)"""
    if mp.dp * mp.cp == 1:
        raise ConfigError(f"--mapping fsdp=1: FSDP shards over DP x CP = {mp.dp} x {mp.cp} = 1 "
                          f"rank at {mp.world} GPUs: nothing to shard. Fix: fsdp=0, or lower "
                          "tp/pp so DP > 1")
    if mp.pp > 1 and cfg.tie_embeddings:
        raise ConfigError(f"--mapping fsdp=1 with pp={mp.pp}: moeplug train refuses FSDP with a "
                          "tied embedding split over pipeline stages (their grads are sharded by "
                          "different stages). Fix: fsdp=0, or pp=1")


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
    for moe in model_blocks(cfg):
        order += [costs.units["attn"], costs.units["moe" if moe else "mlp"]]
    order.append(costs.units["head"])
    grads = base.weights_grads * opt.grad_bytes / (opt.param_bytes + opt.grad_bytes)
    full = cfg.recompute.granularity == "full"
    worst, name = 0.0, ""
    # The ops' workspace cache keeps what a unit's backward freed for the units before it: its
    # footprint, once the backward of unit j has run, is the pool bytes live then (the saved
    # ones of the units before j and j's own); the free part of it is held on top of what
    # unit i (< j) holds live (moeplug.runtime.workspace bounds it by that live peak).
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


# --- FSDP2 (parallel.fsdp, moeplug.parallel.fsdp): what a rank holds and sends ----------------
# FSDP2 (``parallel.fsdp``, moeplug.parallel.fsdp) in the plan: what a rank holds and sends.
#
# Legend: d = DP x CP (the dense parameters' FSDP mesh), e = EDP (the experts'), n_d / n_e a
# stage's dense / expert parameters on this rank (its TP / EP / ETP slice, memory.stage_params).
#
# Sharded state, what ``fully_shard`` leaves between steps (torch keeps the sharded parameter in
# its own dtype, fp32, the master weights; gradients are reduce-scattered in fp32, Megatron's
# accumulate_allreduce_grads_in_fp32; AdamW's moments are DTensors like the parameter):
#     (4 + grad_bytes + moments) x (n_d / d + n_e / e)        moments 8 B (4 with bf16 moments)
# Unsharded working set on top (the parameters gathered in the compute dtype, param_bytes):
#     reshard_after_forward true:  two blocks' parameters (the one computing and the next one,
#         prefetched) plus one block's unsharded gradient before its reduce-scatter;
#     reshard_after_forward false: every block of the stage stays gathered from its forward to
#         its backward, plus one block's unsharded gradient;
#     and the root's parameters (embedding, final norm, head), which moeplug keeps gathered
#         between forward and backward (moeplug.parallel.fsdp.apply_fsdp).
# Comm per micro-batch: each block's parameters all-gathered in forward (and again in backward
# when resharded), its gradient reduce-scattered in backward; the root's gathered and reduced
# once. FSDP prefetches the next unit's gather under the current one's compute, so only the part
# beyond the stage's compute is exposed. It replaces ZeRO-1's step-end reduce-scatter and
# all-gather (perf.step_time's dp_comm).
FP32 = 4  # the sharded parameters (the master weights) and the reduced gradients


def _mtp_dense(cfg, part) -> float:
    h = cfg.hidden_size
    return part.mtp * (2 * h * h + 3 * h)


def block_params(cfg, mp: Mapping, part) -> list[tuple[float, float]]:
    """(dense, expert) parameters of each FSDP block unit of a stage on this rank (its layers,
    then its MTP blocks, each one unit as apply_fsdp wraps them)."""
    units = [(*layer_params(cfg, moe), tp_whole(cfg, moe)) for moe in part.layers]
    last_moe = bool(cfg.moe_layer_pattern[-1]) if part.mtp else False
    for _ in range(part.mtp):  # an MTP block: a layer of the last layer's kind + eh_proj, norms
        d, e = layer_params(cfg, last_moe)
        units.append((d + _mtp_dense(cfg, part) / part.mtp, e, tp_whole(cfg, last_moe)))
    return [((d - whole) / mp.tp + whole, e / (mp.ep * mp.etp)) for d, e, whole in units]


def root_params(cfg, mp: Mapping, part) -> float:
    """The root unit's parameters on this rank: the embedding, final norm and head."""
    h, V = cfg.hidden_size, cfg.vocab_size
    n = V * h if part.embedding else 0.0
    if part.loss:
        n += h + (0 if cfg.tie_embeddings else V * h)
    return n / mp.tp


def fsdp_memory(cfg, mp: Mapping, opt: Options, part, dense: float, expert: float
                ) -> tuple[float, float, float]:
    """(parameters + gradients, optimizer state, gathered working set) bytes of one rank of a
    stage under FSDP; ``dense`` / ``expert``: memory.stage_params of the stage."""
    d, e = mp.dp * mp.cp, mp.edp
    shard = dense / d + expert / e
    moments = 4 if opt.bf16_moments else 8
    weights_grads = shard * (FP32 + opt.grad_bytes)
    optimizer = shard * moments
    units = [dn + ex for dn, ex in block_params(cfg, mp, part)]
    gathered = 0.0
    if units:
        biggest = max(units)
        if mp.fsdp_reshard:
            held = sum(sorted(units)[-2:])  # the computing block and the prefetched one
        else:
            held = sum(units)
        gathered = held * opt.param_bytes + biggest * FP32  # + one unsharded fp32 gradient
    gathered += root_params(cfg, mp, part) * opt.param_bytes
    return weights_grads, optimizer, gathered


def fsdp_comm_bytes(cfg, mp: Mapping, opt: Options, part) -> tuple[float, float]:
    """(dense, expert) bytes this rank sends per micro-batch over its FSDP meshes: all-gathers
    of the gathered parameters and reduce-scatters of the fp32 gradients, each (m-1)/m of the
    unsharded tensor on a mesh of m ranks."""
    d, e = mp.dp * mp.cp, mp.edp
    gathers = 2 if mp.fsdp_reshard else 1
    dense = expert = 0.0
    for dn, ex in block_params(cfg, mp, part):
        per = gathers * opt.param_bytes + FP32
        dense += dn * per * (d - 1) / d
        expert += ex * per * (e - 1) / e
    dense += root_params(cfg, mp, part) * (opt.param_bytes + FP32) * (d - 1) / d
    return dense, expert
