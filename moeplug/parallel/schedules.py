"""Pipeline parallelism, part 2: the 1F1B schedules (pure op order) and the step that runs them.

Legend: P pipeline ranks, C model chunks per rank (VPP), M micro-batches, v = c * P + r the
virtual stage of chunk c on rank r (V = P * C of them), B micro-batch, S sequence, D hidden.

Op order (Megatron-Core ``megatron/core/pipeline_parallel/schedules.py``):
  * 1F1B (C = 1): rank r runs ``P - r - 1`` warm-up forwards, then alternates one forward and
    one backward, then drains the remaining backwards. At most ``P - r`` micro-batches' activations
    are alive on rank r (GPipe would hold all M).
  * Interleaved 1F1B (C > 1): forwards walk the chunks in groups of P micro-batches (forward
    iteration k runs chunk ``(k mod P·C) // P`` on micro-batch ``(k // (P·C))·P + k mod P``),
    backwards the same with the chunk order reversed; warm-up is ``2·(P - r - 1) + (C - 1)·P``
    forwards (all of them when M = P). Needs M to be a multiple of P.
These are pure functions of (P, r, M, C), so the order can be unit-tested without processes.

Running a step (:func:`forward_backward_pipeline`): every forward receives its input from the
previous virtual stage (the first one embeds the tokens), every backward receives the output's
gradient from the next one, and both send their result on with a non-blocking tagged send
(:mod:`moeplug.parallel.p2p`), so ranks wait only on real data dependencies.

Objective: each micro-batch contributes ``(lm_loss + sum of every stage's aux losses
(+ mtp_loss)) / M``,
exactly what one process doing gradient accumulation over the same M micro-batches
differentiates. A stage that is not last backpropagates the received gradient together with its
own MoE layers' ``aux_loss / M``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from moeplug.ops import delayed_wgrad
from moeplug.config import ConfigError
from moeplug.observability.timing import stage
from moeplug.parallel import p2p
from moeplug.parallel.context_parallel import shard_sequence
from moeplug.parallel.fsdp import gathered_dtype
from moeplug.parallel.ep_overlap import run_beside
from moeplug.parallel.embedding_group import allreduce_embedding_grads, embedding_grads_snapshot


@dataclass(frozen=True, order=True)
class Op:
    """One compute step of a rank: ``kind`` "F" (forward) or "B" (backward) of ``microbatch``
    through this rank's model chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def _check(pp: int, rank: int, num_microbatches: int, vpp: int) -> None:
    for name, v in (("pp", pp), ("num_microbatches", num_microbatches), ("vpp", vpp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"pipeline schedule: {name} = {v!r} must be a positive integer. "
                              f"Fix: pass {name} >= 1")
    if not isinstance(rank, int) or not 0 <= rank < pp:
        raise ConfigError(f"pipeline schedule: rank = {rank!r} is outside [0, {pp}). Fix: pass "
                          "this rank's index in its pipeline group (groups.rank_in('pp'))")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"pipeline schedule: vpp = {vpp} model chunks need pp > 1. "
                          "Fix: set vpp = 1, or pp > 1")
    if vpp > 1 and num_microbatches % pp:
        raise ConfigError(f"pipeline schedule: num_microbatches = {num_microbatches} "
                          f"(train.grad_accum_steps) is not a multiple of PP = {pp}, which the "
                          f"interleaved schedule (vpp = {vpp}) needs. Fix: set "
                          f"train.grad_accum_steps to a multiple of {pp}, or vpp = 1")


def one_f_one_b(pp: int, rank: int, num_microbatches: int) -> list[Op]:
    """Non-interleaved 1F1B op order of pipeline rank ``rank``."""
    _check(pp, rank, num_microbatches, 1)
    warmup = min(pp - rank - 1, num_microbatches)
    steady = num_microbatches - warmup
    ops = [Op("F", m) for m in range(warmup)]
    for i in range(steady):
        ops += [Op("F", warmup + i), Op("B", i)]
    return ops + [Op("B", m) for m in range(steady, num_microbatches)]


def interleaved_1f1b(pp: int, rank: int, num_microbatches: int, vpp: int) -> list[Op]:
    """Interleaved 1F1B op order of pipeline rank ``rank`` with ``vpp`` chunks per rank."""
    _check(pp, rank, num_microbatches, vpp)
    total = num_microbatches * vpp

    def op(kind: str, k: int) -> Op:
        in_group = k % (pp * vpp)
        chunk = in_group // pp
        if kind == "B":  # backwards run the chunks last to first
            chunk = vpp - 1 - chunk
        return Op(kind, (k // (pp * vpp)) * pp + k % pp, chunk)

    if num_microbatches == pp:
        warmup = total  # all forwards, then all backwards
    else:
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    steady = total - warmup
    ops = [op("F", k) for k in range(warmup)]
    for k in range(steady):
        ops += [op("F", warmup + k), op("B", k)]
    return ops + [op("B", k) for k in range(steady, total)]


def pipeline_schedule(pp: int, rank: int, num_microbatches: int, vpp: int = 1,
                      forward_only: bool = False) -> list[Op]:
    """The op order for this rank: 1F1B, interleaved 1F1B (vpp > 1), or forwards only (eval:
    the forward order of the training schedule with the backwards left out; interleaved with
    a micro-batch count that is no multiple of PP — an evaluation's last, shorter micro-batch
    runs alone — each micro-batch through this rank's chunks in turn)."""
    if forward_only and vpp > 1 and pp > 1 and num_microbatches % pp:
        _check(pp, rank, num_microbatches, 1)
        # Every rank runs (micro-batch, virtual stage) in increasing order, and stage v of a
        # micro-batch needs only stage v - 1 of it: no wait can close a cycle (sends are async).
        return [Op("F", m, c) for m in range(num_microbatches) for c in range(vpp)]
    ops = (one_f_one_b(pp, rank, num_microbatches) if vpp == 1 else
           interleaved_1f1b(pp, rank, num_microbatches, vpp))
    return [o for o in ops if o.kind == "F"] if forward_only else ops


@dataclass(frozen=True)
class PipelineStepResult:
    """One pipelined step, the same on every rank of the pipeline group.

    loss = lm_loss + aux_loss (+ mtp_loss), each the mean over micro-batches (aux summed over
    all stages' MoE layers, MTP blocks' included), detached. expert_counts: per MoE layer of
    *this rank's* chunks (chunk order), int64 [E] tokens routed to each expert, summed over the
    micro-batches. mtp_loss: None without MTP layers.
    """

    loss: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    expert_counts: list[torch.Tensor]
    mtp_loss: torch.Tensor | None = None


def forward_backward_pipeline(chunks: Sequence[Any], microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                              groups: Any, *, forward_only: bool = False,
                              autocast: Callable[[], ContextManager] | None = None,
                              activation_dtype: torch.dtype | None = None,
                              grad_accumulation: Any = None) -> PipelineStepResult:
    """Run forward (+ backward) of ``microbatches`` through this rank's ``chunks`` (from
    :func:`moeplug.build.build_stage_modules`), leaving the gradients of
    ``sum_m (lm_loss_m + aux_loss_m) / M`` accumulated in the chunks' ``.grad``.

    ``microbatches``: M pairs (tokens_BS, targets_BS) of whole sequences, the same on every
    rank of the pipeline group (middle stages only read their shapes), or triples with the
    document positions (packed documents), which every stage's attention reads. Under context
    parallelism each rank takes its CP shard here (``shard_sequence``), as the single-process
    trainer does before ``model(...)``. ``groups``: a ParallelGroups. ``autocast``: a factory of
    the precision's forward context, entered around every chunk forward. Collective over the
    pipeline group (one all-reduce of the losses) and, when the last stage holds an embedding
    copy (tied head or MTP), over the embedding group: the copies' grads are summed after the
    backwards (Megatron does it in finalize_model_grads), so callers need no extra step.
    ``activation_dtype``: the residual stream's dtype, which the stages send each other; by
    default the chunks' parameters' (bf16 under ``train.param_dtype``/``master_dtype: bf16``,
    whose bf16 embedding starts a bf16 stream; fp32 otherwise, under autocast too).
    ``grad_accumulation``: an object whose ``add(last)`` takes the grads out of ``.grad`` after
    each backward and, with ``last``, writes their sums back (the trainer's fp32 sums of bf16
    grads); called after every backward op and once more, with ``last``, before the embedding
    grads are summed.
    """
    pp, rank = groups.size("pp"), groups.rank_in("pp")
    vpp, num_mb = len(chunks), len(microbatches)
    ops = pipeline_schedule(pp, rank, num_mb, vpp, forward_only)
    members, group = groups.members["pp"], groups.pp
    prev_rank, next_rank = members[(rank - 1) % pp], members[(rank + 1) % pp]
    last_stage = pp * vpp - 1
    autocast = autocast or contextlib.nullcontext
    if activation_dtype is None:
        # (FSDP under a bf16 recipe gathers the fp32 shards in bf16: the stream is bf16 then)
        activation_dtype = next((gathered_dtype(c, p) for c in chunks for p in c.parameters()),
                                torch.float32)
    if groups.size("cp") > 1:
        cp, cp_rank = groups.size("cp"), groups.rank_in("cp")
        microbatches = [tuple(shard_sequence(t, cp, cp_rank) for t in mb) for mb in microbatches]
    embedding_grads = None if forward_only else embedding_grads_snapshot(list(chunks))

    def tag(direction: int, stage: int, m: int) -> int:
        return p2p.message_tag(direction, stage, m, pp * vpp, num_mb)

    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
    sends: list[Any] = []
    lm_sum = torch.zeros((), dtype=torch.float64)
    aux_sum = torch.zeros((), dtype=torch.float64)
    mtp_sum = torch.zeros((), dtype=torch.float64)
    has_mtp = torch.zeros((), dtype=torch.float64)  # 1 on the last stage when MTP ran
    counts: dict[tuple[int, int], torch.Tensor] = {}
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()

    def run(op: Op) -> None:
        c, m = op.chunk, op.microbatch
        v = c * pp + rank
        tokens_BS, targets_BS, *documents = microbatches[m]
        positions_BS = documents[0] if documents else None
        if op.kind == "F":
            if v == 0:
                x = tokens_BS
            else:
                shape = chunks[c].activation_shape(tokens_BS)  # S / TP under SP
                x = p2p.recv(shape, activation_dtype, prev_rank, group,
                             tag(p2p.FORWARD, v - 1, m))
                x.requires_grad_(not forward_only)
            with autocast():  # the loss and MTP stages read the targets and tokens
                out = chunks[c](x, targets_BS, tokens_BS, positions_BS)
            aux_sum.add_(out.aux_loss.detach().double())
            for i, counts_E in enumerate(out.expert_counts):
                counts[(c, i)] = counts.get((c, i), 0) + counts_E
            if v == last_stage:
                lm_sum.add_(out.lm_loss.detach().double())
                objective = out.lm_loss + out.aux_loss
                if out.mtp_loss is not None:
                    mtp_sum.add_(out.mtp_loss.detach().double())
                    has_mtp.fill_(1.0)
                    objective = objective + out.mtp_loss
                objective = objective / num_mb
            else:
                if out.x_BSD.dtype != activation_dtype:
                    raise TypeError(f"pipeline stage {v} produced a {out.x_BSD.dtype} "
                                    f"activation but activation_dtype = {activation_dtype}. "
                                    "Fix: pass activation_dtype= the residual stream's dtype")
                sends.append(p2p.send_async(out.x_BSD, next_rank, group,
                                            tag(p2p.FORWARD, v, m)))
                objective = out.aux_loss / num_mb
            if not forward_only:
                saved[(c, m)] = (x, out.x_BSD, objective)
            return
        # Backward of micro-batch m through chunk c.
        x, y_BSD, objective = saved.pop((c, m))
        if v == last_stage:
            with stage("backward"):
                torch.autograd.backward(objective)
                delayed_wgrad.run_pending()  # normally empty: MoE layers flush at their input
        else:
            grad_BSD = p2p.recv(tuple(y_BSD.shape), y_BSD.dtype, next_rank, group,
                                tag(p2p.BACKWARD, v + 1, m))
            tensors, grads = [y_BSD], [grad_BSD]
            if objective.requires_grad:  # this chunk's aux losses join the objective here
                tensors.append(objective)
                grads.append(torch.ones_like(objective))
            with stage("backward"):
                torch.autograd.backward(tensors, grads)
                delayed_wgrad.run_pending()
        if v > 0:
            sends.append(p2p.send_async(x.grad, prev_rank, group, tag(p2p.BACKWARD, v, m)))
        if grad_accumulation is not None:
            grad_accumulation.add(last=False)

    # Combined 1F1B (parallel.overlap_moe_expert_parallel_comm): a backward followed by a
    # forward in the op list runs beside it, on a helper thread over the twin groups
    # (moeplug.parallel.ep_overlap.run_beside). Allowed for every such pair: a forward never
    # depends on a backward of its own rank, and each op still starts no later than in the
    # plain order, so the tagged p2p messages cannot deadlock (see ep_overlap).
    twins = None if forward_only else groups.twins
    with grad_mode:
        i = 0
        while i < len(ops):
            if twins is not None and ops[i].kind == "B" and i + 1 < len(ops) \
                    and ops[i + 1].kind == "F":
                run_beside(functools.partial(run, ops[i]), functools.partial(run, ops[i + 1]),
                           twins, name=f"moeplug-backward-{ops[i]}")
                i += 2
            else:
                run(ops[i])
                i += 1
    p2p.wait_all(sends)
    if grad_accumulation is not None:
        grad_accumulation.add(last=True)
    if embedding_grads is not None:
        allreduce_embedding_grads(list(chunks), embedding_grads)
    # Every rank reports the whole pipeline's losses: the last stage has lm (and MTP), every
    # stage has aux.
    losses = torch.stack([lm_sum, aux_sum, mtp_sum, has_mtp * num_mb]) / num_mb
    if group is not None:
        dist.all_reduce(losses, group=group)
    lm, aux, mtp, mtp_ran = losses.float().unbind()
    mtp_loss = mtp if mtp_ran > 0 else None
    loss = lm + aux if mtp_loss is None else lm + aux + mtp_loss
    return PipelineStepResult(loss, lm, aux, [counts[k] for k in sorted(counts)], mtp_loss)
