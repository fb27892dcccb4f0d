"""FSDP2 (``parallel.fsdp``, moeplug.parallel.fsdp) in the plan: what a rank holds and sends.

Legend: d = DP x CP (the dense parameters' FSDP mesh), e = EDP (the experts'), n_d / n_e a
stage's dense / expert parameters on this rank (its TP / EP / ETP slice, memory.stage_params).

Sharded state, what ``fully_shard`` leaves between steps (torch keeps the sharded parameter in
its own dtype, fp32, the master weights; gradients are reduce-scattered in fp32, Megatron's
accumulate_allreduce_grads_in_fp32; AdamW's moments are DTensors like the parameter):
    (4 + grad_bytes + moments) x (n_d / d + n_e / e)        moments 8 B (4 with bf16 moments)
Unsharded working set on top (the parameters gathered in the compute dtype, param_bytes):
    reshard_after_forward true:  two blocks' parameters (the one computing and the next one,
        prefetched) plus one block's unsharded gradient before its reduce-scatter;
    reshard_after_forward false: every block of the stage stays gathered from its forward to
        its backward, plus one block's unsharded gradient;
    and the root's parameters (embedding, final norm, head), which moeplug keeps gathered
        between forward and backward (moeplug.parallel.fsdp.apply_fsdp).
Comm per micro-batch: each block's parameters all-gathered in forward (and again in backward
when resharded), its gradient reduce-scattered in backward; the root's gathered and reduced
once. FSDP prefetches the next unit's gather under the current one's compute, so only the part
beyond the stage's compute is exposed. It replaces ZeRO-1's step-end reduce-scatter and
all-gather (perf.step_time's dp_comm).
"""

from __future__ import annotations

from moeplug.plan.memory import Mapping, Options, layer_params

FP32 = 4  # the sharded parameters (the master weights) and the reduced gradients


def _mtp_dense(cfg, part) -> float:
    h = cfg.hidden_size
    return part.mtp * (2 * h * h + 3 * h)


def block_params(cfg, mp: Mapping, part) -> list[tuple[float, float]]:
    """(dense, expert) parameters of each FSDP block unit of a stage on this rank (its layers,
    then its MTP blocks, each one unit as apply_fsdp wraps them)."""
    units = [layer_params(cfg, moe) for moe in part.layers]
    last_moe = bool(cfg.moe_layer_pattern[-1]) if part.mtp else False
    for _ in range(part.mtp):  # an MTP block: a layer of the last layer's kind + eh_proj, norms
        d, e = layer_params(cfg, last_moe)
        units.append((d + _mtp_dense(cfg, part) / part.mtp, e))
    return [(d / mp.tp, e / (mp.ep * mp.etp)) for d, e in units]


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


def fsdp_seconds(cfg, mp: Mapping, opt: Options, c, parts: list, slow: dict) -> float:
    """Exposed FSDP comm of a step: every micro-batch's gathers and reduce-scatters on the
    slowest-communicating stage, at the DP links perf.step_time uses, less the compute of the
    slowest stage (``slow``: its per-micro-batch perf.stage_seconds) they prefetch under."""
    from moeplug.plan.perf import _collective
    span = mp.world // mp.pp
    bw = c.nvlink_gbps if span <= c.nvlink_domain else c.inter_gbps
    worst = 0.0
    for part in parts:
        dense, expert = fsdp_comm_bytes(cfg, mp, opt, part)
        calls = (2 + mp.fsdp_reshard) * (len(part.layers) + part.mtp + 1)
        worst = max(worst, _collective(dense + expert, calls, bw, c))
    m = mp.microbatches
    return max(0.0, m * worst - m * (slow["gemm"] + slow["attention"]))
