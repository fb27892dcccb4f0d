"""The training loop: one function, top to bottom, over pieces built elsewhere.

Shape-suffix legend: B micro-batch size, S sequence length, E experts.

Reproducibility contract: the model is initialised after :func:`seed_everything`; the batch of
step ``s`` (all its micro-batches) comes from a generator seeded by ``(seed, s)``; validation uses
fixed batches from ``(seed, "val")``; the LR is a pure function of the step. Model, optimizer and
RNG states go into checkpoints, so a resumed run takes exactly the steps an uninterrupted one
would.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from moeplug.config import RootConfig
from moeplug.data import get_batch
from moeplug.observability import add_micro_batch, moe_metrics
from moeplug.training.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from moeplug.training.flops import achieved_tflops, measure_peak_tflops, mfu
from moeplug.training.metrics import MetricsWriter, Progress, expert_load
from moeplug.training.optim import build_optimizer, lr_at

_TRAIN_STREAM, _VAL_STREAM = 0, 1


@dataclass(frozen=True)
class TrainSummary:
    steps: int                # completed optimizer steps
    final_train_loss: float   # mean loss of the last step's micro-batches (lm + aux)
    val_loss: float           # mean lm loss over the fixed validation batches at the end
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
def evaluate(model: torch.nn.Module, batches: list, precision: Any) -> float:
    """Mean language-model loss (no aux loss) over fixed batches, in eval mode."""
    was_training = model.training
    model.eval()
    losses = []
    for tokens_BS, targets_BS in batches:
        with precision.autocast("cpu"):
            losses.append(float(model(tokens_BS, targets_BS).lm_loss))
    model.train(was_training)
    return sum(losses) / len(losses)


def train(cfg: RootConfig, model: torch.nn.Module, corpus: Any, precision: Any,
          plugin_names: dict[str, str], log: Callable[[str], None] = print,
          use_bar: bool | None = None) -> TrainSummary:
    tc = cfg.train
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    optimizer = build_optimizer(model, tc)
    params = [p for g in optimizer.param_groups for p in g["params"]]

    start_step, metrics_state = 0, {"tokens_seen": 0, "train_seconds": 0.0}
    resume_from = resolve_resume(tc.resume, tc.out_dir)
    if resume_from:
        meta = load_checkpoint(resume_from, model, optimizer)
        start_step, metrics_state = meta["step"], meta["metrics"]
        log(f"resumed from {resume_from} at step {start_step}")

    tokens_per_step = tc.micro_batch_size * tc.seq_len * tc.grad_accum_steps
    flops_per_token = float(model.flops_per_token(tc.seq_len))
    peak = measure_peak_tflops(getattr(precision, "compute_dtype", torch.float32))
    gen = batch_generator(tc.seed, 0, _VAL_STREAM)
    val_batches = [get_batch(corpus.val_ids, tc.micro_batch_size, tc.seq_len, gen)
                   for _ in range(tc.eval_batches)]
    writer = MetricsWriter(os.path.join(tc.out_dir, "metrics.jsonl"), append=bool(resume_from))
    writer.write({"kind": "run", "start_step": start_step, "resumed_from": resume_from,
                  "plugins": plugin_names, "peak_tflops": peak, "flops_per_token": flops_per_token,
                  "num_params": sum(p.numel() for p in params), "config": cfg.to_dict()})
    log(f"{sum(p.numel() for p in params) / 1e6:.2f}M parameters, {tokens_per_step} tokens/step, "
        f"measured GEMM peak {peak:.3f} TFLOP/s; plugins {plugin_names}")
    progress = Progress(tc.steps, start_step, log, use_bar)

    def checkpoint(step: int) -> str:
        return save_checkpoint(tc.out_dir, step, model, optimizer, {
            "config": cfg.to_dict(), "plugins": plugin_names, "metrics": metrics_state,
            "scheduler": {"step": step, "lr": lr_at(step, tc)}})

    model.train()
    loss_step = float("nan")
    val_loss, last_val_step, ckpt_path = float("nan"), -1, ""
    window_tokens, window_seconds, run_tokens, run_seconds = 0, 0.0, 0, 0.0
    try:
        for step in range(start_step, tc.steps):
            t0 = time.perf_counter()
            # LR is set per step from the pure schedule, so resume needs no scheduler object.
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            gen = batch_generator(tc.seed, step)
            optimizer.zero_grad(set_to_none=True)
            sums = {"loss": 0.0, "lm_loss": 0.0, "aux_loss": 0.0}
            counts_per_layer: list[torch.Tensor] = []
            routing = None  # per-layer counts and router losses of this step's micro-batches
            for _ in range(tc.grad_accum_steps):
                tokens_BS, targets_BS = get_batch(corpus.train_ids, tc.micro_batch_size,
                                                  tc.seq_len, gen)
                with precision.autocast("cpu"):  # the precision plugin picks the compute dtype
                    out = model(tokens_BS, targets_BS)
                # Grad accumulation: divide so the summed grads equal the micro-batch mean.
                (out.loss / tc.grad_accum_steps).backward()
                for k in sums:
                    sums[k] += float(getattr(out, k).detach()) / tc.grad_accum_steps
                micro_counts = [c.detach().cpu() for c in out.expert_counts]
                counts_per_layer = ([a + b for a, b in zip(counts_per_layer, micro_counts)]
                                    if counts_per_layer else micro_counts)
                routing = add_micro_batch(routing, out.expert_counts, out.router_losses)
            # Clipping: rescale all grads together so their global L2 norm is <= grad_clip
            # (0 disables it; the norm is still computed for logging).
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip or math.inf))
            optimizer.step()
            model.finalize_step()  # per-step router state: expert-bias update, global aux counts
            done, loss_step = step + 1, sums["loss"]
            if not math.isfinite(loss_step):
                raise FloatingPointError(
                    f"loss became {loss_step} at step {done}. Fix: lower train.lr (now {tc.lr}) "
                    f"or raise train.warmup_steps (now {tc.warmup_steps})")
            dt = time.perf_counter() - t0  # train time only: eval and checkpoints excluded
            window_tokens, window_seconds = window_tokens + tokens_per_step, window_seconds + dt
            run_tokens, run_seconds = run_tokens + tokens_per_step, run_seconds + dt
            metrics_state = {"tokens_seen": metrics_state["tokens_seen"] + tokens_per_step,
                             "train_seconds": metrics_state["train_seconds"] + dt}

            record = None
            if done % tc.log_interval == 0 or done == tc.steps:
                tflops = achieved_tflops(flops_per_token, window_tokens, window_seconds)
                record = {"kind": "train", "step": done, **sums, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": window_tokens / window_seconds, "tflops": tflops,
                          "mfu": mfu(tflops, peak), "expert_load": expert_load(counts_per_layer),
                          "plugins": plugin_names, "moe": moe_metrics(routing)}
                writer.write(record)
                window_tokens, window_seconds = 0, 0.0
            progress.step(record)

            if (tc.eval_interval and done % tc.eval_interval == 0) or done == tc.steps:
                val_loss, last_val_step = evaluate(model, val_batches, precision), done
                writer.write({"kind": "val", "step": done, "val_loss": val_loss})
                progress.message(f"step {done:>6} | val loss {val_loss:.4f}")
            if (tc.ckpt_interval and done % tc.ckpt_interval == 0) or done == tc.steps:
                ckpt_path = checkpoint(done)

        if last_val_step != tc.steps:  # resumed at/after the end: nothing trained, still report
            val_loss = evaluate(model, val_batches, precision)
            writer.write({"kind": "val", "step": tc.steps, "val_loss": val_loss})
            ckpt_path = ckpt_path or (resume_from or "")
    finally:
        progress.close()
        writer.close()
    return TrainSummary(steps=tc.steps, final_train_loss=loss_step, val_loss=val_loss,
                        unigram_entropy=float(corpus.unigram_entropy()),
                        tokens_per_s=run_tokens / run_seconds if run_seconds else 0.0,
                        checkpoint=ckpt_path, metrics_path=writer.path)
