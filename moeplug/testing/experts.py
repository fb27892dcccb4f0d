"""Experts contract: parameter layout, output vs a dense reference (values and every gradient),
experts with zero rows, an empty batch, bf16 autocast, no per-call state.

Legend: S rows, D hidden, F ffn hidden, L local experts.
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug.config import GATED_ACTIVATIONS, ModelConfig
from moeplug.interfaces import Experts
from moeplug.testing._common import (build, close, differentiable, expect, expect_no_new_state,
                                     state_snapshot, tiny_model_config)
from moeplug.testing.capabilities import check_declared
from moeplug.testing.reference import reference_expert_mlp


def check_experts(source: Any, name: str | None = None, *, model_cfg: ModelConfig | None = None,
                  options: Any = None, num_local_experts: int = 3, seed: int = 0) -> None:
    cfg = model_cfg or tiny_model_config()
    L, D, F = num_local_experts, cfg.hidden_size, cfg.moe.ffn_hidden_size
    torch.manual_seed(seed)
    experts, label = build(source, "experts", name, options, cfg, L)
    expect(isinstance(experts, Experts), label, f"is a {type(experts).__name__}, not an Experts")
    check_declared(experts, Experts, label)
    expect(experts.num_local_experts == L, label,
           f"num_local_experts = {experts.num_local_experts}, expected {L}")
    act = cfg.moe.activation  # gated ones (swiglu, geglu) have a [L, 2F, D] gate_up_proj
    X = 2 * F if act in GATED_ACTIVATIONS else F
    for pname, shape in (("gate_up_proj", (L, X, D)), ("down_proj", (L, D, F))):
        p = getattr(experts, pname, None)
        expect(isinstance(p, torch.nn.Parameter) and tuple(p.shape) == shape and p.dtype == torch.float32,
               label, f"{pname} must be an fp32 Parameter of shape {shape} (HF Mixtral layout), got "
                      f"{None if p is None else (p.dtype, tuple(p.shape))}")

    gen = torch.Generator().manual_seed(seed)
    # Uneven counts, an expert with no rows at each position, and an empty batch (an EP rank can
    # receive nothing).
    for counts in ([3, 0, 5], [0, 4, 0], [2, 2, 2], [0, 0, 0]):
        counts_L = torch.tensor((counts + [1] * L)[:L], dtype=torch.int64)
        _check_case(experts, label, counts_L, D, gen, act)

    counts_L = torch.tensor(([4, 0, 3] + [2] * L)[:L], dtype=torch.int64)
    S = int(counts_L.sum())
    x_SD, p_S = torch.randn(S, D, generator=gen), torch.rand(S, generator=gen)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y_SD = experts(x_SD, p_S, counts_L)
    ref = reference_expert_mlp(x_SD, p_S, counts_L, experts.gate_up_proj, experts.down_proj,
                               cfg.moe.activation)
    close(y_SD, ref, label, "output under bf16 autocast", rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    expect(experts.gate_up_proj.dtype == torch.float32 and experts.down_proj.dtype == torch.float32, label,
           "autocast changed the parameter dtype; parameters must stay fp32")


def _check_case(experts: Any, label: str, counts_L: torch.Tensor, D: int, gen: torch.Generator,
                activation: str) -> None:
    S = int(counts_L.sum())
    x_SD = torch.randn(S, D, generator=gen).requires_grad_()
    p_S = torch.rand(S, generator=gen).requires_grad_()
    before = state_snapshot(experts)
    y_SD = experts(x_SD, p_S, counts_L)
    expect_no_new_state(before, experts, label, "forward")
    case = f"counts_L={counts_L.tolist()}"
    expect(y_SD.shape == (S, D) and y_SD.dtype == x_SD.dtype, label,
           f"{case}: output is {y_SD.dtype}{tuple(y_SD.shape)}, expected {x_SD.dtype}{(S, D)}")
    params = (experts.gate_up_proj, experts.down_proj)
    ref = reference_expert_mlp(x_SD, p_S, counts_L, *params, activation)
    close(y_SD, ref, label, f"{case}: output")
    if S == 0:
        return
    w_SD = torch.randn(S, D, generator=gen)
    inputs = (x_SD, p_S) + params
    got = torch.autograd.grad((differentiable(y_SD, label, f"{case}: the output") * w_SD).sum(),
                              inputs, allow_unused=True)
    want = torch.autograd.grad((ref * w_SD).sum(), inputs)
    for what, g, r in zip(("x_SD", "probs_S", "gate_up_proj", "down_proj"), got, want):
        close(g if g is not None else torch.zeros_like(r), r, label, f"{case}: gradient w.r.t. {what}")
