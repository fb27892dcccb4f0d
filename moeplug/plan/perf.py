"""Step time, TFLOP/s per GPU and MFU of a mapping (one global batch).

Per micro-batch and pipeline stage (forward + backward):
    GEMMs       3 x forward multiply-adds x 2 / (peak x efficiency), plus recomputed ones
    attention   the causal core at the published FlashAttention/cuDNN rates (P26 Table 9)
    memory      MEMORY_PASSES x the bytes the stage saves for backward / HBM bandwidth:
                norms, activations, permutes and residuals are bandwidth-bound, and each
                saved tensor is written, read back and its gradient written
    all-to-all  dispatch + combine, forward and backward: tokens x top-k x hidden x 2 B x
                (EP-1)/EP over NVLink inside the NVLink domain, over the scale-out network
                beyond it (token-based dispatchers send a token once per remote node);
                with the combined-1F1B overlap A2A_OVERLAP of it hides under the other
                micro-batch's compute, whose GEMMs then lose the SMs the kernels hold
    TP          all-gather + reduce-scatter of the attention (and dense MLP) input, forward and
                backward, sequence parallel
    PP          sends between stages; bubble (pp - 1) / (vpp x micro-batches) of the step
    DP          gradient reduce-scatter + parameter all-gather, overlapped with the backward
                (exposed only beyond it)
Step = micro-batches x slowest stage x (1 + bubble) + exposed DP + optimizer (bandwidth-bound).

Constants. Four are fitted once, together, over all published rows (CONSTANTS, by
moeplug.plan.calibrate.fit; tests/test_plan.py checks the stored values are that fit); the
others are published or physical: A2A_OVERLAP = 93 % overlap ratio and the 20-SM DeepEP
carve-out on H100 (P26 section 4.2.3), attention rates (P26 Table 9), COMM_EFFICIENCY (HybridEP
on GB200 EP64 reaches ~76 % of NVLink, P26 Table 7), MEMORY_PASSES (four passes per tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeplug.config import GATED_ACTIVATIONS, ModelConfig
from moeplug.modules.flops import attention_macs, flops_per_token
from moeplug.plan.cluster import Cluster
from moeplug.plan.memory import (Mapping, Options, fsdp_comm_bytes, layer_activations,
                                 stage_params)
from moeplug.plan.split import model_blocks, rank_parts

# Fitted (see module docstring and moeplug.plan.calibrate): the fraction of BF16 dense peak
# that model GEMMs reach per GPU generation, how much faster FP8 GEMMs run than BF16 ones
# (datasheet: 2x; quantization kernels eat part of it), and a fixed cost per layer and
# micro-batch (kernel launches and host work that CUDA graphs do not remove).
# The fit trades efficiency against the per-layer cost along a shallow valley; its optimum's
# 1.4 ms per layer and micro-batch is of the size of P26's "+10 % from partial CUDA graphs" on
# DeepSeek-V3/GB200 (2048 layer-micro-batches in a ~34 s step: 10 % is ~1.7 ms each). Fitted
# with every row's published pipeline split (moeplug.plan.split; before, with an even split
# of its own: 0.836 / 0.633 / 1.073 / 1679 us).
CONSTANTS = {"eff_hopper": 0.782, "eff_blackwell": 0.563, "fp8_speedup": 1.064,
             "layer_overhead_us": 1398.6}
# This CPU: its peak *is* a measured GEMM, so efficiency 1; its per-layer cost is Python's.
CPU_LAYER_OVERHEAD_US = 2000.0
# Each saved tensor is written in the forward, read in the backward, and its gradient is
# written and read once: four passes over HBM for the bandwidth-bound ops around the GEMMs.
MEMORY_PASSES = 4.0
# Published.
ATTENTION_TFLOPS = {"hopper": (553.0, 422.0), "blackwell": (1324.0, 1083.0)}  # fwd, bwd (4K)
A2A_OVERLAP = 0.93
COMM_SM_FRACTION = {"hopper": 20 / 132, "blackwell": 16 / 148, "cpu": 0.0}
COMM_EFFICIENCY = 0.75  # achieved / link bandwidth of collectives (HybridEP GB200 EP64: ~76 %)


@dataclass
class StepTime:
    """Seconds per step, by part (``parts``), and the throughput they imply."""
    parts: dict = field(default_factory=dict)
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    tokens_per_s_per_gpu: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _layer_macs(cfg: ModelConfig, moe: bool) -> tuple[float, float, float]:
    """Per token forward multiply-adds of one layer: (attention projections, attention core
    per unit sequence length, MLP or routed + shared experts)."""
    lin, core = attention_macs(cfg)
    h = cfg.hidden_size
    if not moe:
        return lin, core, 3 * h * cfg.dense_ffn_hidden_size
    m = cfg.moe
    g = 3 if m.activation in GATED_ACTIVATIONS else 2
    return lin, core, h * (g * m.top_k * m.ffn_hidden_size + g * m.shared_expert_ffn_hidden_size
                           + m.num_experts)  # router GEMM included: it takes time


def _routed_macs(cfg: ModelConfig) -> float:
    """Per token forward multiply-adds of the routed experts alone."""
    m = cfg.moe
    g = 3 if m.activation in GATED_ACTIVATIONS else 2
    return cfg.hidden_size * g * m.top_k * m.ffn_hidden_size


def _recompute_macs(cfg: ModelConfig, moe: bool, rc: set) -> tuple[float, bool]:
    """Per token multiply-adds run again in backward, and whether the MoE block (and its
    all-to-all) is rerun."""
    if "full" in rc:  # the whole block's forward again
        lin, _, ffn = _layer_macs(cfg, moe)
        return lin + ffn, moe
    extra = 0.0
    if "mla_up_proj" in rc and cfg.attention == "mla":
        a, n = cfg.mla, cfg.num_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        extra += (a.q_lora_rank or cfg.hidden_size) * n * qk \
            + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim)
    _, _, ffn = _layer_macs(cfg, moe)
    if ("mlp" in rc and not moe) or ("moe" in rc and moe):
        extra += ffn
    return extra, "moe" in rc and moe


def _collective(nbytes: float, calls: int, bw_gbps: float, c: Cluster) -> float:
    return nbytes / (bw_gbps * 1e9 * COMM_EFFICIENCY) + calls * c.latency_us * 1e-6


def a2a_seconds(cfg: ModelConfig, mp: Mapping, opt: Options, c: Cluster) -> float:
    """One dispatch or combine of one micro-batch in one MoE layer, on one rank."""
    if mp.ep * mp.etp == 1:
        return 0.0
    m, h = cfg.moe, cfg.hidden_size
    tokens = mp.mbs * mp.seq / (mp.cp * mp.tp)
    group = mp.ep * mp.tp * mp.cp          # ranks an EP group spans (order tp-cp-ep-dp-pp)
    local = min(1.0, c.nvlink_domain / group)  # share of EP peers inside the NVLink domain
    k = m.top_k
    b = opt.act_bytes  # MXFP8 still dispatches BF16 by default (P26 Table 8)
    if opt.token_budget:
        # Sync-free: equal chunks of every budget slot, padding included, whatever the
        # dispatcher (no token-based dedup): k x budget rows a token, uniformly over the peers.
        k = k * opt.token_budget
    intra = tokens * k * h * b * (local - 1 / mp.ep)
    inter = 0.0
    if local < 1:
        if opt.dispatcher == "flex" and not opt.token_budget:
            # Token-based dispatch sends a token once per remote domain it needs: with k
            # picks over at most `groups` expert groups (group-limited routing), uniformly
            # over N domains, a token touches N (1 - (1 - 1/N)^picks) of them.
            n = group / c.nvlink_domain
            picks = min(k, opt.route_groups or k)
            k_inter = n * (1 - (1 - 1 / n) ** picks) * (n - 1) / n
        else:
            k_inter = k * (1 - local)
        inter = tokens * k_inter * h * b
    return max(_collective(intra, 1, c.nvlink_gbps, c), _collective(inter, 0, c.inter_gbps, c))


def a2a_step_bytes(cfg: ModelConfig, mp: Mapping, opt: Options, rank: int,
                   parts: list | None = None) -> float:
    """Bytes one rank of pipeline stage ``rank`` hands to its all-to-alls in one step (its
    own chunk included, as the collective's input counts it): per MoE block and micro-batch,
    the dispatch and the combine and their two backward exchanges (two more when the MoE
    block is recomputed), each the routed rows of the rank's tokens (T*K rows of the hidden
    size; sync-free: the budget slots), plus each dispatch's fp32 routing weight per row
    and its backward. The token-based (flex) dispatcher's dedup is a bandwidth saving
    (:func:`a2a_seconds`), not one moeplug's exchange makes: not counted here."""
    if mp.ep * mp.etp == 1 or not cfg.moe.num_experts:
        return 0.0
    part = (parts or rank_parts(cfg, mp))[rank]
    moe_blocks = sum(1 for x in part.layers if x)
    _, rerun = _recompute_macs(cfg, True, set(opt.recompute))
    rows = mp.mbs * mp.seq / (mp.cp * mp.tp) * cfg.moe.top_k * (opt.token_budget or 1.0)
    per_block = rows * ((4 + 2 * rerun) * cfg.hidden_size * opt.act_bytes + (2 + rerun) * 4)
    return moe_blocks * mp.microbatches * per_block


def _gemm_rate(c: Cluster, opt: Options, k: dict) -> tuple[float, float, float]:
    """(peak FLOP/s, efficiency, seconds per layer per micro-batch) of this cluster's GEMMs."""
    if c.generation == "cpu":
        return c.peak(opt.precision) * 1e12, 1.0, CPU_LAYER_OVERHEAD_US * 1e-6
    eff = k[f"eff_{c.generation}"]
    if opt.precision == "fp8":  # FP8 rate relative to the BF16 peak
        eff *= k["fp8_speedup"]
    return c.peak("bf16") * 1e12, eff, k["layer_overhead_us"] * 1e-6


def stage_seconds(cfg: ModelConfig, mp: Mapping, opt: Options, c: Cluster, rank: int,
                  constants: dict | None = None, parts: list | None = None) -> dict:
    """Forward + backward seconds of one micro-batch on pipeline stage ``rank``, by part.
    ``parts``: moeplug.plan.split.rank_parts(cfg, mp), when the caller has them."""
    gen = c.generation
    peak, eff, overhead = _gemm_rate(c, opt, constants or CONSTANTS)
    tok = mp.mbs * mp.seq / mp.cp
    rc = set(opt.recompute)
    gemm = core = core_rerun = mem = a2a = tp = 0.0
    part = (parts or rank_parts(cfg, mp))[rank]
    layers = part.layers
    for moe in (False, True):  # each layer kind once, times how many the stage holds
        count = sum(1 for x in layers if x == moe)
        if not count:
            continue
        lin, core_macs, ffn = _layer_macs(cfg, moe)
        if moe and opt.token_budget and gen != "cpu":
            # A GPU's static experts run a batched GEMM over every budget slot (the CPU's
            # compute only the routed rows).
            ffn += (opt.token_budget - 1) * _routed_macs(cfg)
        extra, rerun_moe = _recompute_macs(cfg, moe, rc)
        gemm += count * 2 * tok * (3 * lin + extra + 3 * ffn) / mp.tp
        core += count * 2 * tok * mp.seq * core_macs / mp.tp  # forward; backward is twice
        if "full" in rc:  # and the rebuilt block's forward once more
            core_rerun += count * 2 * tok * mp.seq * core_macs / mp.tp
        # Recompute drops tensors from memory, not from the work: every tensor is still
        # written, read and its gradient written and read, and a recomputed one is written
        # once more in backward.
        # Megatron's tensors, as the published rows ran (memory.layer_activations).
        saved = sum(layer_activations(cfg, moe, mp, replace(opt, recompute=()),
                                      megatron=True).values())
        kept = (tok / mp.tp * cfg.hidden_size * opt.act_bytes if opt.full_recompute else
                sum(layer_activations(cfg, moe, mp, opt, megatron=True).values()))
        mem += count * (MEMORY_PASSES * saved + (saved - kept)) / (c.hbm_tbps * 1e12)
        if moe:
            a2a += count * (4 + 2 * rerun_moe) * a2a_seconds(cfg, mp, opt, c)
        if mp.tp > 1:
            nbytes = tok * cfg.hidden_size * opt.act_bytes * (mp.tp - 1) / mp.tp
            calls = 4 * (1 if moe else 2)
            tp += count * _collective(calls * nbytes, calls, c.nvlink_gbps, c)
    h, V = cfg.hidden_size, cfg.vocab_size
    if part.loss:  # the head: the main logits and every MTP depth's (Megatron's output layer)
        gemm += 2 * 3 * tok * h * V * (1 + cfg.mtp_num_layers) / mp.tp
    gemm += 2 * 3 * tok * part.mtp * 2 * h * h / mp.tp  # MTP eh_proj, where the blocks run
    if gen in ATTENTION_TFLOPS:
        fwd, bwd = ATTENTION_TFLOPS[gen]
        attn = (core + core_rerun) / (fwd * 1e12) + 2 * core / (bwd * 1e12)
    else:
        attn = (3 * core + core_rerun) / (peak * eff)
    if opt.a2a_overlap and a2a:
        eff *= 1 - COMM_SM_FRACTION.get(gen, 0.0)
    gemm_s = gemm / (peak * eff)
    if opt.a2a_overlap:
        hidden = min(A2A_OVERLAP * a2a, gemm_s + attn)
        a2a -= hidden
    pp = 0.0
    if mp.pp > 1:  # activations to the next stage and gradients back, per virtual chunk
        pp = _collective(2 * mp.vpp * tok / mp.tp * h * opt.act_bytes, 2 * mp.vpp,
                         c.inter_gbps if c.gpus_per_node < mp.tp * mp.cp * 2 else c.nvlink_gbps,
                         c)
    launch = overhead * len(layers)
    return {"gemm": gemm_s, "attention": attn, "memory_bound": mem, "overhead": launch,
            "all_to_all": a2a, "tp_comm": tp, "pp_comm": pp}


def calibrated_cpu_parts(cfg: ModelConfig, mp: Mapping, opt: Options, c: Cluster) -> dict:
    """A step on a CPU calibrated for this run (moeplug.plan.calibrate_cpu): per micro-batch,
    each layer's attention unit plus its MLP or MoE unit, the head once; all in series on the
    rank's threads (nothing overlaps on one CPU); then the step's collectives at the measured
    links, and the optimizer over this rank's shard. Pipeline layouts are not calibrated."""
    k = c.costs
    layers = model_blocks(cfg)
    parts = dict.fromkeys(("gemm", "attention", "elementwise", "kernels", "host"), 0.0)
    for moe in layers:
        for u in (k.units["attn"], k.units["moe" if moe else "mlp"]):
            for name in parts:
                parts[name] += getattr(u, name)
    for name in parts:
        parts[name] += getattr(k.units["head"], name)
        parts[name] *= mp.microbatches
    parts["collectives"] = k.collective_seconds()
    parts["grad_sync"] = k.grad_sync
    dense, expert = stage_params(cfg, mp, 0)
    if opt.distributed_optimizer and mp.world > 1:
        dense, expert = dense / (mp.dp * mp.cp), expert / mp.edp
    parts["optimizer"] = (dense + expert) * k.optimizer_s_per_param
    return parts


def step_time(cfg: ModelConfig, mp: Mapping, opt: Options, c: Cluster,
              constants: dict | None = None) -> StepTime:
    """Predicted step of one global batch; ``constants`` overrides :data:`CONSTANTS`."""
    if c.costs is not None:
        return _throughput(cfg, mp, opt, c, calibrated_cpu_parts(cfg, mp, opt, c))
    split = rank_parts(cfg, mp)
    stages = [stage_seconds(cfg, mp, opt, c, r, constants, split) for r in range(mp.pp)]
    slow = max(stages, key=lambda s: sum(s.values()))
    m = mp.microbatches
    parts = {k: v * m for k, v in slow.items()}
    per_mb = sum(slow.values())
    parts["pp_bubble"] = per_mb * (mp.pp - 1) / mp.vpp if mp.pp > 1 else 0.0
    # DP: fp32 gradient reduce-scatter + bf16 parameter all-gather, hidden under backward.
    dense, expert = stage_params(cfg, mp, 0, split)
    dp_s = 0.0
    for n, d, span in ((dense, mp.dp * mp.cp, mp.world // mp.pp),
                       (expert, mp.edp, mp.world // mp.pp)):
        if d > 1:
            bw = c.nvlink_gbps if span <= c.nvlink_domain else c.inter_gbps
            dp_s += _collective(n * (opt.grad_bytes + opt.param_bytes) * (d - 1) / d, 2, bw, c)
    backward = (2 / 3) * m * (slow["gemm"] + slow["attention"])
    parts["dp_comm"] = max(0.0, dp_s - backward)
    if mp.fsdp:  # FSDP's per-micro-batch gathers and reduce-scatters replace ZeRO-1's
        parts["dp_comm"] = 0.0
        parts["fsdp_comm"] = fsdp_seconds(cfg, mp, opt, c, split, slow)
    # Optimizer: read and write master weights, moments and gradients of the local shard.
    shard = dense / (mp.dp * mp.cp) + expert / mp.edp
    parts["optimizer"] = shard * 32 / (c.hbm_tbps * 1e12)
    return _throughput(cfg, mp, opt, c, parts)


def _throughput(cfg: ModelConfig, mp: Mapping, opt: Options, c: Cluster,
                parts: dict) -> StepTime:
    total = sum(parts.values())
    tokens = (mp.gbs or mp.dp * mp.mbs) * mp.seq
    model_flops = flops_per_token(cfg, cfg.vocab_size, mp.seq) * tokens
    tflops = model_flops / total / mp.world / 1e12
    peak = c.peak("bf16" if opt.precision == "fp8" else opt.precision)
    return StepTime(parts=parts, tflops_per_gpu=tflops, mfu=tflops / peak,
                    tokens_per_s_per_gpu=tokens / total / mp.world)


def fsdp_seconds(cfg, mp: Mapping, opt: Options, c, parts: list, slow: dict) -> float:
    """Exposed FSDP comm of a step: every micro-batch's gathers and reduce-scatters on the
    slowest-communicating stage, at the DP links perf.step_time uses, less the compute of the
    slowest stage (``slow``: its per-micro-batch perf.stage_seconds) they prefetch under."""
    span = mp.world // mp.pp
    bw = c.nvlink_gbps if span <= c.nvlink_domain else c.inter_gbps
    worst = 0.0
    for part in parts:
        dense, expert = fsdp_comm_bytes(cfg, mp, opt, part)
        calls = (2 + mp.fsdp_reshard) * (len(part.layers) + part.mtp + 1)
        worst = max(worst, _collective(dense + expert, calls, bw, c))
    m = mp.microbatches
    return max(0.0, m * worst - m * (slow["gemm"] + slow["attention"]))
