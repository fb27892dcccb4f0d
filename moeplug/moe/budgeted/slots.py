"""The budgeted dispatcher's stages 1, 2 and 6 as pure functions of tensors and ints: what
``runtime.capture`` compiles (torch.compile fullgraph on the CPU) or records (CUDA graphs), what
a GPU runs eagerly, and what the CPU's eager form (moeplug.moe.budgeted.arena) equals op for op.

Legend: T tokens, K top-k, N = T*K choices, D hidden, E experts (global), W EP ranks,
L = E/W local experts, C budget rows per (source rank, expert).

    C = ceil(T*K/E * runtime.token_budget)
Every shape follows from (T, K, D, E, W, C), never from the routing, so nothing waits for the
device to learn a size (no ``.item()``/``.tolist()``/``.cpu()``, no ``nonzero``, no split
from a count exchange):
    1. slots     each choice's position among its expert's choices on this rank, in token
                 order (a stable sort); the first C get slot e*C + pos, the rest the dump slot
                 E*C and raise ``overflow`` (a device bool the trainer reads where the step
                 syncs anyway, then reruns the step on the dynamic path: no token is lost).
                 Packed (the CPU's layout): inside each EP rank's chunk of L*C slots, expert
                 e's kept choices right after expert e-1's, so the experts compute only the
                 routed rows (Experts.forward_packed)
    2. gather    x_ECD: the chosen rows at their slots (zero rows where a slot is empty, or on
                 the CPU unwritten, as nothing reads them)
    6. combine   y_TD = sum_k p_tk * y_ECD[slot_tk] (weight 0 for the dump slot), or a plain
                 sum when the experts already applied the weights (budget rows: they get each
                 slot's weight, 0 for an empty one)
Stages 3-5 (the exchange to the experts' ranks, the experts, the way back) are
moeplug.moe.budgeted.exchange and the layer's experts stage. Choices the router dropped
(``dropped_TK``, its own capacity) take the dump slot without raising the flag.
"""

from __future__ import annotations

import math

import torch

from moeplug.ops import slot_rows


def budget_rows(num_tokens: int, top_k: int, num_experts: int, token_budget: float) -> int:
    """C = ceil(T*K/E * token_budget): rows each rank may send each expert."""
    return max(1, math.ceil(num_tokens * top_k / num_experts * token_budget))


def slots(ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None, num_experts: int,
          budget: int, packed: bool = False, ep_size: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1: (slot_N, overflow, counts_E). slot_N in [0, E*C]; E*C is the dump slot.
    ``counts_E`` counts the choices each expert received (dropped and over-budget excluded).
    ``packed``: inside each EP rank's chunk of L*C slots (``ep_size`` chunks), expert e's kept
    choices take the slots right after expert e-1's (the chunk's first rows, expert-major)
    instead of slots e*C.. (padding inside each expert's block); same shapes, for the grouped
    GEMM over just the routed rows."""
    E, C = num_experts, budget
    ids_N = ids_TK.reshape(-1)
    key_N = ids_N if dropped_TK is None else ids_N.masked_fill(dropped_TK.reshape(-1), E)
    n = key_N.shape[0]
    wanted_E1 = torch.zeros(E + 1, dtype=torch.int64, device=ids_N.device).scatter_add_(
        0, key_N, torch.ones_like(key_N))
    start_E1 = torch.cumsum(wanted_E1, 0) - wanted_E1
    order_N = torch.argsort(key_N, stable=True)  # token order inside each expert
    pos_sorted = torch.arange(n, device=ids_N.device) - start_E1.index_select(
        0, key_N.index_select(0, order_N))
    pos_N = torch.empty_like(pos_sorted).scatter_(0, order_N, pos_sorted)
    routed_N = key_N < E
    keep_N = routed_N & (pos_N < C)
    overflow = (routed_N & ~keep_N).any()
    counts_E = torch.minimum(wanted_E1[:E], torch.full_like(wanted_E1[:E], C))
    if packed:  # per chunk: its start + the exclusive cumsum of its experts' kept counts
        W = ep_size
        counts_WL = counts_E.view(W, E // W)
        base_WL = torch.cumsum(counts_WL, 1) - counts_WL + torch.arange(
            W, device=ids_N.device).unsqueeze(1) * (E // W * C)
        base_E1 = torch.cat([base_WL.reshape(E), base_WL.new_zeros(1)])  # E: the dump key
    else:
        base_E1 = torch.arange(E + 1, device=ids_N.device) * C
    slot_N = torch.where(keep_N, base_E1.index_select(0, key_N) + pos_N,
                         torch.full_like(key_N, E * C))
    return slot_N, overflow, counts_E


def gather_rows(x_TD: torch.Tensor, slot_N: torch.Tensor, top_k: int, num_slots: int,
                probs_TK: torch.Tensor | None = None, zeros: bool = False) -> torch.Tensor:
    """Stage 2: x_ECD [E*C, D], zeros in empty slots (on the CPU: unwritten, as nothing
    reads them, unless ``zeros``); rows times their weight when ``probs_TK`` is given
    (``moe.apply_probs_on_input``)."""
    if x_TD.device.type == "cpu" and not zeros:  # the runtime's row kernel (fp32 weights)
        return slot_rows.to_slots(x_TD, slot_rows.slot_map(slot_N, num_slots, top_k),
                                  num_slots, None if probs_TK is None else probs_TK.float())
    n = slot_N.shape[0]
    choice_S1 = torch.full((num_slots + 1,), n, dtype=torch.int64, device=slot_N.device)
    choice_S1 = choice_S1.scatter(0, slot_N, torch.arange(n, device=slot_N.device))
    choice_S = choice_S1[:num_slots]  # the dump slot's duplicates are cut here
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
    rows = x_pad.index_select(0, torch.div(choice_S, top_k, rounding_mode="floor"))
    if probs_TK is None:
        return rows
    p_pad = torch.cat([probs_TK.reshape(-1), probs_TK.new_zeros(1)])
    return rows * p_pad.index_select(0, choice_S).unsqueeze(1).to(rows.dtype)


def combine_rows(y_ECD: torch.Tensor, slot_N: torch.Tensor, probs_TK: torch.Tensor,
                 weighted_input: bool = False, zeros: bool = False) -> torch.Tensor:
    """Stage 6: y_TD = sum_k p_tk * y_ECD[slot_tk], weight 0 for the dump slot; a plain sum
    over the kept slots when the rows already carry their weights (``weighted_input``). The
    gradient of an empty slot is zero (on the CPU: unwritten, as nothing reads it, unless
    ``zeros``)."""
    T, K = probs_TK.shape
    num_slots = y_ECD.shape[0]
    if y_ECD.device.type == "cpu" and not zeros:  # the runtime's row kernel: fp32 sums
        return slot_rows.from_slots(y_ECD, slot_rows.slot_map(slot_N, num_slots, K),
                                    None if weighted_input else probs_TK.float())
    if weighted_input:
        probs_TK = torch.ones_like(probs_TK)
    # The dump slot reads the last slot, masked to zero (no [E*C+1, D] padded copy of y): with
    # packed slots that row may be one the grouped GEMM never wrote, and 0 * NaN is NaN.
    keep_TK = (slot_N < num_slots).view(T, K)
    y_TKD = y_ECD.index_select(0, slot_N.clamp(max=num_slots - 1)).view(T, K, -1)
    y_TKD = torch.where(keep_TK.unsqueeze(2), y_TKD, 0)
    p_T1K = (probs_TK * keep_TK).to(y_TKD.dtype).unsqueeze(1)
    return torch.bmm(p_T1K, y_TKD).squeeze(1)


def front(x_TD: torch.Tensor, ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
          probs_TK: torch.Tensor, num_experts: int, budget: int, weighted_input: bool,
          packed: bool = False, ep_size: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1-2 of the packed layout: (x_ECD, slot_N, overflow, counts_E); the rows times
    their weight with ``weighted_input`` (``moe.apply_probs_on_input``)."""
    slot_N, overflow, counts_E = slots(ids_TK, dropped_TK, num_experts, budget, packed, ep_size)
    x_ECD = gather_rows(x_TD, slot_N, ids_TK.shape[1], num_experts * budget,
                        probs_TK if weighted_input else None)
    return x_ECD, slot_N, overflow, counts_E


def back(y_ECD: torch.Tensor, slot_N: torch.Tensor, probs_TK: torch.Tensor,
         weighted_input: bool) -> torch.Tensor:
    """Stage 6 of the packed layout (``weighted_input``: the weights are already on the rows)."""
    return combine_rows(y_ECD, slot_N, probs_TK, weighted_input)


def fixed_front(x_TD: torch.Tensor, ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                probs_TK: torch.Tensor, num_experts: int, budget: int, kernels: bool
                ) -> tuple[torch.Tensor, ...]:
    """Stages 1-2 of budget rows (Experts.budget_rows: every expert C slots a source rank):
    (x_ECD, p_S, slot_N, overflow, counts_E) with zero rows and weight 0 in the empty slots.
    ``kernels``: the runtime's CUDA slot kernel spreads each token to its slots in one pass
    (the torch form gathers [E*C, D] by index, with an atomic index_add backward)."""
    E, C = num_experts, budget
    slot_N, overflow, counts_E = slots(ids_TK, dropped_TK, E, C)
    if kernels:
        from moeplug.ops import cuda_ops
        x_ECD = cuda_ops.to_slots(x_TD, slot_rows.slot_map(slot_N, E * C, ids_TK.shape[1]),
                                  E * C)
    else:
        x_ECD = gather_rows(x_TD, slot_N, ids_TK.shape[1], E * C, zeros=True)
    return x_ECD, slot_probs(probs_TK, slot_N, E * C), slot_N, overflow, counts_E


def fixed_back(y_ECD: torch.Tensor, slot_N: torch.Tensor, probs_TK: torch.Tensor,
               kernels: bool) -> torch.Tensor:
    """Stage 6 of budget rows: each token's K slots summed (the experts applied the weights);
    ``kernels``: the runtime's CUDA slot sum, one pass."""
    if kernels:
        from moeplug.ops import cuda_ops
        return cuda_ops.from_slots(y_ECD, slot_rows.slot_map(slot_N, y_ECD.shape[0],
                                                             probs_TK.shape[1]))
    # zeros: the experts' backward reads every row's gradient, the empty slots' too
    return combine_rows(y_ECD, slot_N, probs_TK, weighted_input=True, zeros=True)


def slot_probs(probs_TK: torch.Tensor, slot_N: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[num_slots] each slot's routing weight, 0 where no choice landed (the dump slot E*C
    takes the over-budget choices and is cut); differentiable in ``probs_TK``."""
    p_S1 = probs_TK.new_zeros(num_slots + 1).scatter(0, slot_N, probs_TK.reshape(-1))
    return p_S1[:num_slots]


