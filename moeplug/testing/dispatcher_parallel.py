"""Dispatcher contract at several ranks: a dispatcher on an expert-parallel group gives exactly
what the ``alltoall`` dispatcher gives on the same group, for the same tokens and routing.

Call :func:`check_dispatcher_ep` on every rank of the group (it runs collectives). Per routing
case it compares, on this rank:
    counts_L, x_SD, probs_S   equal to alltoall's (same rows for the same experts, same order:
                              expert-major, then source EP rank, then token - so the experts see
                              identical input, padding rows included)
    combine(experts(x_SD))    close to alltoall's (the sum over a token's choices may be taken
                              in another order), and so are the gradients w.r.t. x_TD and probs_TK
The cases cover uneven token counts (a rank with none), routings that starve ranks or cross no
rank, capacity drops (a token with every choice dropped), pad-to-capacity and pad_multiple.

Legend: T tokens on this rank, D hidden, E experts, K top-k, L local experts, W EP ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug.config import ModelConfig
from moeplug.interfaces import RouterOutput
from moeplug.testing._common import close, expect, tiny_model_config
from moeplug.testing.dispatcher import _tagged_experts

CASES = ("random", "skewed_to_last_rank", "zero_token_experts", "local_only", "dropped",
         "dropped_pad_to_capacity", "pad_multiple")


def _tokens(rank: int) -> int:
    return [5, 0, 7, 3][rank % 4]  # uneven; rank 1 sends nothing but still receives


def _routing(case: str, T: int, E: int, K: int, W: int, rank: int,
             gen: torch.Generator) -> RouterOutput:
    L = E // W
    allowed = {"skewed_to_last_rank": list(range(E - L, E)),
               "zero_token_experts": [0, E // 2 - 1, E - 1] if E >= 4 else list(range(E)),
               "local_only": list(range(rank * L, (rank + 1) * L))}.get(case, list(range(E)))
    K = min(K, len(allowed))
    pool = torch.tensor(allowed)
    ids_TK = (torch.stack([pool[torch.randperm(len(allowed), generator=gen)[:K]]
                           for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64))
    probs_TK = torch.rand(T, K, generator=gen)
    dropped_TK, capacity, pad_multiple = None, None, 1
    if case.startswith("dropped"):
        dropped_TK = torch.rand(T, K, generator=gen) < 0.4
        if T:
            dropped_TK[0] = True  # a token with every choice dropped gets zeros back
        probs_TK = probs_TK.masked_fill(dropped_TK, 0.0)  # the RouterOutput contract
        if case == "dropped_pad_to_capacity":
            kept_E = torch.bincount(ids_TK[~dropped_TK], minlength=E)
            capacity = int(kept_E.max()) + 1 if T else 0  # this rank's C: no expert over it
    if case == "pad_multiple":
        pad_multiple = 4
    return RouterOutput(probs_TK=probs_TK.requires_grad_(), ids_TK=ids_TK,
                        aux_loss=torch.zeros(()), dropped_TK=dropped_TK, capacity=capacity,
                        pad_multiple=pad_multiple)


def _run(disp: Any, x_TD: torch.Tensor, routing: RouterOutput, w_TD: torch.Tensor):
    x = x_TD.clone().requires_grad_()
    probs = routing.probs_TK.detach().clone().requires_grad_()
    r = RouterOutput(probs_TK=probs, ids_TK=routing.ids_TK, aux_loss=routing.aux_loss,
                     dropped_TK=routing.dropped_TK, capacity=routing.capacity,
                     pad_multiple=routing.pad_multiple)
    d = disp.dispatch(x, r)
    y_TD = disp.combine(_tagged_experts(d), d.meta)
    x_grad, p_grad = torch.autograd.grad((y_TD * w_TD).sum(), (x, probs), allow_unused=True)
    return d, y_TD.detach(), x_grad, p_grad


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two same-shape tensors (0 for empty ones)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return 0.0 if a.numel() == 0 else (a - b).abs().max().item()


def run_with_experts(disp: Any, experts: Any, x_TD: torch.Tensor, probs_TK: torch.Tensor,
                     ids_TK: torch.Tensor, w_TD: torch.Tensor):
    """This rank's tokens through dispatch -> real experts -> combine, then backward of
    ``sum(y * w)`` (grads land on the experts' parameters). Returns (dispatched, y_TD, x_grad,
    probs_grad)."""
    x = x_TD.clone().requires_grad_()
    p = probs_TK.clone().requires_grad_()
    d = disp.dispatch(x, RouterOutput(p, ids_TK, torch.zeros(())))
    y_TD = disp.combine(experts(d.x_SD, d.probs_S, d.counts_L), d.meta)
    (y_TD * w_TD).sum().backward()
    return d, y_TD, x.grad, p.grad


def expert_grad_errors(experts: Any, experts_ref: Any, mine: range, key: str) -> dict[str, float]:
    """``{key/expert_grad/NAME: err}``: this rank's experts' weight grads vs the one-process
    reference's rows ``mine`` (its global expert ids)."""
    return {f"{key}/expert_grad/{n}": max_abs_err(getattr(experts, n).grad,
                                                  getattr(experts_ref, n).grad[mine.start:mine.stop])
            for n in ("gate_up_proj", "down_proj")}


def check_dispatcher_ep(host: Any, name: str, group: Any, *, options: dict | None = None,
                        model_cfg: ModelConfig | None = None, seed: int = 0,
                        cases: tuple[str, ...] = CASES) -> None:
    """Compare dispatcher ``name`` (built by ``host`` with ``options`` on ``group``) with
    ``alltoall`` on the same group; raises ContractError naming the case and the check."""
    import torch.distributed as dist

    cfg = model_cfg or tiny_model_config(num_experts=8, top_k=3)
    E, K, D = cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden_size
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    disp = host.create("dispatcher", name, dict(options or {}), cfg, group)
    ref = host.create("dispatcher", "alltoall", {}, cfg, group)
    label = f"dispatcher '{name}' at EP{W}, rank {rank}"
    expect(disp.num_local_experts == ref.num_local_experts, label,
           f"num_local_experts = {disp.num_local_experts}, alltoall has {ref.num_local_experts}")
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    T = _tokens(rank)
    for case in cases:
        routing = _routing(case, T, E, K, W, rank, gen)
        x_TD, w_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        d, y, gx, gp = _run(disp, x_TD, routing, w_TD)
        d_ref, y_ref, gx_ref, gp_ref = _run(ref, x_TD, routing, w_TD)
        where = f"{label}, case {case}"
        expect(torch.equal(d.counts_L, d_ref.counts_L), where,
               f"counts_L = {d.counts_L.tolist()}, alltoall gives {d_ref.counts_L.tolist()}")
        expect(d.x_SD.shape == d_ref.x_SD.shape and torch.equal(d.x_SD, d_ref.x_SD), where,
               "x_SD differs from alltoall's (rows, their order, or padding)")
        expect(torch.equal(d.probs_S, d_ref.probs_S), where, "probs_S differs from alltoall's")
        close(y, y_ref, where, "combine output (vs alltoall)")
        close(gx, gx_ref, where, "gradient w.r.t. x_TD (vs alltoall)")
        if gp_ref is not None:
            close(gp, gp_ref, where, "gradient w.r.t. probs_TK (vs alltoall)")
