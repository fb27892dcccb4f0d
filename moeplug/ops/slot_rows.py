"""to_slots / from_slots on the CPU: the sync-free layer's gather of token rows into its budget
slots and the weighted combine back (moeplug.moe.budgeted, stages 2 and 6), each one pass
of the runtime's row kernels, as the GPU runs them (moeplug.ops.cuda_ops.to_slots /
from_slots).

Legend: T tokens, K top-k, D hidden, S slots (the static buffer's rows).

``slot_TK[t, k]`` is the slot choice (t, k) owns, or -1 where it has none (dropped by the
router, or over the token budget); the others are distinct. Slots no choice owns are neither
read nor written: the experts never read past their routed rows either.

Why kernels: the torch form of stage 2 built a choice-per-slot table (a scatter), a padded copy
of x and an index_select; stage 6 an index_select into [T, K, D], a masked fill, a [T, 1, K] x
[T, K, D] batched GEMM and, backward, two more batched GEMMs and an index_copy. The kernels read
each row once and sum in fp32 with fp32 weights, as the dynamic path's unpermute does (the same
``weighted_row_sums``), so the static and dynamic layers also round alike.

Each op is a ``torch.library.custom_op`` (an opaque node of static shape when
``runtime.capture`` compiles the pure pieces) with autograd; the ``*_into`` functions are the
same kernels into given buffers (the eager form in the layer's arena,
moeplug.moe.budgeted.arena).
"""

from __future__ import annotations

from typing import Callable

import torch

from moeplug.ops._checks import check_index, check_rows, ptr
from moeplug.runtime import get_runtime


def slot_map(slot_N: torch.Tensor, num_slots: int, top_k: int,
             empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
             ) -> torch.Tensor:
    """[T, K] slots from moeplug.moe.budgeted.slots.slots' [N] ones: its dump slot (``num_slots``) -> -1.
    ``empty(shape, dtype)``: where the result and its mask come from (a workspace arena)."""
    if empty is None:
        return torch.where(slot_N < num_slots, slot_N, -1).view(-1, top_k)
    shape = tuple(slot_N.shape)
    dump_N = torch.ge(slot_N, num_slots, out=empty(shape, torch.bool))
    return empty(shape, torch.int64).copy_(slot_N).masked_fill_(dump_N, -1).view(-1, top_k)


def _dims(op: str, rows: torch.Tensor, rows_name: str, slot_TK: torch.Tensor,
          probs32_TK: torch.Tensor | None, token_rows: bool) -> dict[str, int]:
    """The kernel's sizes, after the checks that keep it inside its buffers (the slots' range
    and uniqueness are checked by the kernel). ``token_rows``: ``rows`` has one row a token."""
    code = check_rows(op, rows_name, rows, 2, "[rows, D]")
    check_index(op, "slot_TK", slot_TK, None, "[T, K]")
    T, K = slot_TK.shape
    if token_rows and rows.shape[0] != T:
        raise ValueError(f"{op}: {rows_name} has {rows.shape[0]} rows but slot_TK has {T} "
                         f"tokens. Fix: pass one row per token")
    if probs32_TK is not None and (probs32_TK.dtype != torch.float32
                                   or tuple(probs32_TK.shape) != (T, K)
                                   or not probs32_TK.is_contiguous()):
        raise ValueError(f"{op}: probs_TK must be a contiguous float32 [T, K] = {(T, K)} "
                         f"tensor, got {probs32_TK.dtype} {tuple(probs32_TK.shape)}. Fix: pass "
                         f"the routing weights as probs_TK.float().contiguous()")
    return {"num_tokens": T, "top_k": K, "hidden": rows.shape[1], "dtype": code}


def _same_rows(op: str, name: str, t: torch.Tensor, like: torch.Tensor, rows: int) -> None:
    if t.dtype != like.dtype or tuple(t.shape) != (rows, like.shape[1]) or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous {like.dtype} [{rows}, "
                         f"{like.shape[1]}] tensor, got {t.dtype} {tuple(t.shape)}. Fix: "
                         f"allocate it like the rows it receives")


def to_slots_into(x_TD: torch.Tensor, slot_TK: torch.Tensor, x_SD: torch.Tensor,
                  probs32_TK: torch.Tensor | None = None) -> None:
    """x_SD[slot[t, k]] = x_TD[t] for every slot >= 0, times p[t, k] when ``probs32_TK``
    (contiguous fp32) is given (x_SD contiguous, x's dtype)."""
    dims = _dims("to_slots", x_TD, "x_TD", slot_TK, probs32_TK, token_rows=True)
    _same_rows("to_slots", "x_SD", x_SD, x_TD, x_SD.shape[0])
    get_runtime().to_slots(x=x_TD.data_ptr(), slots=slot_TK.data_ptr(), probs=ptr(probs32_TK),
                           x_out=x_SD.data_ptr(), num_slots=x_SD.shape[0], **dims)


def from_slots_into(y_SD: torch.Tensor, slot_TK: torch.Tensor, probs32_TK: torch.Tensor | None,
                    y_TD: torch.Tensor) -> None:
    """y_TD[t] = sum_k p[t, k] * y_SD[slot[t, k]] over slots >= 0 (plain sum without probs:
    also to_slots' backward); ``probs32_TK`` contiguous fp32."""
    dims = _dims("from_slots", y_SD, "y_SD", slot_TK, probs32_TK, token_rows=False)
    _same_rows("from_slots", "y_TD", y_TD, y_SD, slot_TK.shape[0])
    get_runtime().from_slots(y=y_SD.data_ptr(), slots=slot_TK.data_ptr(), probs=ptr(probs32_TK),
                             y_out=y_TD.data_ptr(), num_slots=y_SD.shape[0], **dims)


def from_slots_backward_into(g_TD: torch.Tensor, y_SD: torch.Tensor | None,
                             slot_TK: torch.Tensor, probs32_TK: torch.Tensor | None,
                             g_SD: torch.Tensor | None, gp32_TK: torch.Tensor | None,
                             num_slots: int | None = None) -> None:
    """g_SD[slot[t, k]] = p[t, k] * g_TD[t] (slots no choice owns: unwritten; nothing when
    ``g_SD`` is None); with ``gp32_TK``: gp[t, k] = <g_TD[t], y_SD[slot[t, k]]>, 0 without a
    slot. ``num_slots``: the slot count when ``g_SD`` is None."""
    dims = _dims("from_slots_backward", g_TD, "grad_TD", slot_TK, probs32_TK, token_rows=True)
    if y_SD is not None:
        _same_rows("from_slots_backward", "y_SD", y_SD, g_TD, y_SD.shape[0])
    if g_SD is not None:
        _same_rows("from_slots_backward", "grad_SD", g_SD, g_TD, g_SD.shape[0])
    if y_SD is not None and g_SD is not None and y_SD.shape[0] != g_SD.shape[0]:
        raise ValueError(f"from_slots_backward: y_SD has {y_SD.shape[0]} slots, grad_SD "
                         f"{g_SD.shape[0]}. Fix: pass the grad of y_SD's own slots")
    get_runtime().from_slots_backward(
        grad=g_TD.data_ptr(), y=ptr(y_SD), slots=slot_TK.data_ptr(), probs=ptr(probs32_TK),
        grad_y=ptr(g_SD), grad_probs=ptr(gp32_TK),
        num_slots=g_SD.shape[0] if g_SD is not None else num_slots, **dims)


def slot_weight_grads_into(x_TD: torch.Tensor, g_SD: torch.Tensor, slot_TK: torch.Tensor,
                           probs32_TK: torch.Tensor, gp32_TK: torch.Tensor) -> None:
    """The weighted to_slots' grad of its weights: gp[t, k] = <x_TD[t], g_SD[slot[t, k]]>, 0
    without a slot (from_slots_backward's dot, with nothing written to rows)."""
    from_slots_backward_into(x_TD, g_SD, slot_TK, probs32_TK, None, gp32_TK, g_SD.shape[0])


# ---- the functional ops (the pure pieces; capture) ------------------------------------------

@torch.library.custom_op("moeplug::to_slots", mutates_args=(), device_types="cpu")
def to_slots(x_TD: torch.Tensor, slot_TK: torch.Tensor, num_slots: int,
             probs_TK: torch.Tensor | None = None) -> torch.Tensor:
    """[num_slots, D]: x_TD's rows at their slots, times their fp32 weights when ``probs_TK``
    is given (``moe.apply_probs_on_input``); the other rows unwritten."""
    x_SD = x_TD.new_empty(num_slots, x_TD.shape[1])
    to_slots_into(x_TD.contiguous(), slot_TK, x_SD,
                  None if probs_TK is None else probs_TK.contiguous())
    return x_SD


@to_slots.register_fake
def _(x_TD, slot_TK, num_slots, probs_TK=None):
    return x_TD.new_empty(num_slots, x_TD.shape[1])


@torch.library.custom_op("moeplug::to_slots_weight_grad", mutates_args=(), device_types="cpu")
def to_slots_weight_grad(x_TD: torch.Tensor, g_SD: torch.Tensor, slot_TK: torch.Tensor,
                         probs_TK: torch.Tensor) -> torch.Tensor:
    """The weighted :func:`to_slots`' grad of its weights, [T, K] fp32."""
    gp_TK = torch.empty(slot_TK.shape, dtype=torch.float32)
    slot_weight_grads_into(x_TD.contiguous(), g_SD.contiguous(), slot_TK,
                           probs_TK.contiguous(), gp_TK)
    return gp_TK


@to_slots_weight_grad.register_fake
def _(x_TD, g_SD, slot_TK, probs_TK):
    return torch.empty(slot_TK.shape, dtype=torch.float32)


def _to_slots_setup(ctx, inputs, output):
    x_TD, slot_TK, _, probs_TK = inputs
    weighted = probs_TK is not None
    ctx.save_for_backward(slot_TK, probs_TK, x_TD if weighted else None)


def _to_slots_backward(ctx, g_SD):
    slot_TK, probs_TK, x_TD = ctx.saved_tensors
    g_x = from_slots(g_SD, slot_TK, probs_TK)
    g_p = None
    if probs_TK is not None and ctx.needs_input_grad[3]:
        g_p = to_slots_weight_grad(x_TD, g_SD, slot_TK, probs_TK)
    return g_x, None, None, g_p


to_slots.register_autograd(_to_slots_backward, setup_context=_to_slots_setup)


@torch.library.custom_op("moeplug::from_slots", mutates_args=(), device_types="cpu")
def from_slots(y_SD: torch.Tensor, slot_TK: torch.Tensor, probs_TK: torch.Tensor | None
               ) -> torch.Tensor:
    """[T, D] in y's dtype: each token's rows summed, weighted by ``probs_TK`` (fp32) when
    given."""
    y_TD = y_SD.new_empty(slot_TK.shape[0], y_SD.shape[1])
    from_slots_into(y_SD.contiguous(), slot_TK,
                    None if probs_TK is None else probs_TK.contiguous(), y_TD)
    return y_TD


@from_slots.register_fake
def _(y_SD, slot_TK, probs_TK):
    return y_SD.new_empty(slot_TK.shape[0], y_SD.shape[1])


@torch.library.custom_op("moeplug::from_slots_backward", mutates_args=(), device_types="cpu")
def from_slots_backward(g_TD: torch.Tensor, y_SD: torch.Tensor, slot_TK: torch.Tensor,
                        probs_TK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of y_SD: the owned rows, the rest unwritten; grad of probs_TK, fp32 (zeros
    without probs))."""
    g_SD = y_SD.new_empty(y_SD.shape)
    gp_TK = torch.zeros(slot_TK.shape, dtype=torch.float32)
    from_slots_backward_into(g_TD.contiguous(), y_SD.contiguous(), slot_TK,
                             None if probs_TK is None else probs_TK.contiguous(), g_SD,
                             None if probs_TK is None else gp_TK)
    return g_SD, gp_TK


@from_slots_backward.register_fake
def _(g_TD, y_SD, slot_TK, probs_TK):
    return y_SD.new_empty(y_SD.shape), torch.empty(slot_TK.shape, dtype=torch.float32)


def _from_slots_setup(ctx, inputs, output):
    y_SD, slot_TK, probs_TK = inputs
    ctx.save_for_backward(y_SD, slot_TK, probs_TK)


def _from_slots_backward(ctx, g_TD):
    y_SD, slot_TK, probs_TK = ctx.saved_tensors
    g_SD, gp_TK = from_slots_backward(g_TD, y_SD, slot_TK, probs_TK)
    return g_SD, None, (gp_TK if probs_TK is not None else None)


from_slots.register_autograd(_from_slots_backward, setup_context=_from_slots_setup)
