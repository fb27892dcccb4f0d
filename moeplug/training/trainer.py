"""The training loop: one function, top to bottom, over pieces built elsewhere.

Shape-suffix legend: B micro-batch size, S sequence length, E experts.

Reproducibility contract: the model is initialised after :func:`seed_everything`; step ``s``
trains on the next global batch of the corpus' sample stream, epochs of Megatron GPTDataset
indices seeded by ``train.seed`` (moeplug.data.loader); validation is the whole validation set,
or its first ``train.eval_batches`` micro-batches; the LR is a pure function of the step.
Model, optimizer and RNG states and the loader's position go into checkpoints, so a resumed run
takes exactly the steps an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from moeplug.ops import delayed_wgrad
from moeplug.config import ConfigError, RootConfig
from moeplug.data.loader import (Batches, EvalBatches, eval_batches, loader_state,
                                 resume_position, sample_batches)
from moeplug.data.documents import document_eod, with_positions
from moeplug.modules.flops import flops_per_token as model_flops_per_token
from moeplug.observability import add_micro_batch, moe_metrics
from moeplug.observability.timing import add_times, measure_stages, stage
from moeplug.runtime.stash import StashOverflowError
from moeplug.training import distributed as D
from moeplug.training.checkpoint_meta import HF_ORIGIN
from moeplug.training.checkpoint import (load_checkpoint, load_sharded_checkpoint, nothing_to_train,
                                         resolve_resume, save_checkpoint,
                                         save_sharded_checkpoint)
from moeplug.training.faults import (NonFiniteWatch, TestFault, TrainingFault, is_finite,
                                     nonfinite_message)
from moeplug.training.flops import achieved_tflops, measure_peak_tflops, mfu, slow_bf16_note
from moeplug.training.grad_accumulation import Fp32GradAccumulation
from moeplug.training.memory import (ActivationMeter, gather_ranks, memory_record,
                                     reset_process_peak)
from moeplug.training.metrics import MetricsWriter, Progress, expert_load
from moeplug.training.optim import build_optimizer, lr_at

# Streams of batch_generator: for tests and benchmarks that draw their own random windows
# (moeplug.data.get_batch); the trainer's batches come from moeplug.data.loader.
_TRAIN_STREAM, _VAL_STREAM = 0, 1


@dataclass(frozen=True)
class TrainSummary:
    steps: int                # completed optimizer steps
    final_train_loss: float   # mean loss of the last step's micro-batches (lm + aux + mtp)
    val_loss: float           # mean lm loss over the validation set at the end
    unigram_entropy: float    # corpus unigram entropy (nats/token): the no-context baseline
    tokens_per_s: float       # training tokens per second over this process's steps
    checkpoint: str           # the final checkpoint directory
    metrics_path: str


def seed_everything(seed: int) -> None:
    """Seed every global RNG; call before building the model so its init is reproducible."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batch_generator(seed: int, step: int, stream: int = _TRAIN_STREAM) -> torch.Generator:
    """A generator seeded from (seed, stream, step) through SeedSequence (well-mixed seeds)."""
    state = np.random.SeedSequence([seed, stream, step]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list, precision: Any, groups: Any = None,
             weights: list | None = None) -> float:
    """Mean language-model loss (no aux loss) over ``batches``, each weighted by ``weights``
    (default: equally), in eval mode; 0.0 when every weight is 0. Every rank of a DP replica
    runs the same batches (expert-parallel collectives need all ranks in each forward); CP
    ranks take their shard, pipeline ranks run the forward-only schedule."""
    was_training = model.training
    # Eval mode on every module (a pipeline rank's chunks too: ModuleList.eval recurses): no
    # router jitter, no token counting for the expert-bias update, the dynamic MoE path.
    model.eval()
    try:
        loss = _eval_loss(model, batches, precision, groups, weights)
    finally:  # also when a batch fails: the caller's next step must not train in eval mode
        model.train(was_training)
    precision.end_step(model, groups, train=False)  # what the evaluation saw steers nothing
    return loss


def _eval_loss(model: torch.nn.Module, batches: list, precision: Any, groups: Any,
               weights: list | None) -> float:
    weights = [1] * len(batches) if weights is None else list(weights)
    device_type = batches[0][0].device.type  # autocast where the data (and model) live
    chunks = D.pipeline_chunks(model)
    if chunks is not None:
        from moeplug.parallel.schedules import forward_backward_pipeline
        # Whole sequences: the schedule takes each rank's CP shard itself. It averages its
        # micro-batches equally: all but the last (which may be shorter, or idle) go together.
        losses = []
        for part in ([batches[:-1]] if len(batches) > 1 else []) + [batches[-1:]]:
            res = forward_backward_pipeline(chunks, part, groups, forward_only=True,
                                            autocast=lambda: precision.autocast(device_type))
            losses += [float(res.lm_loss)] * len(part)
    else:
        losses = []
        for batch in batches:  # (tokens, targets[, document positions])
            with precision.autocast(device_type):
                losses.append(float(model(*D.local_sequence(batch, groups)).lm_loss))
    total = sum(weights)
    return sum(v * w for v, w in zip(losses, weights)) / total if total else 0.0


def evaluate_set(model: torch.nn.Module, val: EvalBatches, precision: Any,
                 groups: Any = None) -> float:
    """Mean lm loss over the validation set, every target counted once: each DP rank
    evaluates its share (moeplug.data.loader.eval_batches); the token-weighted sums are added
    over DP (sync point)."""
    loss = evaluate(model, val.batches, precision, groups, val.weights)
    if groups is None or groups.size("dp") == 1:
        return loss
    sums = torch.tensor([loss * sum(val.weights), float(sum(val.weights))], dtype=torch.float64)
    torch.distributed.all_reduce(sums, group=groups.dp)
    return float(sums[0] / sums[1])


def step_batches(ids: Any, tc: Any, step: int, groups: Any = None,
                 first: int | None = None) -> list:
    """This rank's micro-batches of optimizer step ``step``: its share of the step's global
    batch, the next DP * A * B samples of the stream (moeplug.data.loader; ``ids``: a corpus'
    sample stream, or a token array read as one document); DP rank r trains on micro-batches
    r*A .. (r+1)*A - 1 (moeplug.training.distributed explains why)."""
    return sample_batches(ids, tc, step, groups, first)


@dataclass(frozen=True)
class StepStats:
    """One optimizer step, the same on every rank: losses averaged over the step's micro-batches
    and DP ranks (loss = lm_loss + aux_loss + mtp_loss; mtp_loss None without MTP layers), the
    global grad norm (before clipping), per-layer expert counts; ``moe``: the per-layer load
    statistics and router losses (moeplug.observability.moe_metrics)."""

    loss: float
    lm_loss: float
    aux_loss: float
    mtp_loss: float | None
    grad_norm: float
    expert_counts: list
    moe: dict | None = None
    stash: dict | None = None  # paged stash pool stats (runtime.stash), else None
    sync_free: dict | None = None  # over-budget steps and reruns (runtime.sync_free), else None
    finite: bool = True  # False: loss or grad norm NaN/Inf, the optimizer step was not taken

    def losses(self) -> dict[str, float]:
        """The loss terms of this step's ``train`` record in metrics.jsonl."""
        terms = {"loss": self.loss, "lm_loss": self.lm_loss, "aux_loss": self.aux_loss}
        if self.mtp_loss is not None:  # every term of the loss is logged
            terms["mtp_loss"] = self.mtp_loss
        return terms


def _forward_backward(model, chunks, micro_batches, num_micro, device_type, precision,
                      groups) -> tuple[list, list, Any]:
    """Forward + backward of this rank's micro-batches: (loss sums, counts, routing); the sums
    are loss, lm_loss, aux_loss and, only for a model with MTP layers, mtp_loss."""
    if num_micro == 1:  # one backward: autograd's .grad is the step's grad
        return _micro_batches(model, chunks, micro_batches, num_micro, device_type, precision,
                              groups, None)
    with Fp32GradAccumulation(model) as accumulate:
        return _micro_batches(model, chunks, micro_batches, num_micro, device_type, precision,
                              groups, accumulate)


def _micro_batches(model, chunks, micro_batches, num_micro, device_type, precision, groups,
                   accumulate) -> tuple[list, list, Any]:
    routing = None  # per-layer counts and router losses of this rank's micro-batches
    if chunks is not None:
        from moeplug.parallel.schedules import forward_backward_pipeline
        # The schedule accumulates grads of sum_m (lm_m + aux_m) / M over its micro-batches;
        # it takes whole sequences and CP-shards them itself (sharding here too would train
        # on a shard of the shard).
        res = forward_backward_pipeline(
            chunks, micro_batches, groups, autocast=lambda: precision.autocast(device_type),
            grad_accumulation=accumulate)
        has_mtp = res.mtp_loss is not None
        sums = [float(res.loss), float(res.lm_loss), float(res.aux_loss),
                float(0.0 if res.mtp_loss is None else res.mtp_loss)]
        counts_per_layer = [c.detach().cpu() for c in res.expert_counts]
    else:
        sums, has_mtp = [0.0, 0.0, 0.0, 0.0], False
        # What each micro-batch reports. On a GPU it stays on the device until every backward
        # is queued: reading it after each forward would make the host wait for the device
        # there, and launch the backward only once the device had run dry. On the CPU it is
        # read at once (nothing to wait for), which frees the MoE layers' arena buffers that
        # the router's loss values live in before the next micro-batch needs them.
        reports: dict[int, tuple] = {}

        def report(m: int) -> None:  # micro-batch m's figures into the step's, on the host
            nonlocal routing, has_mtp
            has_mtp, losses, counts, router_losses = reports.pop(m)
            for i, v in enumerate(losses):
                sums[i] += float(v) / num_micro
            routing = add_micro_batch(routing, counts, router_losses)  # counts summed there

        def forward(m: int) -> Any:
            # This CP rank's shard of tokens, targets (and document positions).
            batch = D.local_sequence(micro_batches[m], groups)
            with precision.autocast(device_type):  # the precision plugin picks the dtype
                out = model(*batch)
            mtp = out.lm_loss.new_zeros(()) if out.mtp_loss is None else out.mtp_loss
            reports[m] = (out.mtp_loss is not None,
                          [v.detach() for v in (out.loss, out.lm_loss, out.aux_loss, mtp)],
                          [c.detach() for c in out.expert_counts], out.router_losses)
            if device_type == "cpu":
                report(m)
            return out.loss

        def backward(m: int, loss: torch.Tensor) -> None:
            # Grad accumulation: divide so the summed grads equal the micro-batch mean.
            with stage("backward"):
                (loss / num_micro).backward()
                # delay_wgrad_compute: every MoE layer flushed its queue at its input; this
                # runs what a graph whose input needs no grad left (normally nothing).
                delayed_wgrad.run_pending()
                if accumulate is not None:
                    accumulate.add(last=m == num_micro - 1)

        if groups is not None and groups.twins is not None:
            # Combined 1F1B: B_{m-1} on a helper thread overlaps F_m (same grads, bitwise).
            from moeplug.parallel.ep_overlap import combined_1f1b
            combined_1f1b(forward, backward, num_micro, groups.twins)
        else:
            for m in range(num_micro):
                backward(m, forward(m))
        for m in sorted(reports):  # a GPU's, in micro-batch order (the same sums)
            report(m)
        counts_per_layer = list(routing.counts)  # int64 on the host, summed over micro-batches
    return (sums if has_mtp else sums[:3]), counts_per_layer, routing


def stash_runtime(model: torch.nn.Module) -> Any:
    """The moeplug.runtime.stash.ModelRuntime ``model`` was built with (build_model sets it): a
    MoETransformer's, or every pipeline chunk's, whether or not this rank's stages hold a MoE
    layer (the stash and sync-free steps all-reduce their flags, so every rank must take the
    same path). None for a model built otherwise."""
    from moeplug.runtime.stash import ModelRuntime
    for m in D.pipeline_chunks(model) or [model]:
        if isinstance(getattr(m, "runtime", None), ModelRuntime):
            return m.runtime
    return None


def _stashed_step(model, rt, forward_backward, groups, discard: Callable[[], None]) -> tuple:
    """Forward + backward with the paged stash; on an overflow on any rank, applies
    ``runtime.stash_overflow``: rerun once without the stash from the same RNG and buffer
    state (Megatron's paged-stash runner), fail, or keep (pack kept the tensors: exact)."""
    policy = rt.cfg.stash_overflow
    before = rt.stats()["overflows"] if rt.stats() else 0
    pages_before = rt.overflow_pages
    rng = torch.get_rng_state()
    buffers = ({k: b.detach().clone() for k, b in model.named_buffers()}
               if policy == "rerun" else None)
    result = forward_backward()
    stats = rt.stats() or {}
    overflows = stats.get("overflows", 0) - before
    missing = rt.overflow_pages - pages_before  # pages the kept tensors would have taken
    high_water, in_use = stats.get("high_water", 0), stats.get("pages_in_use", 0)
    # Sync point: every rank must take the same branch (a rerun runs collectives). The figures
    # recorded are the world's largest (rank 0 writes them; under PP it may hold no MoE layer).
    if groups is not None:
        t = torch.tensor([overflows, missing, high_water, in_use], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        overflows, missing, high_water, in_use = (int(v) for v in t)
    reruns = 0
    if overflows and policy == "fail":
        raise StashOverflowError(
            f"runtime.stash_overflow = 'fail': the stash pool ({rt.pool.num_pages} pages of "
            f"{rt.pool.page_bytes} bytes) overflowed {overflows} time(s) this step. Fix: set "
            f"runtime.stash_pages to at least {rt.pool.num_pages + missing}, or "
            f"runtime.stash_overflow: rerun")
    if overflows and policy == "rerun":
        discard()
        torch.set_rng_state(rng)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        with rt.stash_disabled():
            result = forward_backward()
        reruns = 1
    record = {"pages_in_use": in_use, "high_water": high_water, "overflows": overflows,
              "reruns": reruns, "pages_needed": rt.pool.num_pages + missing, "grown_to": None}
    if overflows and not rt.cfg.stash_pages:
        # The automatic size counts what the grouped experts save for one micro-batch at
        # average routing; other backends, recipes and EP's uneven receives save more. Like the
        # shared-memory heap, an automatic pool grows to what the step needed, once.
        rt.grow(record["pages_needed"])
        record["grown_to"] = record["pages_needed"]
    return (*result, record)


def _sync_free_step(model, state, step_body, groups, discard: Callable[[], None]) -> tuple:
    """``step_body`` with the MoE layers on their static, sync-free path; a step over any
    layer's token budget (a device flag, read here where the step syncs anyway) is rerun once on
    the dynamic path from the same RNG and buffer state, so no token is ever lost."""
    rng = torch.get_rng_state()
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    state.take_overflow()  # a flag left by an evaluation or an aborted step is not this step's
    state.take_demand()
    result = step_body()
    flag, demand = state.take_overflow(), state.take_demand()
    over = torch.zeros((), dtype=torch.int64) if flag is None else flag.to(torch.int64).cpu()
    # Sync point (already one: the step's losses were just read on the host). Every rank takes
    # the same branch, because a rerun runs collectives.
    if groups is not None:
        over = over.reshape(1)
        torch.distributed.all_reduce(over, op=torch.distributed.ReduceOp.MAX)
    overflows = int(over.max())
    stats = {"overflows": overflows, "reruns": overflows}
    if overflows:
        # The budget that would have fit this step (Megatron's paged-stash runner logs the
        # capacity factor likewise): the smallest multiple of 0.01 above every rank's demand.
        need = (torch.zeros(1, dtype=torch.float64) if demand is None else
                demand.reshape(1).cpu())
        if groups is not None:
            torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX)
        stats["budget_needed"] = round((math.floor(float(need[0]) * 100 + 1e-9) + 1) / 100, 2)
        discard()
        torch.set_rng_state(rng)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        with state.disabled():
            result = step_body()
    return (*result, stats)


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` together: torch's ``get_total_norm``, which for bf16 grads
    (bf16 parameters) would return a bf16 norm (3 significant digits, for the log and the clip
    factor alike); those are summed in fp32, as Megatron takes the norm of its fp32 main grads."""
    if all(g.dtype == torch.float32 for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2,
                                                                    dtype=torch.float32)))


def train_step(model: torch.nn.Module, optimizer: Any, micro_batches: list, tc: Any,
               precision: Any, groups: Any = None) -> StepStats:
    """Forward + backward of this rank's micro-batches, gradient sync, clip, optimizer step.

    ``model``: a MoETransformer, or a pipeline rank's ``nn.ModuleList`` of chunks. ``groups``:
    a ParallelGroups (None = one process). ``optimizer``: AdamW, or a DistributedAdamW.
    ``micro_batches``: (tokens_BS, targets_BS) of whole sequences, or with packed documents
    (tokens_BS, targets_BS, positions_BS) (moeplug.data.documents.with_positions).
    """
    num_micro = len(micro_batches)
    device_type = micro_batches[0][0].device.type  # autocast where the data (and model) live
    chunks = D.pipeline_chunks(model)
    # Train mode on every module, whoever called (train(), the library API, a test) and
    # whatever ran before (an evaluation, generation): router jitter and token counting are
    # training-only, and a step in eval mode would train another model than it logs.
    model.train()

    def forward_backward() -> tuple[list, list, Any]:
        optimizer.zero_grad(set_to_none=True)
        return _forward_backward(model, chunks, micro_batches, num_micro, device_type,
                                 precision, groups)

    rt = stash_runtime(model)

    def discard() -> None:
        # A pass about to be rerun must not steer the recipe: what it recorded (fp8_delayed:
        # amaxes of other rows and gradients than the rerun's) is dropped, as after evaluation.
        precision.end_step(model, groups, train=False)

    def step_body() -> tuple:  # forward + backward, with the paged stash when it is on
        if rt is None or not rt.stash_active:
            return (*forward_backward(), None)
        return _stashed_step(model, rt, forward_backward, groups, discard)

    if rt is not None and rt.sync_free.active:  # runtime.sync_free: rerun when over budget
        sums, counts_per_layer, routing, stash, sync_free = _sync_free_step(
            model, rt.sync_free, step_body, groups, discard)
    else:
        (sums, counts_per_layer, routing, stash), sync_free = step_body(), None
    # The recipe's per-step state (fp8_delayed: the step's amaxes, reduced over the stage,
    # into the histories), once per step whatever reran: on every rank, also a skipped step.
    with stage("comm_wait"):
        precision.end_step(model, groups)
    # Clipping: rescale all grads together so their global L2 norm is <= grad_clip
    # (0 disables it; the norm is still computed for logging).
    if groups is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        with stage("optimizer"):
            # clip_grad_norm_'s two halves: with a NaN/Inf norm it would scale every grad to
            # NaN, and faults.NonFiniteWatch could no longer tell where the NaN began.
            norm = total_grad_norm([p.grad for p in params if p.grad is not None])
            grad_norm = float(norm)
            if tc.grad_clip and math.isfinite(grad_norm):
                torch.nn.utils.clip_grads_with_norm_(params, tc.grad_clip, norm)
    elif hasattr(optimizer, "reduce_gradients"):  # ZeRO-1: reduce-scatter into owned slices
        with stage("comm_wait"):
            optimizer.reduce_gradients()
        with stage("optimizer"):
            grad_norm = float(optimizer.clip_grad_norm(tc.grad_clip))
    else:  # sync point: grads averaged over DP x CP (experts: summed over expert-DP, / DP x CP);
        # with parallel.fsdp, FSDP's backward already reduce-scattered the ones it shards
        from moeplug.parallel.grad_sync import clip_grad_norm, sync_gradients
        with stage("comm_wait"):
            sync_gradients(model, groups)
        with stage("optimizer"):
            grad_norm = float(clip_grad_norm(model, groups, tc.grad_clip))
    # The DP ranks' losses averaged (TP/CP/PP ranks already agree): with the global grad norm,
    # values every rank shares, so all ranks take the same update-or-skip decision.
    with stage("comm_wait"):
        sums = D.mean_over_dp(sums, groups)
    finite = is_finite(sums[0], grad_norm)
    if finite:  # a NaN/Inf update would poison every weight; the caller skips or stops
        with stage("optimizer"):
            optimizer.step()
    # Per-step router state (expert-bias update, global aux counts) over every rank of a stage;
    # also on a skipped step, which must reset the step's counts.
    group = None if groups is None else groups.tp_dp_cp
    for m in (chunks or [model]):
        m.finalize_step(group)
    with stage("comm_wait"):  # logging only: counts summed
        expert_counts = D.global_expert_counts(  # in layer order, whatever the pipeline split
            counts_per_layer, groups, D.moe_layer_order(chunks) if chunks else None)
    moe = moe_metrics(routing, counts=expert_counts)
    with stage("comm_wait"):
        # Router losses and dropped fractions: averaged over the stage's ranks; counts: summed.
        moe = D.mean_router_metrics(moe, groups)
    # sums: loss, lm_loss, aux_loss and, with MTP layers only, mtp_loss
    return StepStats(*sums[:3], sums[3] if len(sums) > 3 else None, grad_norm=grad_norm,
                     expert_counts=expert_counts, moe=moe, stash=stash, finite=finite,
                     sync_free=sync_free)


def _precision_state(precision: Any, model: Any, groups: Any) -> Any:
    """The precision recipe's step-to-step state (delayed scaling's amax histories) for a
    checkpoint: this process's, or every rank's in rank order. Collective over all ranks when
    ``groups`` is given."""
    state = precision.state_dict(model, groups)
    if groups is None:
        return state
    import torch.distributed as dist
    states = [None] * groups.world_size
    dist.all_gather_object(states, state)
    return None if all(s is None for s in states) else {"ranks": states}


def _restore_precision_state(precision: Any, model: Any, meta: dict, groups: Any,
                             layout: dict | None) -> None:
    """Each rank its own rank's state on the layout that saved it; on another layout (one
    process <-> several included) every saved rank's, for the recipe to take what this rank
    now holds (Precision.load_state_dict)."""
    state = meta.get("precision_state")
    if state is None:
        return
    saved = state["ranks"] if isinstance(state, dict) and "ranks" in state else [state]
    same = (groups is None and len(saved) == 1) or (
        groups is not None and meta.get("parallel") == layout and len(saved) == groups.world_size)
    for s in ([saved[0 if groups is None else groups.rank]] if same else saved):
        if s is not None:
            precision.load_state_dict(s, model, groups)


def build_rank_optimizer(model: torch.nn.Module, cfg: RootConfig, groups: Any = None) -> Any:
    """AdamW, or the ZeRO-1 DistributedAdamW when ``parallel.distributed_optimizer`` is on and
    the run is parallel, or AdamW on FSDP's shards with ``parallel.fsdp``."""
    if groups is not None and cfg.parallel.distributed_optimizer:
        from moeplug.training.dist_optim import DistributedAdamW
        return DistributedAdamW(model, cfg.train, groups)
    if groups is not None and cfg.parallel.fsdp:  # AdamW on FSDP's shards, whole state dicts
        from moeplug.training.fsdp_optim import build_fsdp_optimizer
        return build_fsdp_optimizer(model, cfg.train)
    return build_optimizer(model, cfg.train)


def train(cfg: RootConfig, model: torch.nn.Module, corpus: Any, precision: Any,
          plugin_names: dict[str, str], log: Callable[[str], None] = print,
          use_bar: bool | None = None, groups: Any = None, batches: Any = None,
          val_batches: list | None = None, tokenizer: Any = None) -> TrainSummary:
    """Train ``model`` (this rank's model or pipeline chunks, from
    moeplug.training.distributed.build_rank_model) for ``cfg.train.steps``. ``groups``: the
    ParallelGroups of a multi-process run (None: one process). Only rank 0 logs, writes
    metrics and the run-level checkpoint files.

    Data: the ``corpus``'s sample stream (moeplug.data.loader), or — library use
    (moeplug.library), one process, ``corpus`` None — ``batches``, an iterator of
    (tokens_BS, targets_BS) micro-batches (``train.grad_accum_steps`` per step), ``val_batches`` (a list; empty: no
    evaluation) and the ``tokenizer`` they were made with (None: unknown), which checkpoints
    record."""
    tc = cfg.train
    if corpus is not None:
        tokenizer = corpus.tokenizer
    batches = None if batches is None else iter(batches)
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    main_rank = D.is_main_rank(groups)
    # Packed documents: the EOD id their positions restart after (None: masking off). A
    # tokenizer without EOS is refused here too (the CLI refuses it before any rank starts).
    eod = document_eod(cfg, tokenizer)
    if not main_rank:
        log, use_bar = (lambda _msg: None), False
    host_allocator = "default (train.retain_freed_memory: false)"
    if tc.retain_freed_memory:
        from moeplug.runtime import retain_freed_memory
        why_not = retain_freed_memory()
        host_allocator = "freed memory retained" if not why_not else f"default ({why_not})"
        if why_not:
            log(f"train.retain_freed_memory: not applied ({why_not}); freed memory goes back "
                f"to the system as usual")
    optimizer = build_rank_optimizer(model, cfg, groups)
    num_params = sum(p.numel() for p in model.parameters())

    start_step, metrics_state = 0, {"tokens_seen": 0, "train_seconds": 0.0}
    hf_origin = None  # the Hugging Face import this run continues, if any
    consumed = 0  # samples of the stream the run has trained on (the loader's position)
    resume_from = resolve_resume(tc.resume, tc.out_dir)
    if resume_from:
        meta = (load_checkpoint(resume_from, model, optimizer) if groups is None else
                load_sharded_checkpoint(resume_from, model, optimizer, groups,
                                        D.layout_manifest(cfg, groups)))
        start_step, metrics_state = meta["step"], meta.get("metrics") or metrics_state
        hf_origin = meta.get("hf") or meta.get(HF_ORIGIN)  # carried on (convert export)
        if corpus is not None:  # (the caller's batches: the caller's position)
            consumed = resume_position(meta.get("data"), corpus, cfg, resume_from)
        _restore_precision_state(precision, model, meta, groups,
                                 None if groups is None else D.layout_manifest(cfg, groups))
        if start_step >= tc.steps:
            raise nothing_to_train(resume_from, start_step, tc.steps)
        log(f"resumed from {resume_from} at step {start_step}")

    dp = 1 if groups is None else groups.size("dp")
    world = 1 if groups is None else groups.world_size
    tokens_per_step = dp * tc.micro_batch_size * tc.seq_len * tc.grad_accum_steps  # all ranks
    # the embedding's rows: the tokenizer's vocabulary as the model pads it
    vocab_size = (cfg.model_vocab_size(corpus.vocab_size) if corpus is not None
                  else model.vocab_size)
    flops_per_token = float(model_flops_per_token(cfg.model, vocab_size, tc.seq_len))
    device = D.model_device(model)  # the CLI put it on train.device; batches follow it
    compute_dtype = torch.float32 if precision is None else precision.compute_dtype
    peak_1 = measure_peak_tflops(compute_dtype, device)
    peak = world * peak_1
    slow_bf16 = slow_bf16_note(peak_1, device) if compute_dtype == torch.bfloat16 else None
    if corpus is not None:
        data = Batches(corpus.train_samples(tc.seq_len, tc.seed), tc.micro_batch_size,
                       tc.grad_accum_steps)
        val = eval_batches(corpus.val_samples(tc.seq_len, tc.seed), tc.micro_batch_size,
                           tc.eval_batches, groups)
        val = EvalBatches(with_positions(D.to_device(val.batches, device), eod), val.weights,
                          val.total_tokens)
        data_order = loader_state(corpus, cfg)  # what the order depends on, for the checkpoints
    else:  # library use: the caller's batches, each validation batch weighted by its targets
        data, data_order = None, None
        given = with_positions(D.to_device(list(val_batches or []), device), eod)
        weights = [int(b[1].numel()) for b in given]
        val = EvalBatches(given, weights, sum(weights))

    def draw(step: int) -> list:  # this rank's micro-batches of optimizer step ``step``
        if batches is None:
            return data.step(consumed, groups, step)
        drawn = list(itertools.islice(batches, tc.grad_accum_steps))
        if len(drawn) < tc.grad_accum_steps:
            raise ConfigError(f"TrainConfig.steps = {tc.steps}: the batches given ran out at "
                              f"step {step + 1} ({tc.grad_accum_steps} micro-batch(es) a step, "
                              f"train.grad_accum_steps). Fix: give more batches, or fewer steps")
        return drawn
    metrics_path = os.path.join(tc.out_dir, "metrics.jsonl")
    # Append, never truncate: the CLI refuses a used run directory unless told to resume it
    # (the records continue) or to overwrite it (it clears the old run first).
    writer = MetricsWriter(metrics_path, append=True) if main_rank else None
    mirrors = []  # TensorBoard, W&B: what each gets is what metrics.jsonl gets
    if main_rank and tc.tensorboard:
        from moeplug.observability.tensorboard import TensorBoardWriter
        mirrors.append(TensorBoardWriter(tc.out_dir, start_step))
    if main_rank and tc.wandb:
        from moeplug.observability.wandb_writer import WandbWriter
        mirrors.append(WandbWriter(tc.out_dir, tc, cfg.to_dict(), start_step, resume_from))
    # Wall-clock stage times are only meaningful where ops finish before they return (CPU).
    timed = tc.time_breakdown and all(p.device.type == "cpu" for p in model.parameters())

    def write(record: dict) -> None:
        if writer is not None:
            writer.write(record)
        for mirror in mirrors:
            mirror.write(record)

    layout = None if groups is None else D.layout_manifest(cfg, groups)
    runtime = stash_runtime(model)  # what the model registered with the runtime at build
    offloader = getattr(runtime, "offloader", None)  # model.offload's (None: nothing offloaded)
    write({"kind": "run", "start_step": start_step, "resumed_from": resume_from,
           "plugins": plugin_names, "peak_tflops": peak, "flops_per_token": flops_per_token,
           "num_params": num_params, "parallel": layout, "config": cfg.to_dict(),
           "device": str(device), "runtime": None if runtime is None else runtime.record(),
           "host_allocator": host_allocator})
    log(f"{num_params / 1e6:.2f}M parameters{' on rank 0' if groups else ''}, "
        f"{tokens_per_step} tokens/step on {device}, measured GEMM peak {peak:.3f} TFLOP/s"
        f"{f' over {world} ranks' if groups else ''}; plugins {plugin_names}")
    if slow_bf16:
        log(f"warning: {slow_bf16}")
    if tc.effective_warmup_steps < tc.warmup_steps:
        log(f"note: train.warmup_steps = {tc.warmup_steps} exceeds train.steps = {tc.steps}; "
            f"warming up over all {tc.steps} steps")
    progress = Progress(tc.steps, start_step, log, use_bar)

    def checkpoint(step: int) -> str:
        meta = {"config": cfg.to_dict(), "plugins": plugin_names, "metrics": metrics_state,
                "scheduler": {"step": step, "lr": lr_at(step, tc)},
                "model_vocab_size": vocab_size}  # the embedding's rows (a resume keeps them)
        if data_order is not None:  # the next batch's start, and what the order depends on
            meta["data"] = {**data_order, "consumed_samples": consumed}
        if tokenizer is not None:  # generate and a resume check it (moeplug.training.resume)
            meta["tokenizer"] = tokenizer.fingerprint()
        files = tokenizer.hf_files() if tokenizer is not None else None
        state = _precision_state(precision, model, groups)
        if state is not None:
            meta["precision_state"] = state
        if hf_origin:
            meta[HF_ORIGIN] = hf_origin
        try:
            if groups is None:
                return save_checkpoint(tc.out_dir, step, model, optimizer, meta, tc.keep_last,
                                       tokenizer_files=files)
            return save_sharded_checkpoint(tc.out_dir, step, model, optimizer, meta, groups,
                                           layout, tc.keep_last, tokenizer_files=files)
        except Exception as e:  # OSError, safetensors' SafetensorError: a full or unwritable disk
            if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
                raise
            from moeplug.training.checkpoint import resolve_resume
            try:
                last = resolve_resume("auto", tc.out_dir)
            except Exception:  # noqa: BLE001 - only for the message
                last = None
            raise TrainingFault(
                f"could not write the step-{step} checkpoint in train.out_dir = {tc.out_dir!r} "
                f"({type(e).__name__}: {e}); the run stopped there, its last complete "
                f"checkpoint is {last or 'none'}. Fix: free space in (or make writable) "
                f"{tc.out_dir!r}, then run again with --resume auto") from e

    model.train()
    loss_step = float("nan")
    val_loss, ckpt_path = float("nan"), ""
    window_tokens, window_seconds, run_tokens, run_seconds = 0, 0.0, 0, 0.0
    window_times: dict = {}  # per-stage seconds summed over the logging window
    # Non-finite steps: skipped in a row / in this run (moeplug.training.faults).
    skipped = skipped_total = 0
    sync_free_reruns = None  # over-budget steps rerun this run (runtime.sync_free)
    stash_reruns = 0  # steps rerun without the stash this run (runtime.stash_overflow: rerun)
    test_fault = TestFault.from_env()
    if test_fault is not None:  # first: its NaN counts as the block's own output
        test_fault.install(model)
    watch = NonFiniteWatch(model)
    rank = 0 if groups is None else groups.rank
    heartbeat = D.heartbeat(groups)

    def validate(done: int) -> float:
        loss = evaluate_set(model, val, precision, groups)
        write({"kind": "val", "step": done, "val_loss": loss, "val_tokens": val.total_tokens})
        progress.message(f"step {done:>6} | val loss {loss:.4f} ({val.total_tokens:,} tokens)")
        return loss

    try:
        if start_step == 0 and val.batches:  # the starting point: an import is scored first
            val_loss = validate(0)
        for step in range(start_step, tc.steps):
            t0 = time.perf_counter()
            # LR is set per step from the pure schedule, so resume needs no scheduler object.
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_data = with_positions(  # + document positions, once per micro-batch
                D.to_device(draw(step), device), eod)
            if data is not None:
                consumed += data.global_batch(groups)
            done = step + 1
            watch.reset()
            if test_fault is not None:
                test_fault.before_step(done, rank)
            if heartbeat is not None:  # progress for naming a rank that fails (faults.py)
                heartbeat.beat(2 * done - 1)
            # The saved-tensor meter costs ~17% of a default-model step: only on request.
            meter = ActivationMeter(model) if tc.memory_stats else None
            reset_process_peak(device)
            with measure_stages(timed) as times, (meter.active() if meter is not None
                                                  else contextlib.nullcontext()):
                stats = train_step(model, optimizer, step_data, tc, precision, groups)
            window_times = add_times(window_times, times)
            # This step's activation offloading (model.offload), read every step so each
            # record holds its own step's figures whatever train.log_interval is.
            offload = offloader.step_stats() if offloader is not None else None
            sums = stats.losses()
            grad_norm, counts_per_layer = stats.grad_norm, stats.expert_counts
            loss_step = sums["loss"]
            if heartbeat is not None:
                heartbeat.beat(2 * done)
            if not stats.finite:  # every rank got the same verdict (see train_step)
                skipped, where = skipped + 1, D.first_located(watch.locate(), groups)
                line = nonfinite_message(done, loss_step, grad_norm, where)
                if tc.nonfinite == "stop" or skipped > tc.max_skipped_steps:
                    why = ("train.nonfinite = stop" if tc.nonfinite == "stop" else
                           f"{skipped} steps in a row, train.max_skipped_steps = "
                           f"{tc.max_skipped_steps}")
                    raise TrainingFault(
                        f"{line}; stopped ({why}). Fix: lower train.lr (now {tc.lr}), raise "
                        f"train.warmup_steps (now {tc.warmup_steps}) or lower train.grad_clip")
                skipped_total += 1
                write({"kind": "skip", "step": done, "loss": loss_step, "grad_norm": grad_norm,
                       "where": where, "skipped_steps": skipped_total})
                progress.message(f"{line}; update skipped ({skipped_total} so far)")
            else:
                skipped = 0
            if stats.stash is not None and stats.stash["overflows"]:
                st = stats.stash
                stash_reruns += st["reruns"]  # each one ran the step's forward and backward twice
                write({"kind": "stash_overflow", "step": done, "overflows": st["overflows"],
                       "pages_needed": st["pages_needed"], "grown_to": st["grown_to"],
                       "reruns": stash_reruns})
                what = ("reran it without the stash" if st["reruns"] else
                        "kept those in torch memory")
                then = (f"the pool (runtime.stash_pages: 0, sized from the model) grew to "
                        f"{st['grown_to']} pages for the next steps" if st["grown_to"] else
                        f"Fix: --set runtime.stash_pages={st['pages_needed']}")
                progress.message(f"step {done}: the stash pool overflowed ({st['overflows']} "
                                 f"tensors did not fit); {what} ({stash_reruns} rerun(s) so "
                                 f"far); {then}")
            if stats.sync_free is not None:
                sync_free_reruns = (sync_free_reruns or 0) + stats.sync_free["reruns"]
                if stats.sync_free["reruns"]:
                    need = stats.sync_free["budget_needed"]
                    write({"kind": "sync_free_rerun", "step": done,
                           "token_budget": cfg.runtime.token_budget, "budget_needed": need,
                           "reruns": sync_free_reruns})
                    progress.message(f"step {done}: over runtime.token_budget "
                                     f"({cfg.runtime.token_budget}) on some MoE layer; reran "
                                     f"on the dynamic path ({sync_free_reruns} so far); this "
                                     f"step needed token_budget {need}")
            dt = time.perf_counter() - t0  # train time only: eval and checkpoints excluded
            window_tokens, window_seconds = window_tokens + tokens_per_step, window_seconds + dt
            run_tokens, run_seconds = run_tokens + tokens_per_step, run_seconds + dt
            metrics_state = {"tokens_seen": metrics_state["tokens_seen"] + tokens_per_step,
                             "train_seconds": metrics_state["train_seconds"] + dt}

            record = None
            if done % tc.log_interval == 0 or done == tc.steps:
                tflops = achieved_tflops(flops_per_token, window_tokens, window_seconds)
                if mfu(tflops, peak) > 1.0:  # the start-up GEMM ran beside other work
                    peak_1 = max(peak_1, measure_peak_tflops(compute_dtype, device))
                    peak = world * peak_1
                record = {"kind": "train", "step": done, **sums, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": window_tokens / window_seconds, "tflops": tflops,
                          "mfu": mfu(tflops, peak), "expert_load": expert_load(counts_per_layer),
                          "plugins": plugin_names, "moe": stats.moe,
                          "skipped_steps": skipped_total}
                if stats.stash is not None:  # this step's pool stats (moeplug.runtime.stash)
                    record["stash"] = stats.stash
                if offload is not None:  # this step's offloading (moeplug.modules.offload)
                    record["offload"] = offload
                if sync_free_reruns is not None:  # over-budget reruns so far (sync_free)
                    record["sync_free"] = {"reruns": sync_free_reruns}
                # This step's, every rank's (one small all-gather).
                record["memory"] = gather_ranks(memory_record(model, optimizer, meter, device))
                if window_times:  # mean seconds per step over the window
                    n = window_tokens // tokens_per_step
                    record["time_breakdown"] = {k: v / n for k, v in window_times.items()}
                write(record)
                window_tokens, window_seconds, window_times = 0, 0.0, {}
            progress.step(record)

            if val.batches and ((tc.eval_interval and done % tc.eval_interval == 0)
                                or done == tc.steps):
                val_loss = validate(done)
            if (tc.ckpt_interval and done % tc.ckpt_interval == 0) or done == tc.steps:
                ckpt_path = checkpoint(done)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
        for mirror in mirrors:
            mirror.close()
    return TrainSummary(steps=tc.steps, final_train_loss=loss_step, val_loss=val_loss,
                        unigram_entropy=(float(corpus.unigram_entropy()) if corpus is not None
                                         else float("nan")),
                        tokens_per_s=run_tokens / run_seconds if run_seconds else 0.0,
                        checkpoint=ckpt_path, metrics_path=metrics_path)
