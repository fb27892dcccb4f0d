"""Sync-free MoE: the dispatch -> experts -> combine stages with static shapes and no host
synchronisation (``runtime.sync_free``).

Legend: T tokens, K top-k, N = T*K choices, D hidden, E experts (global), W EP ranks,
L = E/W local experts, C budget rows per (source rank, expert), B = W*C rows per local expert
(P*W*C under expert tensor parallelism over P ranks), X FC1 rows (2F gated, F plain), F FFN
hidden (this rank's F/P slice under ETP).

    C = ceil(T*K/E * runtime.token_budget)
Every shape follows from (T, K, D, E, W, C), never from the routing, so nothing waits for the
device to learn a size (no ``.item()``/``.tolist()``/``.cpu()``, no ``nonzero``, no split
from a count exchange) and the region can be captured once and replayed (moeplug.syncfree):
    1. slots     each choice's position among its expert's choices on this rank, in token
                 order (a stable sort); the first C get slot e*C + pos, the rest the dump slot
                 E*C and raise ``overflow`` (a device bool the trainer reads where the step
                 syncs anyway, then reruns the step on the dynamic path: no token is lost)
    2. gather    x_ECD: the chosen rows at their slots, zero rows where a slot is empty
                 (the CPU: one pass of a runtime kernel, empty slots left unwritten)
    3. exchange  [W, L*C, D] chunks to the rank owning the experts: equal splits, known
                 without any count (identity at one rank) -> x_LBD, expert-major,
                 source-rank-major (CPU: the chunks as they came, and their [W, L] counts);
                 under ETP then all-gathered over the P ranks holding the experts' F-slices
    4. experts   y_LBD = down(act(x_LBD @ gate_up^T)) as two batched GEMMs (padding rows are
                 zeros; their outputs are never read). On the CPU the slots are packed
                 (inside each rank's chunk, expert e's right after expert e-1's), the counts
                 cross EP beside the rows, and the GEMMs are grouped over just the routed
                 rows (moeplug.ops.grouped_rows_mm): no padding FLOPs
    5. back      the inverse exchange -> y_ECD on the source rank (under ETP first the sum of
                 the P partial outputs, reduce-scattered)
    6. combine   y_TD = sum_k p_tk * y_ECD[slot_tk] (weight 0 for the dump slot; the CPU:
                 one pass of a runtime kernel, moeplug.ops.slot_rows)
Choices the router dropped (``dropped_TK``, its own capacity) take the dump slot without
raising the flag. The routing weight multiplies each expert output in combine (equal to the
dynamic experts' weighting of the activation: FC2 is linear), so it never crosses ranks.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch

from moeplug.modules import static_arena
from moeplug.ops import cuda_ops, slot_rows
from moeplug.ops._grouped import compute_dtype
from moeplug.ops.activations import activation_fn
from moeplug.ops.grouped_ffn import grouped_ffn_packed
from moeplug.ops.offload_marks import note
from moeplug.parallel import comm
from moeplug.quant import active_recipe, quant_expert_rows
from moeplug.quant.wire import quantized_exchange


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


def _to_compute_dtype(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x`` and the weights in the autocast dtype when autocast is on (the custom op is not
    an autocast op), else as they are."""
    dtype = compute_dtype(x)
    return tuple(t.to(dtype) for t in (x, *weights))


def _bmm(x_LBK: torch.Tensor, w_LNK: torch.Tensor) -> torch.Tensor:
    """x @ w^T per expert, batched over [L, B, K] (every budget slot)."""
    return torch.bmm(x_LBK, w_LNK.transpose(1, 2))


def experts_ffn(x_LBD: torch.Tensor, w13_LXD: torch.Tensor, w2_LDF: torch.Tensor,
                activation: str) -> torch.Tensor:
    """Stage 4: every local expert's FFN as two batched GEMMs (autocast picks their dtype)."""
    return _bmm(activation_fn(activation)(_bmm(x_LBD, w13_LXD)), w2_LDF)


class _StashedExperts(torch.autograd.Function):
    """Stage 4 of the batched layout for the paged stash (``runtime.stash``, eager; a GPU):
    it saves the expert input [L, B, D] and FC1 output as 2-D rows, the layout moeplug.stash
    packs into its pages (static shapes, so the same pages every step), and rebuilds the
    activation from h in backward. GEMMs in the autocast dtype; grads come back in each
    input's own dtype. (The CPU's packed chunks: static_arena's packed experts.)"""

    @staticmethod
    def forward(ctx, x_LBD, w13_LXD, w2_LDF, activation):
        x_c, w13_c, w2_c = (t.contiguous() for t in _to_compute_dtype(x_LBD, w13_LXD, w2_LDF))
        L, B, D = x_c.shape
        with torch.autocast(x_c.device.type, enabled=False):
            h_LBX = _bmm(x_c, w13_c)
            y_LBD = _bmm(activation_fn(activation)(h_LBX), w2_c)
        ctx.save_for_backward(x_c.view(L * B, D), h_LBX.view(L * B, -1), w13_c, w2_c)
        ctx.activation = activation
        ctx.dtypes = (x_LBD.dtype, w13_LXD.dtype, w2_LDF.dtype)
        return y_LBD

    @staticmethod
    def backward(ctx, g_LBD):
        x_SD, h_SX, w13_c, w2_c = ctx.saved_tensors
        L = g_LBD.shape[0]
        x_LBD, h_LBX = x_SD.view(L, -1, x_SD.shape[1]), h_SX.view(L, -1, h_SX.shape[1])
        g_LBD = g_LBD.to(x_LBD.dtype).contiguous()
        with torch.autocast(x_LBD.device.type, enabled=False):
            with torch.enable_grad():  # the activation's derivative by autograd (elementwise)
                h = h_LBX.detach().requires_grad_()
                a_LBF = activation_fn(ctx.activation)(h)
            g_a = torch.bmm(g_LBD, w2_c)
            g_w2 = torch.bmm(g_LBD.transpose(1, 2), a_LBF.detach())
            (g_h,) = torch.autograd.grad(a_LBF, h, g_a)
            g_x, g_w13 = torch.bmm(g_h, w13_c), torch.bmm(g_h.transpose(1, 2), x_LBD)
        x_dtype, w13_dtype, w2_dtype = ctx.dtypes
        return g_x.to(x_dtype), g_w13.to(w13_dtype), g_w2.to(w2_dtype), None


def stashed_experts_ffn(x_LBD: torch.Tensor, w13_LXD: torch.Tensor, w2_LDF: torch.Tensor,
                        activation: str) -> torch.Tensor:
    """Stage 4 with 2-D saved activations for the paged stash (see _StashedExperts)."""
    return _StashedExperts.apply(x_LBD, w13_LXD, w2_LDF, activation)


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


def to_experts(x_ECD: torch.Tensor, num_local: int, budget: int, ep_size: int,
               group: Any) -> torch.Tensor:
    """Stage 3: [E*C, D] on each rank -> x_LBD [L, W*C, D] on the experts' rank."""
    W, L, C, D = ep_size, num_local, budget, x_ECD.shape[1]
    if W > 1:  # equal chunks of L*C rows: every split is known without asking the device
        x_ECD = comm.all_to_all(x_ECD, [L * C] * W, [L * C] * W, group)
    # arrival [W (source), L, C, D] -> [L, W, C, D]: each expert's rows, source-rank-major
    return x_ECD.view(W, L, C, D).transpose(0, 1).reshape(L, W * C, D)


def from_experts(y_LBD: torch.Tensor, budget: int, ep_size: int, group: Any) -> torch.Tensor:
    """Stage 5, the inverse of :func:`to_experts`: y_LBD -> y_ECD on the source rank."""
    W, C = ep_size, budget
    L, _, D = y_LBD.shape
    y_ECD = y_LBD.view(L, W, C, D).transpose(0, 1).reshape(W * L * C, D)
    if W > 1:
        y_ECD = comm.all_to_all(y_ECD, [L * C] * W, [L * C] * W, group)
    return y_ECD


def etp_gather(x_LBD: torch.Tensor, etp_group: Any) -> torch.Tensor:
    """Stage 3 under expert tensor parallelism (P ranks holding F-slices of the same experts):
    every ETP rank's x_LBD, all-gathered -> [L, P*B, D], each expert's rows ETP-rank-major.
    Backward sums the P ranks' partial grads (a reduce-scatter). Identity without ETP."""
    P = comm.group_size(etp_group)
    if P == 1:
        return x_LBD
    L, B, D = x_LBD.shape
    x_PLBD = comm.all_gather(x_LBD.reshape(L * B, D), etp_group, [L * B] * P).view(P, L, B, D)
    return x_PLBD.transpose(0, 1).reshape(L, P * B, D)


def etp_reduce(y_LBD: torch.Tensor, etp_group: Any) -> torch.Tensor:
    """The inverse of :func:`etp_gather`: [L, P*B, D] partial outputs -> their sum over the ETP
    group, this rank's B rows of each expert (a reduce-scatter; backward all-gathers)."""
    P = comm.group_size(etp_group)
    if P == 1:
        return y_LBD
    L, PB, D = y_LBD.shape
    y_PLBD = y_LBD.view(L, P, PB // P, D).transpose(0, 1).reshape(P * L * (PB // P), D)
    return comm.reduce_scatter(y_PLBD, etp_group).view(L, PB // P, D)


# ---- the static region: stages 1-6 as pure functions of tensors and ints --------------------
# Pure so that moeplug.replay can capture them (torch.compile fullgraph on the CPU); the EP
# exchange sits between two captured pieces because a process-group call is not capturable.

def front(x_TD: torch.Tensor, ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
          probs_TK: torch.Tensor, num_experts: int, budget: int, weighted_input: bool,
          packed: bool = False, ep_size: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1-2: (x_ECD, slot_N, overflow, counts_E)."""
    slot_N, overflow, counts_E = slots(ids_TK, dropped_TK, num_experts, budget, packed, ep_size)
    x_ECD = gather_rows(x_TD, slot_N, ids_TK.shape[1], num_experts * budget,
                        probs_TK if weighted_input else None)
    return x_ECD, slot_N, overflow, counts_E


def back(y_ECD: torch.Tensor, slot_N: torch.Tensor, probs_TK: torch.Tensor,
         weighted_input: bool) -> torch.Tensor:
    """Stage 6 (``weighted_input``: the weights are already on the rows)."""
    return combine_rows(y_ECD, slot_N, probs_TK, weighted_input)


def one_rank(x_TD: torch.Tensor, ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
             probs_TK: torch.Tensor, w13_LXD: torch.Tensor, w2_LDF: torch.Tensor,
             num_experts: int, budget: int, activation: str, weighted_input: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1-6 at one EP rank (the exchanges are views): (y_TD, overflow, counts_E).
    On the CPU the slots are packed and the experts compute only the routed rows."""
    if activation == "swiglu" and not weighted_input and cuda_ops.available(x_TD):
        return _one_rank_fused(x_TD, ids_TK, dropped_TK, probs_TK, w13_LXD, w2_LDF,
                               num_experts, budget)
    if x_TD.device.type == "cpu":
        x_SD, slot_N, overflow, counts_E = front(x_TD, ids_TK, dropped_TK, probs_TK,
                                                 num_experts, budget, weighted_input, True)
        y_SD = grouped_ffn_packed(x_SD.unsqueeze(0), counts_E.view(1, -1), w13_LXD, w2_LDF,
                                  activation)[0]
        return back(y_SD, slot_N, probs_TK, weighted_input), overflow, counts_E
    x_ECD, slot_N, overflow, counts_E = front(x_TD, ids_TK, dropped_TK, probs_TK, num_experts,
                                              budget, weighted_input)
    y_LBD = experts_ffn(to_experts(x_ECD, num_experts, budget, 1, None), w13_LXD, w2_LDF,
                        activation)
    y_TD = back(from_experts(y_LBD, budget, 1, None), slot_N, probs_TK, weighted_input)
    return y_TD, overflow, counts_E


def _one_rank_fused(x_TD: torch.Tensor, ids_TK: torch.Tensor, dropped_TK: torch.Tensor | None,
                    probs_TK: torch.Tensor, w13_EXD: torch.Tensor, w2_EDF: torch.Tensor,
                    num_experts: int, budget: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`one_rank` on a GPU with the runtime's CUDA kernels, as the dynamic path runs:
    stage 2 spreads each token to its slots in one pass (zeros elsewhere), the routing weight
    rides in the fused SwiGLU (0 on empty slots), stage 6 sums each token's K slots in one
    pass. The torch version gathers [E*C, D] by index, and combines through a [T, K, D] copy
    and T tiny GEMMs, both with atomic index_add backwards."""
    T, K = ids_TK.shape
    E, C = num_experts, budget
    slot_N, overflow, counts_E = slots(ids_TK, dropped_TK, E, C)
    slot_TK = torch.where(slot_N < E * C, slot_N, -1).view(T, K)  # -1: dropped, no row
    # Each slot's routing weight (fp32, as the router's), 0 where no choice landed; the dump
    # slot E*C takes the over-budget choices and is cut.
    p_S = probs_TK.new_zeros(E * C + 1, dtype=torch.float32).scatter(
        0, slot_N, probs_TK.reshape(-1).float())[:E * C]
    x_SD = cuda_ops.to_slots(x_TD, slot_TK, E * C)
    h_EC2F = torch.bmm(x_SD.view(E, C, -1), w13_EXD.transpose(1, 2))
    a_SF = cuda_ops.swiglu(h_EC2F.view(E * C, -1), p_S)
    y_ECD = torch.bmm(a_SF.view(E, C, -1), w2_EDF.transpose(1, 2))
    return cuda_ops.from_slots(y_ECD.view(E * C, -1), slot_TK), overflow, counts_E


class PackedExchange:
    """Stages 3 and 5 of the CPU's packed layout: W equal chunks of L*C rows to the ranks
    owning their experts, with each source's kept counts per local expert (a [W, L] exchange of
    static shape: the grouped GEMM's kernel reads them, nothing waits on the host), and the
    rows back. At one rank both are views.

    With expert tensor parallelism (``etp_group`` of P ranks, each holding an F-slice of the
    same experts) the arrived chunks are then all-gathered over ETP: P*W chunks, each with its
    own counts, so the grouped GEMMs need no change; ``back`` first sums the P partial outputs
    and keeps this rank's chunks (a reduce-scatter), as Megatron's A2A(EP) -> AG(ETP) ->
    experts -> RS(ETP) -> A2A(EP) (moeplug.parallel.expert_tp). Every size stays static."""

    def __init__(self, chunk_rows: int, ep_size: int, group: Any, etp_group: Any = None):
        self.chunks, self.ep_size, self.group = [chunk_rows] * ep_size, ep_size, group
        self.etp_group, self.etp_size = etp_group, comm.group_size(etp_group)

    def __call__(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ep_size > 1:
            x_ECD = comm.all_to_all(x_ECD, self.chunks, self.chunks, self.group)
        return self._gathered(x_ECD, self._counts_exchanged(counts_WL))

    def back(self, y_ECD: torch.Tensor) -> torch.Tensor:
        y_ECD = self._reduced(y_ECD)
        if self.ep_size == 1:
            return y_ECD
        return comm.all_to_all(y_ECD, self.chunks, self.chunks, self.group)

    # Split in two for the chunked overlap (moeplug.modules.static_overlap): the rows travel
    # on the backend's threads between start and wait (comm.all_to_all_start, whose backward
    # splits the same way); the [W, L] counts and the ETP collectives stay blocking.

    def start(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor) -> Callable[[], tuple]:
        """:meth:`__call__` begun: returns its ``wait() -> (x_ECD, counts_WL)``."""
        pending = comm.all_to_all_start(x_ECD, self.chunks, self.chunks, self.group)
        counts_WL = self._counts_exchanged(counts_WL)
        return lambda: self._gathered(pending.wait(), counts_WL)

    def back_start(self, y_ECD: torch.Tensor) -> Callable[[], torch.Tensor]:
        """:meth:`back` begun: returns its ``wait() -> y_ECD``."""
        return comm.all_to_all_start(self._reduced(y_ECD), self.chunks, self.chunks,
                                     self.group).wait

    def _counts_exchanged(self, counts_WL: torch.Tensor) -> torch.Tensor:
        """Each source's [1, L] kept counts to the rank owning those experts."""
        if self.ep_size == 1:
            return counts_WL
        ones = [1] * self.ep_size
        return comm.all_to_all(counts_WL, ones, ones, self.group)

    def _gathered(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The arrived chunks and counts of every ETP rank (P*W chunks); as they are without."""
        if self.etp_size == 1:
            return x_ECD, counts_WL
        P = self.etp_size
        return (comm.all_gather(x_ECD, self.etp_group, [x_ECD.shape[0]] * P),
                comm.all_gather(counts_WL, self.etp_group, [counts_WL.shape[0]] * P))

    def _reduced(self, y_ECD: torch.Tensor) -> torch.Tensor:
        """The P partial outputs summed, this rank's chunks kept; as it is without ETP."""
        return y_ECD if self.etp_size == 1 else comm.reduce_scatter(y_ECD, self.etp_group)


def static_moe(x_TD: torch.Tensor, routing: Any, w13_LXD: torch.Tensor, w2_LDF: torch.Tensor,
               *, num_experts: int, token_budget: float, activation: str, weighted_input: bool,
               ep_size: int = 1, group: Any = None,
               wrap: Callable[[Callable], Callable] | None = None, stash_scope: Any = None,
               experts_call: Callable | None = None, quantized_wire: bool = True,
               etp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1-6 for one micro-batch: (y_TD, overflow, counts_E), all device tensors.
    ``wrap`` turns each pure piece into its captured replay (moeplug.syncfree.captured); None:
    eager, where on the CPU the stages run in the layer's workspace arena
    (moeplug.modules.static_arena: the same ops, nothing allocated after warm-up).
    ``stash_scope`` (eager only): the layer's paged-stash scope, around stage 4.
    ``experts_call(fn, *args)`` (eager CPU only): runs stage 4 in the experts module's offload
    scope (model.offload's expert_fc1 / moe_act), or None. ``quantized_wire``: under a
    recipe with ``quantize_dispatch``, the rows cross in its row format, as the layer's
    dispatcher sends them (``Dispatcher.quantizes_dispatch``). ``etp_group``: expert tensor
    parallelism's group (the experts' F-slices; None without ETP): the arrived rows are
    gathered over it and the partial outputs summed back (:class:`PackedExchange`,
    :func:`etp_gather`)."""
    T, K = routing.ids_TK.shape
    C = budget_rows(T, K, num_experts, token_budget)
    L = num_experts // ep_size
    recipe = active_recipe()
    if recipe is not None:  # an emulated FP8/FP4 recipe's block (moeplug.quant)
        if wrap is not None:
            raise ValueError("static_moe: a quantization recipe's region runs eagerly; "
                             "config refuses runtime.capture with plugins.precision recipes")
        align = recipe.row_alignment  # each expert's rows in whole quantization blocks
        return quant_region(x_TD, routing, w13_LXD, w2_LDF, num_experts=num_experts,
                            budget=-(-C // align) * align, activation=activation,
                            weighted_input=weighted_input, ep_size=ep_size, group=group,
                            recipe=recipe, stash_scope=stash_scope, experts_call=experts_call,
                            quantized_wire=quantized_wire, etp_group=etp_group)
    on_cpu = x_TD.device.type == "cpu"
    if wrap is None and on_cpu:
        return static_arena.static_region(
            x_TD, routing, w13_LXD, w2_LDF, num_experts=num_experts, budget=C,
            activation=activation, weighted_input=weighted_input, ep_size=ep_size,
            exchange=PackedExchange(L * C, ep_size, group, etp_group), stash_scope=stash_scope,
            experts_call=experts_call)
    if experts_call is not None:  # config refuses the expert offload names here
        raise ValueError("static_moe: experts_call runs only in the eager CPU region and "
                         "under a quantization recipe")
    wrap = wrap or (lambda fn: fn)
    args = (routing.ids_TK, routing.dropped_TK, routing.probs_TK)
    if ep_size == 1 and etp_group is None and stash_scope is None:
        return wrap(one_rank)(x_TD, *args, w13_LXD, w2_LDF, num_experts, C, activation,
                              weighted_input)
    if on_cpu:  # packed chunks: the experts compute only the routed rows
        x_ECD, slot_N, overflow, counts_E = wrap(front)(x_TD, *args, num_experts, C,
                                                        weighted_input, True, ep_size)
        exchange = PackedExchange(L * C, ep_size, group, etp_group)
        x_ECD, counts_WL = exchange(x_ECD, counts_E.view(ep_size, L))
        x_WSD = x_ECD.view(-1, L * C, x_ECD.shape[1])  # W chunks (P*W under ETP)
        if stash_scope is None:
            y_WSD = wrap(grouped_ffn_packed)(x_WSD, counts_WL, w13_LXD, w2_LDF, activation)
        else:
            with stash_scope:  # the stash is eager only
                y_WSD = grouped_ffn_packed(x_WSD, counts_WL, w13_LXD, w2_LDF, activation)
        y_ECD = exchange.back(y_WSD.view(-1, y_WSD.shape[2]))
        return wrap(back)(y_ECD, slot_N, routing.probs_TK, weighted_input), overflow, counts_E
    x_ECD, slot_N, overflow, counts_E = wrap(front)(x_TD, *args, num_experts, C, weighted_input)
    x_LBD = etp_gather(to_experts(x_ECD, L, C, ep_size, group), etp_group)
    if stash_scope is None:
        y_LBD = wrap(experts_ffn)(x_LBD, w13_LXD, w2_LDF, activation)
    else:
        with stash_scope:
            y_LBD = stashed_experts_ffn(x_LBD, w13_LXD, w2_LDF, activation)
    y_ECD = from_experts(etp_reduce(y_LBD, etp_group), C, ep_size, group)
    return wrap(back)(y_ECD, slot_N, routing.probs_TK, weighted_input), overflow, counts_E


# ---- under an emulated low-precision recipe ------------------------------------------------

def quant_experts_ffn(x_LBD: torch.Tensor, p_LB: torch.Tensor | None, w13_LXD: torch.Tensor,
                      w2_LDF: torch.Tensor, activation: str, recipe: Any) -> torch.Tensor:
    """Stage 4 through ``recipe``: each local expert's ``down(act(up(x)) * p)`` over its B
    budget rows, as the dynamic quantized experts run it (moeplug.quant.quant_expert_rows,
    keeping FC1's output: the region's only mode). Empty slots are zero rows of weight 0: they
    raise no amax and add nothing to a weight gradient."""
    act = activation_fn(activation)
    note("expert_fc1", x_LBD)
    return torch.stack([quant_expert_rows(x_LBD[e], None if p_LB is None else p_LB[e],
                                          w13_LXD, w2_LDF, e, act, recipe, True)
                        for e in range(x_LBD.shape[0])])


def slot_probs(probs_TK: torch.Tensor, slot_N: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[num_slots] each slot's routing weight, 0 where no choice landed (the dump slot E*C
    takes the over-budget choices and is cut); differentiable in ``probs_TK``."""
    p_S1 = probs_TK.new_zeros(num_slots + 1).scatter(0, slot_N, probs_TK.reshape(-1))
    return p_S1[:num_slots]


def quant_region(x_TD: torch.Tensor, routing: Any, w13_LXD: torch.Tensor, w2_LDF: torch.Tensor,
                 *, num_experts: int, budget: int, activation: str, weighted_input: bool,
                 ep_size: int, group: Any, recipe: Any, stash_scope: Any,
                 experts_call: Callable | None, quantized_wire: bool = True,
                 etp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 1-6 with stage 4 through an emulated FP8/FP4 recipe, eager on any device:
    (y_TD, overflow, counts_E). The batched layout (every expert B = W*C rows, empty slots
    zero rows), so a recipe's per-tensor amax and its blocks along the rows see the expert's
    rows as the dynamic path's padded groups do. The routing weight multiplies the activation
    before FC2 as there (FC2's input is what gets quantized, so it cannot move to combine), or
    with ``weighted_input`` the rows once they arrived (not before their quantized exchange):
    each slot's weight crosses EP beside its row. Under ETP both are then gathered over
    ``etp_group`` (the dynamic path's ExpertTPDispatcher gathers the dequantized rows too)."""
    E, C, W = num_experts, budget, ep_size
    L, K = E // W, routing.ids_TK.shape[1]
    slot_N, overflow, counts_E = slots(routing.ids_TK, routing.dropped_TK, E, C)
    x_ECD = gather_rows(x_TD, slot_N, K, E * C, zeros=True)
    if recipe.quantize_dispatch and quantized_wire:  # rows cross in the recipe's row format
        # as the layer's dispatcher sends them (at one rank too: every layout sees the same
        # numerics); grads in full
        x_LBD = quantized_exchange(
            x_ECD, recipe, lambda t: to_experts(t, L, C, W, group).reshape(L * W * C, -1),
            lambda g: from_experts(g.view(L, W * C, -1), C, W, group)).view(L, W * C, -1)
    else:
        x_LBD = to_experts(x_ECD, L, C, W, group)
    x_LBD = etp_gather(x_LBD, etp_group)
    p_LB = etp_gather(to_experts(slot_probs(routing.probs_TK, slot_N, E * C).unsqueeze(1), L, C,
                                 W, group), etp_group).squeeze(2)
    if weighted_input:  # moe.apply_probs_on_input: on the rows as they arrived, as the
        # dynamic layer scales them after the (quantized) dispatch; FC2's input unweighted
        x_LBD, p_LB = x_LBD * p_LB.unsqueeze(-1).to(x_LBD.dtype), None
    with stash_scope if stash_scope is not None else contextlib.nullcontext():
        y_LBD = (experts_call or static_arena.call_directly)(
            quant_experts_ffn, x_LBD, p_LB, w13_LXD, w2_LDF, activation, recipe)
    y_ECD = from_experts(etp_reduce(y_LBD, etp_group), C, W, group)
    # zeros: the recipe's GEMMs read every row's gradient, the empty slots' too
    return combine_rows(y_ECD, slot_N, routing.probs_TK, weighted_input=True, zeros=True), \
        overflow, counts_E
