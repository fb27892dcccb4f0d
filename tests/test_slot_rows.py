"""moeplug.ops.slot_rows (the sync-free layer's stages 2 and 6 on the CPU) against plain torch
index ops: values and every gradient, eager and under ``torch.compile(fullgraph=True)`` (the
capture path), with choices that own no slot (-1) and slots nobody owns."""

from __future__ import annotations

import pytest
import torch

from moeplug.ops import slot_rows

T, K, D, S = 37, 3, 70, 150  # D: a 64-column block and a tail in the kernels


def _case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slot_TK = torch.randperm(S, generator=g)[:T * K].view(T, K)
    slot_TK[torch.rand(T, K, generator=g) < 0.3] = -1  # dropped / over budget
    slot_TK[5] = -1  # a token with no slot at all: zeros
    x = torch.randn(T, D, generator=g).to(dtype)
    y = torch.randn(S, D, generator=g).to(dtype)
    p = torch.rand(T, K, generator=g)
    return slot_TK, x, y, p


def _reference(x, y, p, slot_TK):
    """The same maths as torch index ops, in fp32: x at the owned slots, and the weighted sum."""
    owned = slot_TK >= 0
    t_idx = torch.arange(T).unsqueeze(1).expand(T, K)[owned]
    x_S = torch.zeros(S, D).index_copy(0, slot_TK[owned], x.float()[t_idx])
    rows = y.float()[slot_TK.clamp(min=0)] * owned.unsqueeze(2)
    y_T = (p.unsqueeze(2) * rows).sum(1)
    return x_S, y_T, owned


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_to_and_from_slots_equal_torch_index_ops_with_grads(dtype, tol, compiled):
    if compiled:
        torch._dynamo.reset()  # every case compiles afresh (dynamo's recompile limit)
    slot_TK, x0, y0, p0 = _case(dtype)
    x, y, p = (t.clone().requires_grad_(True) for t in (x0, y0, p0))
    to_fn, from_fn = slot_rows.to_slots, slot_rows.from_slots
    if compiled:
        to_fn, from_fn = (torch.compile(f, fullgraph=True) for f in (to_fn, from_fn))
    x_S, y_T = to_fn(x, slot_TK, S), from_fn(y, slot_TK, p)
    xr, yr, pr = (t.detach().float().requires_grad_(True) for t in (x0, y0, p0))
    want_x_S, want_y_T, owned = _reference(xr, yr, pr, slot_TK)
    rows = slot_TK[owned]
    assert x_S.dtype == dtype and y_T.dtype == dtype
    assert torch.equal(x_S[rows].float(), want_x_S[rows])  # a copy: exact
    assert torch.equal(y_T[5], torch.zeros(D, dtype=dtype))
    scale = want_y_T.abs().max()
    assert float((y_T.detach().float() - want_y_T).abs().max() / scale) < tol
    gx_S, gy_T = torch.randn(S, D).to(dtype), torch.randn(T, D).to(dtype)
    ((x_S[rows].float() * gx_S[rows].float()).sum() + (y_T.float() * gy_T.float()).sum()
     ).backward()
    ((want_x_S[rows] * gx_S[rows].float()).sum() + (want_y_T * gy_T.float()).sum()).backward()
    for name, got, want in (("x", x.grad, xr.grad), ("y", y.grad[rows], yr.grad[rows]),
                            ("probs", p.grad, pr.grad)):
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err < tol, (name, err)
    assert torch.equal(p.grad[~owned], torch.zeros_like(p.grad[~owned]))  # no slot: weight 0


def test_rows_nobody_owns_are_neither_read_nor_written():
    slot_TK, x, y, p = _case(torch.float32, seed=1)
    owned = torch.zeros(S, dtype=torch.bool)
    owned[slot_TK[slot_TK >= 0]] = True
    poisoned = y.clone()
    poisoned[~owned] = float("nan")
    assert torch.equal(slot_rows.from_slots(poisoned, slot_TK, p),
                       slot_rows.from_slots(y, slot_TK, p))
    x_S = torch.full((S, D), 7.0)
    slot_rows.to_slots_into(x, slot_TK, x_S)
    assert torch.equal(x_S[~owned], torch.full_like(x_S[~owned], 7.0))


def test_slot_map_turns_the_dump_slot_into_no_row_and_bad_slots_are_named():
    slot_N = torch.tensor([0, 6, 3, 6, 5, 1])  # 6 = num_slots: the dump slot
    want = torch.tensor([[0, -1], [3, -1], [5, 1]])
    assert torch.equal(slot_rows.slot_map(slot_N, 6, 2), want)
    assert torch.equal(slot_rows.slot_map(slot_N, 6, 2, lambda s, d: torch.empty(s, dtype=d)),
                       want)
    y, p = torch.randn(6, 4), torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"slots\[0, 1\] = 6 is outside \[0, 6\) and not -1"):
        slot_rows.from_slots(y, slot_N.view(3, 2), p)
    with pytest.raises(ValueError, match=r"slots\[1, 1\] = 0 repeats an earlier entry"):
        slot_rows.from_slots(y, torch.tensor([[0, -1], [2, 0], [5, 1]]), p)
    # sizes the kernel would read past: named before any pointer reaches it
    with pytest.raises(ValueError, match=r"x_TD has 4 rows but slot_TK has 3 tokens"):
        slot_rows.to_slots(torch.randn(4, 4), slot_N.view(3, 2).clamp(max=5), 6)
    with pytest.raises(ValueError, match=r"probs_TK must be a contiguous float32 \[T, K\]"):
        slot_rows.from_slots(y, slot_N.view(3, 2).clamp(max=5), p.double())
    slot_TK = slot_rows.slot_map(slot_N, 6, 2)
    with pytest.raises(ValueError, match=r"x_SD must be a contiguous torch.float32 \[6, 4\] "
                                         r"tensor, got torch.bfloat16.*Fix: allocate it like"):
        slot_rows.to_slots_into(torch.randn(3, 4), slot_TK,
                                torch.empty(6, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"y_SD has 6 slots, grad_SD 7\. Fix: pass the grad of"):
        slot_rows.from_slots_backward_into(torch.randn(3, 4), y, slot_TK, p, torch.empty(7, 4),
                                           torch.empty(3, 2))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_weighted_to_slots_equals_torch_with_the_weights_grads(dtype, tol, compiled):
    # moe.apply_probs_on_input: x_S[slot] = p * x[t]; grads of x and of the weights.
    if compiled:
        torch._dynamo.reset()
    slot_TK, x0, _, p0 = _case(dtype, seed=2)
    x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    fn = torch.compile(slot_rows.to_slots, fullgraph=True) if compiled else slot_rows.to_slots
    x_S = fn(x, slot_TK, S, p)
    xr, pr = x0.detach().float().requires_grad_(True), p0.clone().requires_grad_(True)
    owned = slot_TK >= 0
    rows = slot_TK[owned]
    t_idx = torch.arange(T).unsqueeze(1).expand(T, K)[owned]
    want = torch.zeros(S, D).index_copy(0, rows, xr[t_idx] * pr[owned].unsqueeze(1))
    assert float((x_S[rows].detach().float() - want[rows]).abs().max()
                 / want[rows].abs().max()) < tol
    g_S = torch.randn(S, D).to(dtype)
    (x_S[rows].float() * g_S[rows].float()).sum().backward()
    (want[rows] * g_S[rows].float()).sum().backward()
    for name, got, ref in (("x", x.grad, xr.grad), ("probs", p.grad, pr.grad)):
        err = float((got.float() - ref).abs().max() / ref.abs().max())
        assert err < tol, (name, err)
    assert torch.equal(p.grad[~owned], torch.zeros_like(p.grad[~owned]))
