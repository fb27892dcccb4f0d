"""Dispatcher contract (one process): shapes, counts, expert-contiguous rows, dispatch -> affine
tagged experts -> combine gives sum_k p*f_e(x) (so weighted copies are caught), gradients to
tokens and probs, the padding a routing asks for (pad_multiple, capacity), two dispatches in
flight, and the split start/wait form (overlap) equal to dispatch/combine.

Legend: T tokens, D hidden, E experts, K top-k, L local experts, S rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moeplug.config import ModelConfig
from moeplug.interfaces import Dispatched, Dispatcher, RouterOutput
from moeplug.testing._common import (build, close, differentiable, expect, expect_no_new_state,
                                     state_snapshot, tiny_model_config)
from moeplug.testing.capabilities import check_declared


def random_routing(T: int, E: int, K: int, generator: torch.Generator,
                   allowed_experts: int | None = None) -> RouterOutput:
    """Distinct ids per token drawn from the first ``allowed_experts`` experts, random probs."""
    n = allowed_experts or E
    ids_TK = torch.stack([torch.randperm(n, generator=generator)[:K] for _ in range(T)])
    probs_TK = torch.rand(T, K, generator=generator).requires_grad_()
    return RouterOutput(probs_TK=probs_TK, ids_TK=ids_TK, aux_loss=torch.zeros(()))


def _tagged_experts(d: Dispatched) -> torch.Tensor:
    # Affine experts f_e(x) = x * (e + 1) + (e + 1), weighted by the row's prob as an experts
    # backend weights its output: a row grouped under the wrong expert or carrying the wrong
    # prob changes the combined result, and so does a dispatcher that sends weighted copies
    # p * x with prob 1 (f(p x) != p f(x) for an affine f; linear tags could not tell).
    e_S = torch.repeat_interleave(torch.arange(len(d.counts_L)), d.counts_L)
    tag_S1 = (e_S + 1).unsqueeze(-1).to(d.x_SD.dtype)
    return (d.x_SD * tag_S1 + tag_S1) * d.probs_S.unsqueeze(-1).to(d.x_SD.dtype)


def _expected(x_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
    tag_TK = (routing.ids_TK + 1).to(routing.probs_TK.dtype)
    weight_TK = routing.probs_TK * tag_TK
    return x_TD * weight_TK.sum(dim=-1, keepdim=True) + weight_TK.sum(dim=-1, keepdim=True)


def check_dispatcher(source: Any, name: str | None = None, *, model_cfg: ModelConfig | None = None,
                     options: Any = None, num_tokens: int = 11, seed: int = 0) -> None:
    cfg = model_cfg or tiny_model_config()
    E, K, D, T = cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden_size, num_tokens
    gen = torch.Generator().manual_seed(seed)
    disp, label = build(source, "dispatcher", name, options, cfg, None)
    expect(isinstance(disp, Dispatcher), label, f"is a {type(disp).__name__}, not a Dispatcher")
    check_declared(disp, Dispatcher, label)
    expect(disp.num_experts == E and disp.num_local_experts == E, label,
           f"at one process num_experts/num_local_experts = {disp.num_experts}/"
           f"{disp.num_local_experts}, expected {E}/{E}")

    # Round trip, with K and E chosen so some experts get no rows in the second case.
    for allowed in (E, K):
        routing = random_routing(T, E, K, gen, allowed_experts=allowed)
        x_TD = torch.randn(T, D, generator=gen).requires_grad_()
        before = state_snapshot(disp)
        d = disp.dispatch(x_TD, routing)
        expect_no_new_state(before, disp, label, "dispatch")
        _check_dispatched(d, label, routing, T, K, D)
        y_TD = disp.combine(_tagged_experts(d), d.meta)
        expect_no_new_state(before, disp, label, "combine")
        close(y_TD, _expected(x_TD, routing), label, "combine(identity experts(dispatch(x)))")

        w_TD = torch.randn(T, D, generator=gen)
        grads = torch.autograd.grad((differentiable(y_TD, label, "combine's output") * w_TD)
                                    .sum(), (x_TD, routing.probs_TK))
        ref = torch.autograd.grad((_expected(x_TD, routing) * w_TD).sum(), (x_TD, routing.probs_TK))
        close(grads[0], ref[0], label, "gradient w.r.t. x_TD")
        close(grads[1], ref[1], label, "gradient w.r.t. probs_TK")

    # The padding a routing asks for (RouterOutput): every local expert's rows a multiple of
    # pad_multiple, or exactly capacity rows, the padding prob-0 rows; outputs unchanged.
    for case in ("pad_multiple", "capacity"):
        routing = random_routing(T, E, K, gen)
        wanted_E = torch.bincount(routing.ids_TK.reshape(-1), minlength=E)
        routing = (dataclasses.replace(routing, pad_multiple=4) if case == "pad_multiple" else
                   dataclasses.replace(routing, capacity=int(wanted_E.max()) + 1))
        x_TD = torch.randn(T, D, generator=gen)
        d = disp.dispatch(x_TD, routing)
        counts_E = d.counts_L
        if case == "pad_multiple":
            expect(bool(((counts_E % 4) == 0).all()) and bool((counts_E >= wanted_E).all()),
                   label, f"with pad_multiple = 4, counts_L = {counts_E.tolist()} (routed "
                   f"{wanted_E.tolist()}): each expert's rows must be padded up to a multiple of "
                   "4 with prob-0 rows")
        else:
            expect(bool((counts_E == routing.capacity).all()), label,
                   f"with capacity = {routing.capacity}, counts_L = {counts_E.tolist()}: every "
                   "local expert must receive exactly capacity rows (padded with prob-0 rows)")
        expect(d.x_SD.shape[0] == int(counts_E.sum()) == d.probs_S.shape[0], label,
               f"with {case}, x_SD has {d.x_SD.shape[0]} rows and probs_S "
               f"{d.probs_S.shape[0]}, but counts_L sums to {int(counts_E.sum())}")
        close(disp.combine(_tagged_experts(d), d.meta), _expected(x_TD, routing), label,
              f"combine(experts(dispatch(x))) with {case}")

    # Two micro-batches in flight, combined in reverse order: everything combine needs is in meta.
    r1, r2 = random_routing(T, E, K, gen), random_routing(T + 3, E, K, gen)
    x1, x2 = torch.randn(T, D, generator=gen), torch.randn(T + 3, D, generator=gen)
    d1, d2 = disp.dispatch(x1, r1), disp.dispatch(x2, r2)
    y2 = disp.combine(_tagged_experts(d2), d2.meta)
    y1 = disp.combine(_tagged_experts(d1), d1.meta)
    close(y2, _expected(x2, r2), label, "second of two in-flight micro-batches")
    close(y1, _expected(x1, r1), label, "first of two in-flight micro-batches (combined last)")

    # The split form (overlap, model.moe.overlap_chunks; the base class's defaults run it all in
    # *_start): two exchanges in flight give exactly dispatch's rows and combine's outputs.
    p1, p2 = disp.dispatch_start(x1, r1), disp.dispatch_start(x2, r2)
    e1, e2 = disp.dispatch_wait(p1), disp.dispatch_wait(p2)
    for e, d, which in ((e1, d1, "first"), (e2, d2, "second")):
        expect(torch.equal(e.x_SD, d.x_SD) and torch.equal(e.counts_L, d.counts_L), label,
               f"dispatch_wait(dispatch_start(...)) of the {which} in-flight micro-batch differs "
               "from dispatch(...)")
    q1, q2 = (disp.combine_start(_tagged_experts(e1), e1.meta),
              disp.combine_start(_tagged_experts(e2), e2.meta))
    close(disp.combine_wait(q1), _expected(x1, r1), label, "combine_wait(combine_start(...)), first")
    close(disp.combine_wait(q2), _expected(x2, r2), label, "combine_wait(combine_start(...)), second")


def _check_dispatched(d: Any, label: str, routing: RouterOutput, T: int, K: int, D: int) -> None:
    S = T * K
    expect(isinstance(d, Dispatched), label, f"dispatch returned {type(d).__name__}, not Dispatched")
    expect(d.x_SD.shape == (S, D), label, f"x_SD has shape {tuple(d.x_SD.shape)}, expected {(S, D)}")
    expect(d.probs_S.shape == (S,) and d.probs_S.dtype == torch.float32, label,
           f"probs_S is {d.probs_S.dtype}{tuple(d.probs_S.shape)}, expected float32{(S,)}")
    expect(d.counts_L.dtype == torch.int64 and d.counts_L.device.type == "cpu", label,
           f"counts_L is {d.counts_L.dtype} on {d.counts_L.device}, expected an int64 CPU tensor")
    expect(int(d.counts_L.sum()) == S, label, f"counts_L sums to {int(d.counts_L.sum())}, expected S = {S}")
    want = torch.bincount(routing.ids_TK.reshape(-1), minlength=len(d.counts_L))
    expect(torch.equal(d.counts_L, want), label,
           f"counts_L = {d.counts_L.tolist()}, but the routing sends {want.tolist()} rows per expert")
