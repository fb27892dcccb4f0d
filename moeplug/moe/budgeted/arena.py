"""The budgeted dispatcher's stages 1, 2 and 6 in eager CPU form, packed: the ops of the pure
pieces (moeplug.moe.budgeted.slots) into the running layer's workspace arena.

Legend as in slots: T tokens, K top-k, N = T*K choices, D hidden, E experts, W EP ranks,
L = E/W local experts, C budget rows, S = L*C slots a chunk.

Why a second form: the pure pieces are what ``runtime.capture`` compiles and what a GPU runs,
so they stay functional (every op returns a fresh tensor). Run eagerly on the CPU they
allocated ~65 buffers a layer and micro-batch (263 in two steps of a 2-layer model; 287 with
the paged stash), so the stash's promise - after warm-up the MoE path allocates nothing - did
not hold in the mode it was made for. Each stage here is the pure piece's kernels into arena
buffers, inside an autograd Function whose backward runs what autograd runs for the pure
piece, so results and gradients equal the pure pieces' (``torch.equal``:
tests/test_static_arena.py) and the host-sync counter sees the same work. Stage 1 is the
runtime's ``budget_slots`` kernel (two counting passes over the choices; the torch form of
:func:`slots.slots` is a stable sort plus a dozen [N] temporaries), whose integers equal
``slots.slots``'s; stages 2 and 6 are the runtime's slot kernels (moeplug.ops.slot_rows),
which the pure pieces run too. The experts between them (stage 4) are the experts backend's
``forward_packed`` (moeplug.ops.grouped_ffn for the built-in one).

Used for every eager CPU layer, ``moe.apply_probs_on_input`` included (its weights scale the
rows in stage 2).
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug.ops import slot_rows
from moeplug.runtime import workspace
from moeplug.ops._grouped import cast
from moeplug.routing import sink_dropped
from moeplug.runtime import get_runtime

_empty = workspace.empty


def slots(ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, num_experts: int, budget: int,
          ep_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1, packed: (slot_N, overflow, counts_E) as ``slots.slots(..., packed=True,
    ep_size=W)`` returns them (overflow a 0-d bool), from the arena."""
    return _budget_slots(ids_TK, dropped_TK, num_experts, budget, ep_size)[:3]


def _budget_slots(ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, num_experts: int,
                  budget: int, ep_size: int) -> tuple[torch.Tensor, ...]:
    """:func:`slots` and ``wanted_E``, each expert's choices before the budget cut (a view of
    the kernel's scratch, whose first E counters end at those counts: row_plan.cpp)."""
    E = num_experts
    key_N = sink_dropped(ids_TK, dropped_TK, E).reshape(-1).contiguous()
    n = key_N.numel()
    slot_N, counts_E = _empty((n,), torch.int64), _empty((E,), torch.int64)
    overflow, scratch = _empty((), torch.bool), _empty((2 * E + 1,), torch.int64)
    get_runtime().budget_slots(key=key_N.data_ptr(), num_choices=n, num_experts=E,
                               budget=budget, chunks=ep_size, packed=True,
                               scratch=scratch.data_ptr(), slot=slot_N.data_ptr(),
                               counts=counts_E.data_ptr(), overflow=overflow.data_ptr())
    return slot_N, overflow, counts_E, scratch[:E]


def _fp32(probs_TK: torch.Tensor | None) -> torch.Tensor | None:
    """The routing weights as the slot kernels read them: contiguous fp32 (from the arena)."""
    if probs_TK is None:
        return None
    p = probs_TK if probs_TK.dtype == torch.float32 else cast(probs_TK, torch.float32)
    return p.contiguous()


class _ToSlots(torch.autograd.Function):
    """Stage 2 (``slots.gather_rows``): x_SD[slot[t, k]] = x_TD[t], times p[t, k] with
    ``moe.apply_probs_on_input``, the runtime's to_slots kernel; backward its from_slots sum
    (weighted alike) and the weights' dot products (moeplug.ops.slot_rows)."""

    @staticmethod
    def forward(ctx, x_TD, slot_TK, num_slots, probs_TK):
        x_TD, p32_TK = x_TD.contiguous(), _fp32(probs_TK)
        x_SD = _empty((num_slots, x_TD.shape[1]), x_TD.dtype)
        slot_rows.to_slots_into(x_TD, slot_TK, x_SD, p32_TK)
        weight_grad = probs_TK is not None and ctx.needs_input_grad[3]
        ctx.save_for_backward(slot_TK, p32_TK, x_TD if weight_grad else None)
        ctx.probs_dtype = None if probs_TK is None else probs_TK.dtype
        ctx.arena = workspace.current_arena()
        return x_SD

    @staticmethod
    def backward(ctx, g_SD):
        slot_TK, p32_TK, x_TD = ctx.saved_tensors
        g_SD = g_SD.contiguous()
        with workspace.ctx_arena(ctx):
            g_TD = _empty((slot_TK.shape[0], g_SD.shape[1]), g_SD.dtype)
            slot_rows.from_slots_into(g_SD, slot_TK, p32_TK, g_TD)
            g_p = None
            if x_TD is not None:
                gp32_TK = _empty(tuple(slot_TK.shape), torch.float32)
                slot_rows.slot_weight_grads_into(x_TD, g_SD, slot_TK, p32_TK, gp32_TK)
                g_p = cast(gp32_TK, ctx.probs_dtype)
        return g_TD, None, None, g_p


class _FromSlots(torch.autograd.Function):
    """Stage 6 (``slots.combine_rows``): y_TD = sum_k p_tk * y_SD[slot_tk] over the
    choices with a slot (a plain sum without probs: the rows were weighted in stage 2), the
    runtime's from_slots kernel (fp32 sums and weights); backward its from_slots_backward
    (moeplug.ops.slot_rows)."""

    @staticmethod
    def forward(ctx, y_SD, slot_TK, probs_TK):
        y_SD, p32_TK = y_SD.contiguous(), _fp32(probs_TK)
        y_TD = _empty((slot_TK.shape[0], y_SD.shape[1]), y_SD.dtype)
        slot_rows.from_slots_into(y_SD, slot_TK, p32_TK, y_TD)
        ctx.save_for_backward(y_SD, slot_TK, p32_TK)
        ctx.probs_dtype = None if probs_TK is None else probs_TK.dtype
        ctx.arena = workspace.current_arena()
        return y_TD

    @staticmethod
    def backward(ctx, g_TD):
        y_SD, slot_TK, p32_TK = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            g_SD = _empty(tuple(y_SD.shape), y_SD.dtype)
            weight_grad = p32_TK is not None and ctx.needs_input_grad[2]
            gp32_TK = _empty(tuple(slot_TK.shape), torch.float32) if weight_grad else None
            slot_rows.from_slots_backward_into(g_TD.contiguous(), y_SD, slot_TK, p32_TK, g_SD,
                                               gp32_TK)
            g_p = None if gp32_TK is None else cast(gp32_TK, ctx.probs_dtype)
        return g_SD, None, g_p


def region_front(x_TD: torch.Tensor, routing: Any, *, num_experts: int, budget: int,
                 weighted_input: bool, ep_size: int) -> tuple[torch.Tensor, ...]:
    """Stages 1-2: (x_ECD, counts_E, wanted_E, slot_TK, overflow), the rows in their packed
    slots; ``wanted_E`` each expert's choices before the budget cut (the arena's: read it
    before the next step)."""
    E, C = num_experts, budget
    slot_N, overflow, counts_E, wanted_E = _budget_slots(routing.ids_TK, routing.dropped_TK,
                                                         E, C, ep_size)
    slot_TK = slot_rows.slot_map(slot_N, E * C, routing.ids_TK.shape[1], _empty)
    x_ECD = _ToSlots.apply(x_TD, slot_TK, E * C, routing.probs_TK if weighted_input else None)
    return x_ECD, counts_E, wanted_E, slot_TK, overflow


def region_back(y_ECD: torch.Tensor, slot_TK: torch.Tensor, probs_TK: torch.Tensor,
                weighted_input: bool) -> torch.Tensor:
    """Stage 6: y_TD (a plain sum when the rows were weighted in stage 2)."""
    return _FromSlots.apply(y_ECD, slot_TK, None if weighted_input else probs_TK)
