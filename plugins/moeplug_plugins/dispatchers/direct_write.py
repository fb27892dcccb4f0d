"""``direct_write`` dispatcher: the ranks of one machine write token rows straight into the
receive buffer of the rank owning the expert, in the runtime's shared-memory heap (the CPU
counterpart of DeepEP's intranode kernels; moeplug.parallel.shm_heap / shm_rows).

Legend: T tokens, K top-k, D hidden, E experts (global), L local experts, W EP ranks,
P rows for the local experts (padding included).

dispatch:
    1. counts    this rank's kept rows per expert (+ its capacity) into its heap slots; ARRIVE
                 flag; every rank reads every rank's slots: the full [W, E] counts, no exchange
    2. plan      every row's receiver and row there, padding included (_dw_plan: alltoall's
                 layout, local-expert-major, then source rank, then (token, k) order)
    3. write     each token row goes straight to its K receivers' heaps (bf16/fp32 rows, or FP8
                 payload + scales under a quantize_dispatch recipe: moeplug.quant.wire); DONE
    4. receive   x_SD, probs_S are tensors over this rank's receive area in the heap, where the
                 senders wrote the rows (padding rows zeroed in place): one pass over the rows,
                 read from x_TD and written to their final place; the area is reused only after
                 the last tensor over it dies (autograd's saved x_SD included)
combine (the default): each rank writes its expert outputs back into the sources' heaps, one
run per (source, local expert), and each source sums its K rows per token out of its heap (fused
sum on receipt, two passes). With ``single_copy`` (where the heap's probe allows it, for rows of
at least PULL_MIN_ROW_BYTES): each source reads its K rows per token straight out of the expert
ranks' y_SD (process_vm_readv into a cache-sized block) and sums them there - one pass over the
rows, but a system call per row: slower than the two passes since they were vectorised. Backward: dispatch's is the two-pass combine (grads of probs ride along),
combine's is dispatch's steps 3-4.
Split for overlap (``model.moe.overlap_chunks`` > 1; overlaps_comm): dispatch_start is steps 1-3
with this rank's DONE published, dispatch_wait waits for every peer's DONE of the op and does
step 4; combine_start pulls and sums (or writes back) this rank's rows and publishes,
combine_wait waits for the peers (their rows in / their reads of our y_SD done) and sums.
Several ops may be in flight (moeplug.parallel.shm_heap: growing flags, two slot banks, each
pending op holding its area). Each call is two autograd nodes, start -> token -> wait, and the
backward splits the same way: the wait node's backward starts the gradient's op (writes,
publishes), the start node's waits for it, with other ready nodes (another chunk's) in between.
Synchronous: the count barrier in each start (the plan needs every rank's counts) and the
quantized dispatch (its payload op runs inside moeplug.quant.wire's autograd node).
Dropped choices (``routing.dropped_TK``) send no row; combine adds nothing for them.
Quantized, each token row is quantized once and its bytes written to each of its ranks, so
``moeplug.quant.wire.WIRE`` counts T token rows here where alltoall counts its T*K routed rows.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeplug.api import (active_group, active_recipe, Dispatched, Dispatcher, heap_for, MiB,
                         ModelConfig, quantized_exchange, RouterOutput, shm_rows, SymmetricHeap,
                         workspace)
from moeplug_plugins.dispatchers._dw_options import OPTION, DirectWriteOptions
from moeplug_plugins.dispatchers._dw_plan import DirectWritePlan, build_plan, local_counts
from moeplug_plugins.dispatchers._group import ep_layout
from moeplug_plugins.dispatchers._nodes import group_timeout_s


def default_heap_bytes(model: ModelConfig, ep_size: int) -> int:
    """One sequence of max_seq_len tokens per rank, fp32 rows + probs: with balanced routing a
    rank receives about T * K rows. Imbalance grows the heap on demand (collectively); the pages
    are reserved up front, so the default stays the typical need, not the worst case."""
    rows = model.max_seq_len * model.moe.top_k
    return max(MiB, -(-rows * (model.hidden_size * 4 + 4) // MiB) * MiB)


@dataclass(frozen=True)
class DirectWriteMeta:
    heap: SymmetricHeap
    plan: DirectWritePlan
    fixed: bool  # heap_bytes was set: growing is an error
    single_copy: bool  # combine pulls the rows (shm_rows.pull_sum)
    heap_of: Callable[[], SymmetricHeap]  # the heap of the calling thread's group (_here)

    @property
    def pad_index_S(self) -> torch.Tensor | None:  # as the other dispatchers' meta
        return self.plan.pad_index_S


class DirectWriteDispatcher(Dispatcher):
    quantizes_dispatch = True  # moeplug.quant.wire under a quantize_dispatch recipe
    overlaps_comm = True  # *_start write (or pull) and publish; *_wait wait for the peers

    def __init__(self, model: ModelConfig, options: DirectWriteOptions | None = None, group=None):
        options = options or DirectWriteOptions()
        self.group = group
        self.ep_size, self.ep_rank, self.num_local_experts = ep_layout(model, group)
        self.num_experts = model.moe.num_experts
        self.heap_bytes = options.heap_bytes or default_heap_bytes(model, self.ep_size)
        self.fixed = options.heap_bytes > 0
        self.timeout_s = options.timeout_s
        self.single_copy = options.single_copy

    def _heap(self) -> SymmetricHeap:
        # Created collectively by the first op on the group, shared by every layer. Inside the
        # combined 1F1B's overlapped backward (moeplug.parallel.ep_overlap) the group's twin
        # has a heap of its own: the two threads' ops never share a sequence.
        group = active_group(self.group)
        return heap_for(group, self.heap_bytes, 2 + self.num_experts,
                        self.timeout_s or group_timeout_s(group))

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        return self.dispatch_wait(self.dispatch_start(x_TD, routing))

    def dispatch_start(self, x_TD: torch.Tensor, routing: RouterOutput
                       ) -> _Pending | Dispatched:
        """Steps 1-3: counts (a barrier), plan, this rank's rows written, DONE published."""
        if x_TD.device.type != "cpu":
            # GPU transports (CUDA IPC / NVSHMEM / NCCL) are not built: say so, never stage
            # through host memory silently.
            raise ValueError(f"dispatcher direct_write moves CPU tensors through /dev/shm; got "
                             f"tokens on {x_TD.device} (no CUDA IPC/NVSHMEM transport yet). Fix: "
                             f"use plugins.dispatcher=alltoall on GPU")
        E = self.num_experts
        heap = self._heap()
        x_TD = x_TD.contiguous()
        probs_TK = routing.probs_TK.float().contiguous()
        recipe = active_recipe()
        quantized = recipe is not None and recipe.quantize_dispatch
        # 1. counts (with the row bytes of the first op of this dispatch, checked on every rank)
        ids_TK, counts_E = local_counts(routing.ids_TK, routing.dropped_TK, E)
        cap = -1 if routing.capacity is None else int(routing.capacity)
        first = ([] if quantized else [(x_TD, False)]) + [(probs_TK.view(-1, 1), True)]
        slots = workspace.empty((1 + E,), torch.int64)
        slots[:1].fill_(cap)  # fill_, not slots[0] = cap: that wraps cap in a fresh tensor
        slots[1:].copy_(counts_E)
        seq = heap.arrive(shm_rows.row_bytes(first), slots)
        slots_W = heap.read_slots(1 + E)
        # 2. plan
        capacity_W = None if cap < 0 else slots_W[:, 0].tolist()
        plan = build_plan(slots_W[:, 1:], ids_TK, self.ep_rank,
                          None if cap < 0 else cap, capacity_W, routing.pad_multiple)
        meta = DirectWriteMeta(heap=heap, plan=plan, fixed=self.fixed,
                               single_copy=self.single_copy and _single_copy(heap),
                               heap_of=self._heap)
        # 3. write
        if not quantized:
            handoff = _Handoff()
            token = _DispatchStart.apply(meta, seq, handoff, x_TD, probs_TK)
            return _Pending(meta, handoff, token)
        # Quantized: synchronous. Probs first (this op's arrive is already done), then payload
        # and scales as two ops of token rows; gradients come back in full precision
        # (moeplug.quant.wire).
        handoff = _Handoff()
        token = _DispatchStart.apply(meta, seq, handoff, None, probs_TK)
        (probs_S,) = _DispatchWait.apply(meta, handoff, token)
        x_SD = quantized_exchange(x_TD, recipe, lambda t: _send_tokens(meta, t)[0],
                                  lambda g: _sum_back(_here(meta), g))
        if plan.pad_rows is not None:
            x_SD = x_SD.index_fill(0, plan.pad_rows, 0)
        return Dispatched(x_SD, probs_S, plan.counts_L, meta)

    def dispatch_wait(self, pending: _Pending | Dispatched) -> Dispatched:
        """Step 4: every peer's rows of this dispatch are in; x_SD, probs_S over them."""
        if isinstance(pending, Dispatched):  # quantized: done in dispatch_start
            return pending
        p = pending
        x_SD, probs_S = _DispatchWait.apply(p.meta, p.handoff, p.token)
        return Dispatched(x_SD, probs_S, p.meta.plan.counts_L, p.meta)

    def combine(self, y_SD: torch.Tensor, meta: DirectWriteMeta) -> torch.Tensor:
        return self.combine_wait(self.combine_start(y_SD, meta))

    def combine_start(self, y_SD: torch.Tensor, meta: DirectWriteMeta) -> _Pending:
        """This rank's part: pulled and summed its rows (single copy), or written its expert
        outputs back into the sources' heaps (two passes); DONE published."""
        handoff = _Handoff()
        return _Pending(meta, handoff, _CombineStart.apply(meta, handoff, y_SD.contiguous()))

    def combine_wait(self, pending: _Pending) -> torch.Tensor:
        """Every peer is done (has read our rows / written us theirs): y_TD."""
        return _CombineWait.apply(pending.meta, pending.handoff, pending.token)


@dataclass(frozen=True)
class _Pending:
    """A dispatch or combine between start and wait (one per call): ``token`` links the start
    node to the wait node in autograd, ``handoff`` carries the op between them."""
    meta: DirectWriteMeta
    handoff: _Handoff
    token: torch.Tensor


class _Handoff:
    """One call's heap op in flight between its two autograd nodes: the forward's (started by
    the start node, waited for by the wait node) and the backward's (started by the wait node's
    backward, waited for by the start node's: autograd runs other ready nodes - another chunk's
    experts - in between, as for alltoall's async collectives)."""
    __slots__ = ("backward", "forward")

    def __init__(self) -> None:
        self.forward: shm_rows.Landing | shm_rows.Pull | None = None
        self.backward: shm_rows.Landing | None = None

    def take(self, which: str) -> shm_rows.Landing | shm_rows.Pull:
        op = getattr(self, which)
        if op is None:
            raise RuntimeError(f"direct_write: no {which} op in flight for this call (a wait "
                               f"without its start, or a start's backward without its wait's)")
        setattr(self, which, None)  # the op's area is the caller's now, not the handoff's
        return op


def _token() -> torch.Tensor:
    """The start node's output, the wait node's input: no data, only the autograd edge (a
    0-element view of a buffer in the running layer's workspace)."""
    return workspace.empty((0,), torch.float32)


# ---- the two directions, each an op on the heap ------------------------------------------------

def _write_tokens(meta: DirectWriteMeta, t_T: torch.Tensor | None, seq: int | None = None,
                  probs_TK: torch.Tensor | None = None) -> shm_rows.Landing:
    """Rows of t_T (+ probs_TK's, per choice) written to the experts' ranks, DONE published. A
    new op unless ``seq`` (dispatch's first op)."""
    streams = [] if t_T is None else [(t_T.contiguous(), False)]
    if probs_TK is not None:
        streams.append((probs_TK.reshape(-1, 1), True))
    if seq is None:
        seq = meta.heap.arrive(shm_rows.row_bytes(streams))
    plan = meta.plan
    return shm_rows.to_experts_start(meta.heap, seq, streams, plan.dest_rank_TK,
                                     plan.dest_row_TK, plan.recv_rows_W, meta.fixed, OPTION)


def _here(meta: DirectWriteMeta) -> DirectWriteMeta:
    """``meta`` with the heap of the calling thread's group: a backward may run on the combined
    1F1B's helper thread, whose ops go to the twin group's heap (the plan is the same)."""
    heap = meta.heap_of()
    return meta if heap is meta.heap else dataclasses.replace(meta, heap=heap)


def _tokens_landed(meta: DirectWriteMeta, landing: shm_rows.Landing, with_probs: bool
                   ) -> list[torch.Tensor]:
    """[rows] (+ [probs_S]) at this expert rank, padding rows zeroed: tensors over this rank's
    receive area in the heap, where the senders wrote them (no copy; the area is this rank's
    while they live)."""
    out = shm_rows.landed(landing)
    if meta.plan.pad_rows is not None:  # nobody writes the padding rows: zero them where they lie
        for o in out:
            o.index_fill_(0, meta.plan.pad_rows, 0)
    if with_probs:
        out[-1] = out[-1].view(-1)
    return out


def _send_tokens(meta: DirectWriteMeta, t_T: torch.Tensor) -> list[torch.Tensor]:
    """Rows of t_T at the experts' ranks, as one synchronous op (backward, quantized payload)."""
    return _tokens_landed(meta, _write_tokens(meta, t_T), False)


def _back_start(meta: DirectWriteMeta, streams: list[torch.Tensor]) -> shm_rows.Landing:
    """Expert rows (real rows only are sent) back into their sources' heaps, DONE published."""
    streams = [s.contiguous() for s in streams]
    seq = meta.heap.arrive(shm_rows.row_bytes([(s, False) for s in streams]))
    return shm_rows.to_sources_start(meta.heap, seq, streams, meta.plan.chunks_C4,
                                     meta.plan.send_rows_W, meta.fixed, OPTION)


def _back(meta: DirectWriteMeta, streams: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_back_start` and its wait: this rank's returned rows, in its expert-major order,
    over its receive area (freed when they die)."""
    return shm_rows.landed(_back_start(meta, streams))


def _sum_back(meta: DirectWriteMeta, y_SD: torch.Tensor) -> torch.Tensor:
    (rows,) = _back(meta, [y_SD])
    return shm_rows.sum_rows(rows, meta.plan.row_map_TK)


class _DispatchStart(torch.autograd.Function):
    """dispatch_start (step 3: rows written, DONE published) -> token. Backward: waits for the
    gradient rows that the wait node's backward sent back and sums them (two-pass combine)."""

    @staticmethod
    def forward(ctx, meta, seq, handoff, x_TD, probs_TK):
        ctx.arena = workspace.current_arena()  # backward's small buffers: this layer's
        ctx.meta, ctx.handoff, ctx.has_x = meta, handoff, x_TD is not None
        handoff.forward = _write_tokens(meta, x_TD, seq, probs_TK)
        return _token()

    @staticmethod
    def backward(ctx, _g_token):
        rows = shm_rows.landed(ctx.handoff.take("backward"))
        rm = ctx.meta.plan.row_map_TK
        with workspace.ctx_arena(ctx):
            g_x = shm_rows.sum_rows(rows[0], rm) if ctx.has_x else None
            return None, None, None, g_x, _probs_grad(rows[-1].reshape(-1), rm)


def _probs_grad(g_P: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    """g_TK[t, k] = g_P[row_map_TK[t, k]], 0 for a dropped choice (row -1): the gather and mask
    as out= ops into the workspace (on the CPU; the indexing form allocates four tensors)."""
    shape, rm = tuple(row_map_TK.shape), row_map_TK.reshape(-1)
    index = torch.clamp(rm, min=0, out=workspace.empty(tuple(rm.shape), rm.dtype))
    g = torch.index_select(g_P, 0, index, out=workspace.empty(tuple(rm.shape), g_P.dtype))
    dropped = torch.lt(rm, 0, out=workspace.empty(tuple(rm.shape), torch.bool))
    return g.masked_fill_(dropped, 0.0).view(shape)


class _DispatchWait(torch.autograd.Function):
    """dispatch_wait (step 4): (x_SD,) probs_S over the receive area. Backward: writes the
    gradient rows back into their sources' heaps and publishes, without waiting."""

    @staticmethod
    def forward(ctx, meta, handoff, token):
        ctx.arena = workspace.current_arena()  # backward's small buffers: this layer's
        ctx.meta, ctx.handoff = meta, handoff
        return tuple(_tokens_landed(meta, handoff.take("forward"), True))

    @staticmethod
    def backward(ctx, *grads):
        streams = list(grads[:-1]) + [grads[-1].float().reshape(-1, 1)]
        with workspace.ctx_arena(ctx):
            ctx.handoff.backward = _back_start(_here(ctx.meta), streams)
            return None, None, _token()


def _single_copy(heap: SymmetricHeap) -> bool:
    if not heap.single_copy and not _warned:
        _warned.append(True)
        warnings.warn("direct_write: the ranks may not read each other's memory "
                      "(process_vm_readv was refused at heap set-up: Yama ptrace_scope or "
                      "seccomp), so combine takes two passes (write into the heap, sum out of "
                      "it). Fix: allow ptrace between the ranks (same user, ptrace_scope 0, "
                      "docker --cap-add SYS_PTRACE) or set "
                      "plugins.dispatcher_options.single_copy=false to silence this",
                      stacklevel=3)
    return heap.single_copy


_warned: list[bool] = []
# process_vm_readv pays per row (one iovec, its pages pinned). When the two-pass kernels were
# scalar, the single copy won for fp32 rows at 4 ranks (4 KiB: 486-503 ms against 514-529
# pushed) and lost for bf16 rows (2 KiB: 377-427 ms against 324-334), so smaller rows take the
# two passes even when single_copy is asked for. (Since the two-pass kernels were vectorised it
# loses at 4-16 KiB too, so single_copy is off by default: _dw_options.py.) Every rank has the
# same row bytes (arrive checks it), so all take the same path.
PULL_MIN_ROW_BYTES = 4096


class _CombineStart(torch.autograd.Function):
    """combine_start: this rank's rows pulled and summed, or written back; DONE published ->
    token. Backward: waits for the gradient rows the wait node's backward sent (dispatch's
    step 4)."""

    @staticmethod
    def forward(ctx, meta, handoff, y_SD):
        ctx.arena = workspace.current_arena()  # backward's small buffers: this layer's
        ctx.meta, ctx.handoff = meta, handoff
        row_bytes = math.prod(y_SD.shape[1:]) * y_SD.element_size()
        if meta.single_copy and row_bytes >= PULL_MIN_ROW_BYTES:
            p = meta.plan
            handoff.forward = shm_rows.pull_sum_start(meta.heap, y_SD, p.dest_rank_TK,
                                                      p.dest_row_TK)
        else:
            handoff.forward = _back_start(meta, [y_SD])
        return _token()

    @staticmethod
    def backward(ctx, _g_token):
        with workspace.ctx_arena(ctx):
            return None, None, _tokens_landed(ctx.meta, ctx.handoff.take("backward"), False)[0]


class _CombineWait(torch.autograd.Function):
    """combine_wait: the peers are done; y_TD. Backward: dispatch's step 3 for the gradient
    (rows written to the experts' ranks, DONE published), without waiting."""

    @staticmethod
    def forward(ctx, meta, handoff, token):
        ctx.arena = workspace.current_arena()  # backward's small buffers: this layer's
        ctx.meta, ctx.handoff = meta, handoff
        op = handoff.take("forward")
        if isinstance(op, shm_rows.Pull):
            return shm_rows.pulled(op)
        (rows,) = shm_rows.landed(op)
        return shm_rows.sum_rows(rows, meta.plan.row_map_TK)

    @staticmethod
    def backward(ctx, g_TD):
        with workspace.ctx_arena(ctx):
            ctx.handoff.backward = _write_tokens(_here(ctx.meta), g_TD.contiguous())
            return None, None, _token()
