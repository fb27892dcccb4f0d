"""The budgeted dispatcher's eager CPU form (moeplug.moe.budgeted.arena) against its pure pieces
(moeplug.moe.budgeted.slots), which capture compiles and a GPU runs.

Proofs:
  * the runtime's budget_slots kernel gives slots.slots' integers (slots, counts, the
    over-budget flag), packed, over 1, 2 and 4 EP chunks, with and without router drops;
  * stages 1-6 in the arena equal the pure pieces, outputs and every gradient (torch.equal),
    fp32, bf16 autocast and bf16 tensors, gated and plain activations, within and over budget,
    also when every free arena and cache buffer holds NaN bytes beforehand (the form reads
    no row it did not write); and with ``moe.apply_probs_on_input`` (weights on the rows).
The layer-level proofs (equal to the dynamic layer, zero host syncs, zero allocations after
warm-up, EP2) are in tests/test_sync_free.py and tests/test_moe_allocations.py.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from moeplug.config import RuntimeSection
from moeplug.moe.budgeted import arena as static_arena
from moeplug.moe.budgeted.dispatcher import BudgetedDispatcher
from moeplug.moe.budgeted.slots import slots
from moeplug.runtime import workspace
from moeplug.runtime.syncfree import SyncFreeState


def _routing(T: int, K: int, E: int, drop: float, g: torch.Generator) -> tuple:
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    dropped_TK = (torch.rand(T, K, generator=g) < drop) if drop else None
    return ids_TK, dropped_TK


@pytest.mark.parametrize("E, W", [(8, 1), (8, 2), (16, 4), (6, 3)])
@pytest.mark.parametrize("budget", [1, 3, 40])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_budget_slots_kernel_equals_the_torch_slots(E, W, budget, drop):
    g = torch.Generator().manual_seed(E * 100 + W * 10 + budget)
    ids_TK, dropped_TK = _routing(37, 3, E, drop, g)
    want = slots(ids_TK, dropped_TK, E, budget, packed=True, ep_size=W)
    got = static_arena.slots(ids_TK, dropped_TK, E, budget, W)
    for name, a, b in zip(("slot_N", "overflow", "counts_E"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    if budget == 1:
        assert bool(got[1])  # 37 tokens x 3 choices over E experts of one slot each: over


def test_budget_slots_kernel_names_a_bad_expert_id():
    ids_TK = torch.tensor([[0, 1], [9, 2]])
    with pytest.raises(ValueError, match=r"ids\[2\] = 9 is not an expert id"):
        static_arena.slots(ids_TK, None, 4, 2)


def _poison_free_buffers(arena: workspace.Arena) -> None:
    """Every buffer the arena and the workspaces would hand out again, filled with 0xFF bytes
    (NaN in every float dtype, -1 in int64)."""
    for buf in arena.free_buffers() + workspace.free_cached():
        buf.view(torch.uint8).fill_(0xFF)


def _run(form: str, x, ids_TK, dropped_TK, probs_TK, w13, w2, activation, budget, autocast,
         grad_TD, weighted_input=False) -> list[torch.Tensor]:
    """Stages 1-6 at one rank: the budgeted dispatcher (its arena or its pure form) around the
    grouped experts' packed rows (moeplug.ops.grouped_ffn)."""
    from moeplug.ops.grouped_ffn import grouped_ffn_packed
    x = x.clone().requires_grad_(True)
    p, a, b = (t.clone().requires_grad_(True) for t in (probs_TK, w13, w2))
    routing = types.SimpleNamespace(ids_TK=ids_TK, dropped_TK=dropped_TK, probs_TK=p)
    E = w13.shape[0]
    state = SyncFreeState(RuntimeSection(sync_free=True, token_budget=budget))
    state.arena = form == "arena"
    inner = types.SimpleNamespace(num_experts=E, num_local_experts=E, quantizes_dispatch=False)
    dispatcher = BudgetedDispatcher(inner, state, packed=True, weighted_input=weighted_input)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        d = dispatcher.dispatch(x, routing)
        x_GSD = d.x_SD.view(d.counts_L.shape[0], -1, d.x_SD.shape[1])
        y_GSD = grouped_ffn_packed(x_GSD, d.counts_L, a, b, activation)
        y = dispatcher.combine(y_GSD.view(-1, y_GSD.shape[2]), d.meta)
    over, counts = state.take_overflow(), d.counts_E
    (y.float() * grad_TD).sum().backward()
    return [t.detach().clone() for t in (y, over, counts, x.grad, p.grad, a.grad, b.grad)]


CASES = list(itertools.product(["swiglu", "gelu"], [2.0, 0.6], ["fp32", "autocast", "bf16"],
                               [0.0, 0.25]))


@pytest.mark.parametrize("activation, budget, dtype, drop", CASES)
def test_arena_stages_equal_the_pure_pieces(activation, budget, dtype, drop):
    # budget 0.6: some experts get more choices than their slots (the overflow flag is set and
    # those choices reach no expert, in both forms alike).
    T, K, D, F, E = 40, 3, 16, 12, 8
    g = torch.Generator().manual_seed(7)
    ids_TK, dropped_TK = _routing(T, K, E, drop, g)
    X = 2 * F if activation == "swiglu" else F
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    x, w13, w2 = (torch.randn(*s, generator=g).mul_(c).to(dt)
                  for s, c in (((T, D), 1.0), ((E, X, D), 0.1), ((E, D, F), 0.1)))
    probs_TK, grad_TD = torch.rand(T, K, generator=g), torch.randn(T, D, generator=g)
    args = (x, ids_TK, dropped_TK, probs_TK, w13, w2, activation, budget, dtype == "autocast",
            grad_TD)
    want = _run("pure", *args)
    assert bool(want[1]) == (budget < 1)
    arena = workspace.Arena(workspace.Workspace())
    with workspace.arena_scope(arena):
        first = _run("arena", *args)
        _poison_free_buffers(arena)
        again = _run("arena", *args)  # every reused buffer held NaN: nothing unwritten is read
    names = ("y", "overflow", "counts", "x.grad", "probs.grad", "w13.grad", "w2.grad")
    for got in (first, again):
        for name, a, b in zip(names, got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("budget", [2.0, 0.6])
@pytest.mark.parametrize("dtype", ["fp32", "autocast", "bf16"])
def test_arena_stages_equal_the_pure_pieces_with_probs_on_input(dtype, budget):
    # moe.apply_probs_on_input (top-1, as the config requires): the weights scale the rows in
    # stage 2 and stage 6 sums plainly; the weights' grads come from stage 2's backward.
    T, K, D, F, E = 40, 1, 16, 12, 8
    g = torch.Generator().manual_seed(11)
    ids_TK, dropped_TK = _routing(T, K, E, 0.2, g)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    x, w13, w2 = (torch.randn(*s, generator=g).mul_(c).to(dt)
                  for s, c in (((T, D), 1.0), ((E, 2 * F, D), 0.1), ((E, D, F), 0.1)))
    probs_TK, grad_TD = torch.rand(T, K, generator=g), torch.randn(T, D, generator=g)
    args = (x, ids_TK, dropped_TK, probs_TK, w13, w2, "swiglu", budget, dtype == "autocast",
            grad_TD, True)
    want = _run("pure", *args)
    arena = workspace.Arena(workspace.Workspace())
    with workspace.arena_scope(arena):
        _run("arena", *args)
        _poison_free_buffers(arena)
        got = _run("arena", *args)
    assert bool(want[1]) == (budget < 1) and want[4].abs().sum() > 0
    names = ("y", "overflow", "counts", "x.grad", "probs.grad", "w13.grad", "w2.grad")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
