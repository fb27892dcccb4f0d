"""The ``train:`` section: optimiser, schedule, batch shape, evaluation, checkpoints, logging."""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeplug.config._checks import (_above_zero, _check_fields, _check_seed, _fail,
                                      _non_negative, _positive)

# Megatron's --lr-decay-style values and --lr-wsd-decay-style values, spelled as Megatron does.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WSD_DEFAULTS = {"lr_wsd_decay_style": "exponential", "lr_wsd_decay_steps": 0,
                 "lr_wsd_decay_fraction": 0.1}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimiser, schedule, batch shape, evaluation, checkpointing and logging."""

    steps: int = 600
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    # After warmup (Megatron --lr-decay-style; moeplug.training.optim.lr_at has the formulas):
    # constant (lr), linear / cosine (lr -> min_lr over the decay horizon), inverse-square-root
    # (lr * sqrt(warmup / step), floored at min_lr), WSD (lr, then the last decay steps of the
    # horizon anneal to min_lr in lr_wsd_decay_style).
    lr_decay_style: str = "cosine"
    # The decay horizon (Megatron --lr-decay-iters, warmup included): the step at which the
    # decay reaches min_lr, held after it. 0: train.steps.
    lr_decay_steps: int = 0
    # WSD only: the shape of the anneal (Megatron --lr-wsd-decay-style: linear, cosine,
    # exponential, minus_sqrt) and its length: lr_wsd_decay_steps (Megatron
    # --lr-wsd-decay-iters) or, when that is 0, lr_wsd_decay_fraction of the decay horizon.
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_steps: int = 0
    lr_wsd_decay_fraction: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8  # AdamW's epsilon (Megatron --adam-eps), added to sqrt(v)
    # Precision-aware optimizer (Megatron --exp-avg-dtype / --exp-avg-sq-dtype): "bf16" stores
    # the AdamW moments in bf16 (half their bytes); the update math stays fp32.
    optimizer_dtype: str = "fp32"
    # Master weights (Megatron --main-params-dtype): "bf16" stores the parameters (and so their
    # grads) in bf16 and rounds each AdamW update into them stochastically; needs
    # plugins.precision: bf16 (autocast computes in bf16 anyway).
    master_dtype: str = "fp32"
    # Module parameters (Megatron --bf16's Float16Module with fp32 main params): "bf16" makes the
    # model's parameters (and so their grads) bf16 and keeps an fp32 main copy of each in the
    # optimizer, which updates it and copies it back into the parameter, rounded to nearest.
    # The bf16 GEMMs then read the weights as they are: no per-step weight casts. Needs
    # plugins.precision: bf16. With master_dtype: bf16 the parameters are bf16 whatever this
    # says, and there is no fp32 copy.
    param_dtype: str = "fp32"
    grad_clip: float = 1.0
    seed: int = 1234
    eval_interval: int = 100
    # Micro-batches per evaluation: 0 = the whole validation set (every target once); N > 0 =
    # its first N (the same ones each time). Evaluations run at step 0, every eval_interval
    # steps and at the end.
    eval_batches: int = 0
    ckpt_interval: int = 0  # 0: only at the end
    keep_last: int = 0  # keep the newest N step_* checkpoints of out_dir, delete older; 0: all
    log_interval: int = 10
    out_dir: str = "runs/default"
    resume: str = ""  # path to a checkpoint directory, or "auto" for the latest in out_dir
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    # Keep freed host memory in the process for reuse (moeplug.runtime.retain_freed_memory):
    # by default glibc maps every large tensor fresh and the kernel zero-fills its pages on
    # first touch. The MoE layer's large buffers come from moeplug.runtime.workspace's cache, so
    # it buys little there (benchmarks/test_bench_moe_layer.py: fp32 0.97 of the square
    # matmul with it, 0.93 without; bf16 no better). Off by default: glibc's heap then
    # fragments - a loop of 64 MiB tensors settled at 732 MB resident - so the footprint can
    # grow well past the peak.
    retain_freed_memory: bool = False
    tensorboard: bool = False  # also write TensorBoard events to out_dir/tb (rank 0)
    # Also log to Weights & Biases (rank 0; the wandb extra): the TensorBoard writer's tags.
    # wandb_mode: offline (files under out_dir/wandb, no network), online, disabled, or empty
    # for wandb's own ($WANDB_MODE, else online). moeplug.observability.wandb_writer.
    wandb: bool = False
    wandb_project: str = "moeplug"
    wandb_name: str = ""  # empty: wandb's generated run name
    wandb_mode: str = ""
    time_breakdown: bool = True  # per-stage seconds in train records (CPU runs)
    # Also the peak bytes held for backward in the train records' per-rank memory (a
    # saved-tensor meter, ~17% of a default-model step; moeplug.training.memory).
    memory_stats: bool = False
    # "auto": cuda when torch sees a GPU, else cpu. Availability is checked by the CLI
    # (moeplug.training.distributed.resolve_device), not here: a config stays machine-free.
    device: str = "auto"
    # A step whose loss or grad norm is NaN/Inf is never applied: "stop" ends the run with the
    # step and layer named; "skip" drops the update and goes on, at most max_skipped_steps in a
    # row (moeplug.training.faults).
    nonfinite: str = "stop"
    max_skipped_steps: int = 10

    @property
    def effective_warmup_steps(self) -> int:
        """Warmup steps the schedule uses: ``warmup_steps``, clamped to ``steps`` so a short
        trial run (``--steps 10``) warms up over the whole run instead of being refused."""
        return min(self.warmup_steps, self.steps)

    @property
    def lr_decay_horizon(self) -> int:
        """The step at which the decay reaches ``min_lr``: ``lr_decay_steps``, or ``steps``."""
        return self.lr_decay_steps or self.steps

    @property
    def lr_wsd_anneal_steps(self) -> int:
        """WSD: the steps of the anneal, ``lr_wsd_decay_steps`` or the fraction of the
        horizon (at least 1)."""
        return self.lr_wsd_decay_steps or max(
            1, round(self.lr_wsd_decay_fraction * self.lr_decay_horizon))

    @property
    def bf16_params(self) -> bool:
        """The model's parameters are bf16 (param_dtype or master_dtype bf16)."""
        return "bf16" in (self.param_dtype, self.master_dtype)

    @property
    def main_params(self) -> bool:
        """The optimizer keeps an fp32 main copy of the bf16 parameters (param_dtype bf16 with
        master_dtype fp32)."""
        return self.param_dtype == "bf16" and self.master_dtype == "fp32"

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "steps", "micro_batch_size", "grad_accum_steps", "seq_len",
                  "log_interval")
        _non_negative(self, "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip",
                      "eval_interval", "eval_batches", "ckpt_interval", "keep_last", "threads")
        if self.min_lr > self.lr:
            _fail(self, "min_lr", self.min_lr, f"exceeds lr ({self.lr})", "set min_lr <= lr")
        self._check_lr_schedule()
        _check_seed(self, "seed", self.seed)
        for n in ("beta1", "beta2"):
            v = getattr(self, n)
            if not 0.0 <= v < 1.0:
                _fail(self, n, v, "must be in [0, 1)", f"set {n} to e.g. 0.9")
        _above_zero(self, "adam_eps")
        if self.optimizer_dtype not in ("fp32", "bf16"):
            _fail(self, "optimizer_dtype", self.optimizer_dtype, "must be fp32 or bf16",
                  "write optimizer_dtype: fp32 (default) or bf16 (bf16 AdamW moments)")
        if self.master_dtype not in ("fp32", "bf16"):
            _fail(self, "master_dtype", self.master_dtype, "must be fp32 or bf16",
                  "write master_dtype: fp32 (default) or bf16 (bf16 master weights)")
        if self.param_dtype not in ("fp32", "bf16"):
            _fail(self, "param_dtype", self.param_dtype, "must be fp32 or bf16",
                  "write param_dtype: fp32 (default) or bf16 (bf16 module weights, fp32 main "
                  "copy in the optimizer)")
        for n in ("tensorboard", "time_breakdown", "memory_stats"):
            if not isinstance(getattr(self, n), bool):
                _fail(self, n, getattr(self, n), "must be a boolean", f"write {n}: true or false")
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            _fail(self, "wandb_mode", self.wandb_mode, "is not a W&B mode",
                  "use offline (no network), online, disabled, or leave it empty ($WANDB_MODE)")
        if self.wandb and not self.wandb_project:
            _fail(self, "wandb_project", self.wandb_project, "must name a W&B project",
                  "set wandb_project, e.g. moeplug")
        if self.nonfinite not in ("stop", "skip"):
            _fail(self, "nonfinite", self.nonfinite, "must be stop or skip",
                  "set nonfinite to stop (end the run) or skip (drop the update, go on)")
        _non_negative(self, "max_skipped_steps")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?",
                                                                self.device):
            _fail(self, "device", self.device, "must be auto, cpu, cuda or cuda:N",
                  "set device to auto (GPU when present), cpu, cuda or e.g. cuda:0")


    def _check_lr_schedule(self) -> None:
        style = self.lr_decay_style
        if style not in LR_DECAY_STYLES:
            _fail(self, "lr_decay_style", style, "is not a decay style",
                  f"use one of {', '.join(LR_DECAY_STYLES)} (Megatron's --lr-decay-style)")
        _non_negative(self, "lr_decay_steps", "lr_wsd_decay_steps")
        if isinstance(self.lr_decay_steps, int) and 0 < self.lr_decay_steps <= self.warmup_steps:
            _fail(self, "lr_decay_steps", self.lr_decay_steps, f"must exceed warmup_steps "
                  f"({self.warmup_steps}): the decay horizon includes the warmup",
                  f"set lr_decay_steps > {self.warmup_steps}, or 0 (train.steps)")
        if style != "WSD":  # the WSD fields would be ignored: say so rather than drop them
            for name, default in _WSD_DEFAULTS.items():
                if getattr(self, name) != default:
                    _fail(self, name, getattr(self, name), f"is read only by lr_decay_style "
                          f"WSD (lr_decay_style is {style!r})",
                          f"set lr_decay_style: WSD, or drop {name}")
            return
        if self.lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
            _fail(self, "lr_wsd_decay_style", self.lr_wsd_decay_style, "is not a WSD anneal "
                  "shape", f"use one of {', '.join(LR_WSD_DECAY_STYLES)} (Megatron's "
                  f"--lr-wsd-decay-style)")
        f = self.lr_wsd_decay_fraction
        if isinstance(f, (int, float)) and not 0.0 < f <= 1.0:
            _fail(self, "lr_wsd_decay_fraction", f, "must be in (0, 1]",
                  "set lr_wsd_decay_fraction to e.g. 0.1 (the last 10% of the decay horizon)")
        if self.lr_wsd_decay_steps and f != _WSD_DEFAULTS["lr_wsd_decay_fraction"]:
            _fail(self, "lr_wsd_decay_fraction", f, f"is not used when lr_wsd_decay_steps "
                  f"({self.lr_wsd_decay_steps}) is set", "set only one of the two")
