"""Experts contract: parameter layout, output vs a dense reference (values and every gradient),
experts with zero rows, an empty batch, bf16 autocast, no per-call state; and what the backend
declares: budget rows (``budget_rows``: B rows per expert, zero rows of weight 0), their packed
form (``packed_rows``: ``forward_packed`` over chunks whose padding holds NaN) and a compiled
call equal to the eager one (``capturable``).

Legend: S rows, D hidden, F ffn hidden, L local experts.
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug.config import GATED_ACTIVATIONS, ModelConfig
from moeplug.interfaces import Experts
from moeplug.testing._common import (ContractError, build, close, differentiable, expect,
                                     expect_no_new_state, state_snapshot, tiny_model_config)
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
    if experts.budget_rows:
        _check_budget_rows(experts, label, D, gen, act)
    if experts.packed_rows:
        _check_packed_rows(experts, label, D, gen, act)


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


def _budget_rows(L: int, B: int, D: int, gen: torch.Generator) -> tuple:
    """Budget rows: B per expert, the last rows of each expert's block zero with weight 0."""
    counts_L = torch.full((L,), B, dtype=torch.int64)
    x_LBD = torch.randn(L, B, D, generator=gen)
    p_LB = torch.rand(L, B, generator=gen)
    for e in range(L):  # expert e's block holds e + 1 empty slots (at most B - 1)
        x_LBD[e, B - min(e + 1, B - 1):] = 0
        p_LB[e, B - min(e + 1, B - 1):] = 0
    return x_LBD.reshape(L * B, D), p_LB.reshape(L * B), counts_L


def _check_budget_rows(experts: Any, label: str, D: int, gen: torch.Generator,
                       activation: str) -> None:
    """``budget_rows``: every expert B rows, the empty slots zero rows of weight 0; equal to the
    reference, values and gradients (the empty slots' outputs zero); with ``capturable`` the
    call compiled whole (torch.compile fullgraph) equals the eager one."""
    L = experts.num_local_experts
    x_SD, p_S, counts_L = _budget_rows(L, 4, D, gen)
    x_SD.requires_grad_()
    p_S.requires_grad_()
    y_SD = experts(x_SD, p_S, counts_L)
    params = (experts.gate_up_proj, experts.down_proj)
    ref = reference_expert_mlp(x_SD, p_S, counts_L, *params, activation)
    close(y_SD, ref, label, "budget rows (budget_rows = True): output")
    w_SD = torch.randn(*y_SD.shape, generator=gen)
    inputs = (x_SD, p_S) + params
    got = torch.autograd.grad((y_SD * w_SD).sum(), inputs)
    want = torch.autograd.grad((ref * w_SD).sum(), inputs)
    for what, g, r in zip(("x_SD", "probs_S", "gate_up_proj", "down_proj"), got, want):
        close(g, r, label, f"budget rows: gradient w.r.t. {what}")
    if experts.capturable and not experts.packed_rows:  # what runtime.capture compiles
        _check_compiles(label, lambda x, p: experts(x, p, counts_L), y_SD, x_SD, p_S)


def _check_compiles(label: str, fn: Any, eager: torch.Tensor, *args: torch.Tensor) -> None:
    """``capturable``: the budgeted call compiled whole (torch.compile fullgraph, what
    runtime.capture runs on the CPU) equals the eager one."""
    torch._dynamo.reset()  # a fresh compile: what runtime.capture does once per shape
    try:
        got = torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    except Exception as exc:  # noqa: BLE001 - the backend's trace failure, named
        raise ContractError(f"{label}: declares capturable = True but its budgeted call does "
                            f"not compile whole (torch.compile fullgraph): "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    close(got, eager, label, "the budgeted call compiled (capturable = True): output")


def _check_packed_rows(experts: Any, label: str, D: int, gen: torch.Generator,
                       activation: str) -> None:
    """``packed_rows``: ``forward_packed`` over G = 2 chunks of S rows, each chunk's routed rows
    first (expert-contiguous) and NaN padding after: the routed rows equal the reference with
    weight 1, values and gradients, the padding never read into them."""
    L, S = experts.num_local_experts, 3 * experts.num_local_experts
    counts_GL = torch.tensor([[(e + g) % 3 for e in range(L)] for g in range(2)])
    x_GSD = torch.full((2, S, D), float("nan"))
    for g in range(2):
        n = int(counts_GL[g].sum())
        x_GSD[g, :n] = torch.randn(n, D, generator=gen)
    x_GSD.requires_grad_()
    y_GSD = experts.forward_packed(x_GSD, counts_GL)
    expect(tuple(y_GSD.shape) == (2, S, D), label, f"forward_packed returned "
           f"{tuple(y_GSD.shape)}, expected {(2, S, D)}")
    params = (experts.gate_up_proj, experts.down_proj)
    w_GSD = torch.zeros(2, S, D)
    outs, refs = [], []
    for g in range(2):
        n = int(counts_GL[g].sum())
        w_GSD[g, :n] = torch.randn(n, D, generator=gen)
        outs.append(y_GSD[g, :n])
        refs.append(reference_expert_mlp(x_GSD[g, :n], torch.ones(n), counts_GL[g], *params,
                                         activation))
    for g in range(2):
        close(outs[g], refs[g], label, f"packed rows (packed_rows = True), chunk {g}: output")
    got = torch.autograd.grad(sum((o * w_GSD[g, :o.shape[0]]).sum() for g, o in enumerate(outs)),
                              (x_GSD,) + params)
    want = torch.autograd.grad(sum((r * w_GSD[g, :r.shape[0]]).sum() for g, r in enumerate(refs)),
                               (x_GSD,) + params, allow_unused=True)
    routed = torch.zeros(2, S, 1, dtype=torch.bool)
    for g in range(2):
        routed[g, :int(counts_GL[g].sum())] = True
    close(torch.where(routed, got[0], 0), torch.where(routed, want[0], 0), label,
          "packed rows: gradient w.r.t. the routed rows")
    for what, g_, r in zip(("gate_up_proj", "down_proj"), got[1:], want[1:]):
        close(g_, r, label, f"packed rows: gradient w.r.t. {what}")
    if experts.capturable:  # what runtime.capture compiles on the CPU
        eager = torch.where(routed, y_GSD, 0)
        _check_compiles(label, lambda x: torch.where(routed, experts.forward_packed(
            x, counts_GL), 0), eager, x_GSD)
