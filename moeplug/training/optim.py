"""AdamW with parameter groups, and the learning-rate schedule (warmup, then Megatron's decay
styles: constant, linear, cosine, inverse-square-root, WSD).

Weight decay policy: decoupled decay (AdamW) applies only to matrices that do linear maps
(attention/MLP/expert/router weights, ``ndim >= 2``). Norm gains and biases (``ndim < 2``) and
embedding tables are not decayed: decaying a gain pulls it toward 0 instead of toward identity,
and embedding rows of rare tokens receive few gradients, so decay would mostly just shrink them.
With tied embeddings the shared table counts as an embedding (not decayed).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw as _torch_adamw  # the functional update, not wrapped

from moeplug.config import TrainConfig
from moeplug.ops.adamw import (adamw_step_, adamw_step_main_, kernel_applies,
                               stochastic_round_bf16_)
from moeplug.training.optim_base import Optimizer


# Optimizer state key of a bf16 parameter's fp32 main copy (train.param_dtype: bf16); the
# distributed optimizer saves its fp32 slices under it, and resharding cuts it like a moment.
MAIN = "main"


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then
    ``cfg.lr_decay_style`` (Megatron's OptimizerParamScheduler formulas, tests/test_lr_schedule.py
    checks them against megatron-core's own).

    Warmup reaches ``lr`` at the end of step ``warmup - 1`` (step 0 uses lr/warmup, never 0,
    so the first update is not wasted; warmup = ``cfg.effective_warmup_steps``, at most
    ``steps``); Megatron's warmup at its ``num_steps = step + 1``. After warmup Megatron's
    formulas at ``num_steps = step``, with D = ``cfg.lr_decay_horizon`` (``lr_decay_steps``, else
    ``steps``) and the decay progress r = (step - warmup) / (D - warmup):

        constant             lr
        linear               min_lr + (lr - min_lr) (1 - r)
        cosine               min_lr + (lr - min_lr) (1 + cos(pi r)) / 2
        inverse-square-root  max(min_lr, lr sqrt(warmup / step))
        WSD                  lr until D - A (A = ``cfg.lr_wsd_anneal_steps``), then
                             min_lr + (lr - min_lr) c(a), a = (step - (D - A)) / A, with
                             c = 1 - a (linear), (1 + cos(pi a)) / 2 (cosine),
                             2 * 0.5^a - 1 (exponential), 1 - sqrt(a) (minus_sqrt)

    Every style but constant holds ``min_lr`` past D.
    """
    warmup = cfg.effective_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    style, horizon = cfg.lr_decay_style, cfg.lr_decay_horizon
    if style == "constant":
        return cfg.lr
    if step > horizon:
        return cfg.min_lr
    if style == "inverse-square-root":
        return max(cfg.min_lr, cfg.lr * math.sqrt(max(warmup, 1) / max(step, 1)))
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    if style == "cosine":  # this expression, bit for bit, since before the other styles
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    if style == "linear":
        coeff = 1.0 - progress
    elif style == "WSD":
        coeff = _wsd_coefficient(step, horizon, cfg.lr_wsd_anneal_steps, cfg.lr_wsd_decay_style)
    else:
        raise ValueError(f"TrainConfig.lr_decay_style = {style!r} is not a decay style. Fix: "
                         "build the TrainConfig through its checks (moeplug.config)")
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def _wsd_coefficient(step: int, horizon: int, anneal: int, shape: str) -> float:
    """WSD's share of (lr - min_lr): 1 in the stable phase, then the anneal's ``shape`` over the
    last ``anneal`` steps of the horizon."""
    start = horizon - anneal
    if step <= start:
        return 1.0
    a = (step - start) / anneal
    if shape == "linear":
        return 1.0 - a
    if shape == "cosine":
        return 0.5 * (math.cos(math.pi * a) + 1.0)
    if shape == "exponential":
        return 2.0 * 0.5 ** a - 1.0
    if shape == "minus_sqrt":
        return 1.0 - math.sqrt(a)
    raise ValueError(f"TrainConfig.lr_wsd_decay_style = {shape!r} is not a WSD anneal shape. "
                     "Fix: build the TrainConfig through its checks (moeplug.config)")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into a decayed and a non-decayed group (policy in the module docstring)."""
    from moeplug.parallel.tensor_parallel import VocabParallelEmbedding  # TP's embedding table
    embedding_ids = {id(m.weight) for m in model.modules()
                     if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() already de-duplicates tied weights
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embedding_ids:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def stochastic_round_(dst: torch.Tensor, src32: torch.Tensor, step: int) -> None:
    """``dst`` (bf16) <- ``src32`` rounded up or down to a neighbouring bf16 with probability
    proportional to the distance: unbiased, so updates smaller than half a bf16 ulp still move
    a weight on average (round-to-nearest would drop every one of them).

    The random bits are a hash of each value's own bits and ``step``, not a generator's stream:
    the rounding of an element does not depend on how the tensor is cut (a distributed
    optimizer's slice rounds exactly as the whole tensor does) and a resumed run rounds as the
    uninterrupted one did, with no generator state to checkpoint.

    CPU tensors take the C++ kernel (moeplug.ops.adamw, one pass); others the torch version,
    :func:`stochastic_round_reference_`, which the kernel matches bitwise."""
    if dst.dtype == torch.bfloat16 and kernel_applies(dst, src32):
        stochastic_round_bf16_(dst, src32.float(), step)
    else:
        stochastic_round_reference_(dst, src32, step)


def stochastic_round_reference_(dst: torch.Tensor, src32: torch.Tensor, step: int) -> None:
    """The rounding of :func:`stochastic_round_` in torch ops (the kernel's reference)."""
    bits = src32.contiguous().view(torch.int32)
    h = (bits.to(torch.int64) & 0xFFFFFFFF) ^ ((step * 0x9E3779B9) & 0xFFFFFFFF)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF  # murmur3's finaliser: every input bit moves every output
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    # The bf16 value is the fp32's top 16 bits: adding 16 random low bits then truncating rounds
    # the magnitude up with probability (low bits / 2^16). Sign-magnitude, so both signs alike.
    noise = (h & 0xFFFF).to(torch.int32)
    dst.copy_(bits.add(noise).bitwise_and_(-65536).view(torch.float32))


class AdamW(Optimizer):
    """torch.optim.AdamW, bit for bit: the same state (``step`` an fp32 scalar on the CPU,
    ``exp_avg``, ``exp_avg_sq``) and the same update, torch's functional AdamW, on
    :class:`~moeplug.training.optim_base.Optimizer`, whose module says why not torch's base.
    CPU parameters take torch's fused kernel (``torch.optim.AdamW(fused=True)``: one pass over
    the elements); GPU ones torch's default there (the foreach kernels). torch's default on the
    CPU, its single-tensor loop, makes ~15 passes: 4.5x-5.7x the fused step's time
    (`pytest -s benchmarks/test_bench_kernels.py -k adamw_fp32`). The two keep the same
    moments; their parameters differ only where the loop's sqrt (MKL's) is 1 ulp low and the
    fused kernel's is correctly rounded: a last bit in under 1 % of them, which later steps
    carry on (that benchmark checks it).
    tests/test_optim_precision.py checks it against torch.optim.AdamW bitwise."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch's AdamW: the step count on the CPU, moments like p
                    state["step"] = torch.tensor(0.0, dtype=scalar)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            has_complex = any(torch.is_complex(p) for p in params)
            cpu = all(p.device.type == "cpu" for p in params)
            _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                         fused=True if cpu and not has_complex else None,
                         has_complex=has_complex, amsgrad=False, beta1=beta1, beta2=beta2,
                         lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=False)


class LowPrecisionMomentsAdamW(Optimizer):
    """AdamW (torch's formula) whose moments ``exp_avg`` / ``exp_avg_sq`` are stored in
    ``moment_dtype`` (bf16: half of fp32 AdamW's 8 bytes of state per parameter). Each step
    reads them into fp32, updates in fp32 and rounds them back (Megatron precision-aware
    optimizer, ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``). bf16 parameters (master
    weights in bf16, ``--main-params-dtype``) are updated in fp32 and stochastically rounded
    back (:func:`stochastic_round_`).

    ``fused`` (default): CPU parameters take one C++ pass per tensor (moeplug.ops.adamw): torch's
    step (:func:`_torch_update`, which other devices and ``fused=False`` run) makes ~15 passes
    and fp32 copies of the parameter, its grad and its moments. ``fused_cuda``: CUDA parameters
    take the CUDA kernel of the same pass where moeplug._runtime_cuda is loaded (its results
    are bitwise the CPU kernel's under the warp emulator, ctest moeplug_adamw_simt_tests; off
    until a GPU session runs tests/test_adamw_cuda.py, docs/GPU.md). The kernel does torch's
    arithmetic operation for operation with a correctly rounded sqrt, where torch's CPU sqrt
    (MKL) is sometimes 1 ulp low: so it is bitwise ``_torch_update(..., ieee_sqrt=True)``, and
    differs from ``fused=False`` in the last bit of some denominators (tests/test_adamw_kernel.py).
    ``fused=False`` is bit for bit the optimizer as it was before the kernel.

    ``main_params`` (``train.param_dtype: bf16``, Megatron's bf16 module with fp32 main params):
    each parameter that is not fp32 gets an fp32 main copy in its state (``"main"``, made from
    the parameter at its first step, as Megatron clones its main params from the bf16 module's).
    A step updates the main copy in fp32 from the parameter's grad and copies it back into the
    parameter rounded to nearest: the main copy is AdamW on fp32 weights, exactly, and the
    parameter is its bf16 image. Checkpoints carry the main copy as optimizer state."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 moment_dtype: torch.dtype = torch.bfloat16, weight_decay: float = 0.0,
                 fused: bool = True, main_params: bool = False, fused_cuda: bool = False) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.moment_dtype, self.fused, self.main_params = moment_dtype, fused, main_params
        self.fused_cuda = fused_cuda

    def wants_main(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is stepped through an fp32 main copy."""
        return self.main_params and p.dtype != torch.float32

    _KEPT = ("exp_avg", "exp_avg_sq", MAIN)  # state that load_state_dict keeps in its dtype

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state tensor to its parameter's dtype: fp32 moments and
        # main copies of bf16 parameters would come back rounded to bf16. Take them out first
        # and put them back in their own dtypes, from the saved values.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(saved_ids, (p for g in self.param_groups for p in g["params"])))
        kept, states = {}, {}
        for i, s in state_dict["state"].items():
            states[i] = {k: v for k, v in s.items() if k not in self._KEPT}
            kept[i] = {k: v for k, v in s.items() if k in self._KEPT}
        super().load_state_dict({**state_dict, "state": states})
        for i, tensors in kept.items():
            p = params[i]
            for k, v in tensors.items():
                if k == MAIN and not self.wants_main(p):
                    continue
                dtype = self.moment_dtype if k != MAIN else torch.float32
                self.state[p][k] = v.to(p.device, dtype, copy=True).view_as(p)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
                    if self.wants_main(p):
                        state[MAIN] = p.detach().float()
                state["step"] += 1
                t = int(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                w, g = p, p.grad
                if MAIN in state:  # fp32 main copy: update it, then round it into p
                    w = state[MAIN]
                    if self.fused and kernel_applies(w, g, m, v, p, cuda=self.fused_cuda) \
                            and g.dtype == p.dtype == torch.bfloat16:  # both in one pass
                        adamw_step_main_(w, g, p, m, v, lr=lr, beta1=beta1, beta2=beta2,
                                         eps=eps, weight_decay=wd, step=t)
                        continue
                    g = g.float()
                if self.fused and kernel_applies(w, g, m, v, cuda=self.fused_cuda) \
                        and g.dtype == w.dtype:
                    adamw_step_(w, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=wd, step=t)
                else:
                    _torch_update(w, g, m, v, lr, beta1, beta2, eps, wd, t)
                if w is not p:
                    p.copy_(w)


def _torch_update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  lr: float, beta1: float, beta2: float, eps: float, wd: float, t: int,
                  ieee_sqrt: bool = False) -> None:
    """One AdamW step of ``p`` in torch ops: the step before the fused kernel, bit for bit.

    ``ieee_sqrt``: take the correctly rounded square root (via fp64, which rounds to the same
    fp32) instead of torch's CPU ``sqrt``, which on MKL builds is MKL's vector sqrt and is not
    correctly rounded (1 ulp low on some inputs). With it, this is the fused kernel's
    reference, bitwise (tests/test_adamw_kernel.py)."""
    g32 = grad.float()
    m32 = m.float().lerp_(g32, 1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    m.copy_(m32)
    v.copy_(v32)
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.mul_(1 - lr * wd)
    root = v32.double().sqrt_().float() if ieee_sqrt else v32.sqrt()
    denom = (root / math.sqrt(1 - beta2 ** t)).add_(eps)
    p32.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** t))
    if p32 is not p:
        stochastic_round_(p, p32, t)


def adamw(groups: list[dict], cfg: TrainConfig) -> Optimizer:
    """AdamW (torch's, bit for bit), or with ``optimizer_dtype: bf16`` or bf16 parameters (``master_dtype``
    or ``param_dtype: bf16``) the precision-aware AdamW (moments in ``optimizer_dtype``, any
    parameter dtype, fp32 main copies of bf16 parameters with ``param_dtype: bf16``)."""
    # lr here is a placeholder: the trainer sets every group's lr from lr_at(step) each step.
    kw = {"lr": lr_at(0, cfg), "betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps}
    if cfg.optimizer_dtype == "bf16" or cfg.bf16_params:
        moments = torch.bfloat16 if cfg.optimizer_dtype == "bf16" else torch.float32
        return LowPrecisionMomentsAdamW(groups, moment_dtype=moments, main_params=cfg.main_params,
                                        **kw)
    return AdamW(groups, **kw)


def apply_param_dtype(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """bf16 parameters (``master_dtype`` or ``param_dtype: bf16``): the parameters themselves
    become bf16 (2 bytes each, and 2 for their grads); buffers (RoPE tables, expert biases,
    counters) keep their dtype. With ``param_dtype: bf16`` the optimizer keeps fp32 main
    copies (:class:`LowPrecisionMomentsAdamW`, or the distributed optimizer's fp32 slices)."""
    if cfg.bf16_params:
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> Optimizer:
    return adamw(param_groups(model, cfg.weight_decay), cfg)
