"""Differentiable collectives over torch.distributed (gloo on CPU, NCCL on GPU).

Each function's backward is the adjoint collective, so gradients are those of the *sum of every
rank's loss*: all-to-all <-> all-to-all with the splits swapped, all-gather <-> reduce-scatter,
all-reduce <-> all-reduce. Megatron's tensor/sequence-parallel "region" functions are here too;
they differ from the plain collectives only where the code around them is replicated across the
group (e.g. after ``reduce_from_tp_region`` every TP rank computes the same loss, so its backward
is the identity, not another all-reduce).

A ``group`` of ``None`` or of size 1 is the single-process fast path: every function returns its
input (splits and sizes are still checked, so a layout bug shows up without a second process).

Shape legend: N rows (dim 0) on this rank before the collective, M rows after it, W ranks in the
group, ``...`` any trailing dims; ``sizes_W`` rows contributed by each rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from moeplug.ops import delayed_wgrad
from moeplug.runtime import workspace

# torch 2.13 renamed the single-tensor collectives (the old names warn); torch < 2.13 has only
# the old ones. Same signatures: (output, input, ..., group=).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Combined 1F1B (moeplug.parallel.ep_overlap) runs one micro-batch's backward on a second
# thread while the next one's forward runs here. Both issue collectives; each thread must keep
# one order on all ranks, so the backward thread sends its collectives through a twin of every
# group (same ranks, its own context). ``active_group(group)`` is the group a collective really
# uses.
_thread = threading.local()
# Twins of every group that has one, for the code that builds groups of its own from them: a
# plugin asks has_twin(the group it was given) and, if so, builds a twin of each subgroup
# (same ranks, same creation order on every rank) and registers it. active_group consults
# this after the mapping the overlapped backward entered.
# Weak keys: a registry that outlived its groups would hold every group a long-lived process
# (a test session, a notebook) ever built, and their twins with them.
_registered_twins: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def register_twin(group: Any, twin: Any) -> None:
    """``twin`` (same ranks, its own context) is what ``group``'s collectives use inside the
    overlapped backward. ParallelGroups registers its own; plugins register their subgroups'."""
    _registered_twins[group] = twin


def has_twin(group: Any) -> bool:
    """Whether ``group`` has a twin (combined 1F1B is on): a plugin that splits it into
    subgroups then builds and registers theirs."""
    return group in _registered_twins


@contextlib.contextmanager
def on_twin_groups(twins: Mapping[Any, Any]) -> Iterator[None]:
    """Collectives issued by this thread inside the block run on ``twins[group]``."""
    previous = getattr(_thread, "twins", None)
    _thread.twins = twins
    try:
        yield
    finally:
        _thread.twins = previous


def active_group(group: Any) -> Any:
    """The group a collective on ``group`` issued by this thread must really use: its twin
    inside :func:`on_twin_groups`, else ``group``. Every collective outside this module that can
    run inside a backward (or a forward recomputed there) passes its group through this: the
    vocab-parallel loss and the CP K/V ring (moeplug.parallel.tensor_parallel,
    context_parallel), the routers' count sums (moeplug.routing)."""
    twins = getattr(_thread, "twins", None)
    if twins is None or group is None:
        return group
    twin = twins.get(group)
    if twin is None:
        twin = _registered_twins.get(group)
    if twin is None:
        raise RuntimeError("a collective inside the overlapped backward uses a process group "
                           "without a twin; it would interleave with the forward's collectives "
                           "differently on each rank. Fix: build the group in ParallelGroups, "
                           "or set parallel.overlap_moe_expert_parallel_comm: false")
    return twin


def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def _check_splits(name: str, splits: Sequence[int], world: int, rows: int | None) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != world:
        raise ValueError(f"{name} has {len(splits)} entries {splits} but the group has {world} "
                         f"ranks. Fix: pass one row count per rank of the group")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name} = {splits} has a negative entry. Fix: row counts are >= 0")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"{name} = {splits} sums to {sum(splits)} but the input has {rows} rows "
                         f"(dim 0). Fix: input splits must add up to x.shape[0]")
    return splits


# --- raw (non-differentiable) building blocks ----------------------------------------------

# Why a collective's tensors go out on loan: gloo's worker thread drops its references to a
# collective's tensors only after it has woken the caller, so for a moment after ``wait()``
# returns, a workspace buffer that was sent or received still looks in use (its storage's use
# count, which moeplug.runtime.workspace reads, says so), and a request in that moment (the next
# op's, microseconds later) allocated a new buffer instead of reusing it. Measured: a 32 KB
# arena buffer in the packed experts' backward (moeplug.ops.grouped_ffn) at EP2 sync-free, in 4 of 50 rank-runs of a step
# (tests/test_moe_allocations.py's EP2 case failed CI intermittently), still held when requested
# and released within 5 ms. So the collective gets fresh views of its CPU tensors, and waiting
# returns once those views are gone: a tensor whose last Python reference is dropped while C++
# still holds it stays alive as a Python object (torch preserves it), so a weak reference to a
# view dies exactly when the backend lets go. Not the storage's use count: other views of the
# same storage may come and go meanwhile (the next chunk's exchange, started before this one
# is waited for, lends views of the same buffer).
RELEASE_TIMEOUT_S = 1.0
_release_timed_out = False


class _Loan:
    """A collective's arguments with each CPU tensor replaced by a fresh view of it (``args``),
    and weak references to those views."""

    __slots__ = ("args", "_views")

    def __init__(self, args: Sequence[Any]) -> None:
        self.args = [a.view(a.shape) if isinstance(a, torch.Tensor) and a.device.type == "cpu"
                     else a for a in args]
        self._views = [weakref.ref(v) for v, a in zip(self.args, args) if v is not a]

    def settle(self) -> None:
        """Drop our views; return once the collective has dropped its own references to them
        (or after RELEASE_TIMEOUT_S, once per process, with a warning: a backend that keeps
        them)."""
        global _release_timed_out
        self.args = None
        deadline = None
        while not _release_timed_out and any(view() is not None for view in self._views):
            now = time.monotonic()
            if deadline is None:
                deadline = now + RELEASE_TIMEOUT_S
            elif now > deadline:
                _release_timed_out = True
                warnings.warn(f"a collective kept its tensors over {RELEASE_TIMEOUT_S} s after "
                              "it completed; workspace buffers it used are no longer awaited, "
                              "so steps may allocate again", RuntimeWarning, stacklevel=2)
            os.sched_yield()
        self._views = None


class InFlight:
    """A started collective: :meth:`wait` blocks until it has completed and let go of its
    tensors."""

    __slots__ = ("_work", "_loan")

    def __init__(self, work: Any, loan: _Loan) -> None:
        self._work, self._loan = work, loan

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None  # the handle holds the tensors too
        self._loan.settle()


def start(collective: Callable, *args: Any, group: Any, **kwargs: Any) -> InFlight:
    """``collective(*args, group=active_group(group), async_op=True, **kwargs)`` on loaned
    views of its CPU tensors (see _Loan)."""
    loan = _Loan(args)
    return InFlight(collective(*loan.args, group=active_group(group), async_op=True, **kwargs),
                    loan)


def blocking(collective: Callable, *args: Any, group: Any, **kwargs: Any) -> None:
    """``collective(*args, group=active_group(group), **kwargs)``, returning once it has
    completed and let go of its tensors: for collectives on workspace buffers."""
    start(collective, *args, group=group, **kwargs).wait()


def _run(collective, *args, group: Any) -> None:
    """:func:`blocking`. With delayed expert weight gradients queued on this thread
    (model.moe.delay_wgrad_compute: this is the dispatch's backward exchange carrying the
    experts' dX), run them while the rows travel."""
    exchange = start(collective, *args, group=group)
    if delayed_wgrad.pending():
        delayed_wgrad.run_pending(in_flight=True)
    exchange.wait()


def _rows_buffer(x_N: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised [rows, ...] like x_N: on CPU from the workspace (the running MoE
    layer's arena or the large-buffer cache), so a steady-state exchange allocates nothing."""
    return workspace.allocator(x_N.device)((rows, *x_N.shape[1:]), x_N.dtype)


def _all_to_all(x_N: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: Any) -> torch.Tensor:
    out_M = _rows_buffer(x_N, sum(out_splits))
    _run(dist.all_to_all_single, out_M, x_N.contiguous(), out_splits, in_splits, group=group)
    return out_M


def _gather_even(x_N: torch.Tensor, group: Any) -> torch.Tensor:
    """[N, ...] -> [W*N, ...], rank r's rows at [r*N, (r+1)*N)."""
    out = x_N.new_empty((group_size(group) * x_N.shape[0], *x_N.shape[1:]))
    _run(_all_gather_single, out, x_N.contiguous(), group=group)
    return out


def _reduce_scatter_even(x_M: torch.Tensor, group: Any) -> torch.Tensor:
    """[W*N, ...] -> [N, ...]: the sum over ranks of each rank's r-th block, for rank r.
    (gloo in torch 2.13 implements it natively; older gloo builds lacked reduce-scatter.)"""
    out = x_M.new_empty((x_M.shape[0] // group_size(group), *x_M.shape[1:]))
    _run(_reduce_scatter_single, out, x_M.contiguous(), group=group)
    return out


def gather_ints(value: int, group: Any) -> list[int]:
    """Every rank's ``value``, in rank order (row counts, capacities). An all-to-all of a
    [W] buffer holding ``value`` W times, from the workspace: gloo's all-gather allocates its own
    flat output every call, its all-to-all writes into the one given."""
    W = group_size(group)
    mine = workspace.empty((W,), torch.int64).fill_(int(value))
    out = workspace.empty((W,), torch.int64)
    blocking(dist.all_to_all_single, out, mine, group=group)
    return out.tolist()


def _pad_rows(x_N: torch.Tensor, rows: int) -> torch.Tensor:
    if x_N.shape[0] == rows:
        return x_N
    return torch.cat([x_N, x_N.new_zeros((rows - x_N.shape[0], *x_N.shape[1:]))])


def _gather_uneven(x_N: torch.Tensor, sizes_W: list[int], group: Any) -> torch.Tensor:
    if x_N.device.type == "cpu":
        # An all-to-all that sends every rank the same N rows: uneven sizes need no padding,
        # and both buffers come from the workspace (gloo's all-gather allocates a flat output
        # of its own every call). The price is W local copies of x_N, next to the W-1 copies
        # the wire carries either way.
        W = len(sizes_W)
        send = _rows_buffer(x_N, W * x_N.shape[0])
        send.view(W, *x_N.shape).copy_(x_N.unsqueeze(0).expand(W, *x_N.shape))
        return _all_to_all(send, sizes_W, [x_N.shape[0]] * W, group)
    # all_gather needs equal shapes on NCCL: pad every rank to the largest, then drop the
    # padding. One collective instead of W point-to-point sends.
    cap = max(sizes_W)
    out_WC = _gather_even(_pad_rows(x_N, cap), group).unflatten(0, (len(sizes_W), cap))
    return torch.cat([out_WC[r, :n] for r, n in enumerate(sizes_W)])


def _reduce_scatter_uneven(x_M: torch.Tensor, sizes_W: list[int], group: Any) -> torch.Tensor:
    N = sizes_W[group_rank(group)]
    if x_M.device.type == "cpu":
        # Each rank's block to its rank by all-to-all, then the W partial blocks summed here, in
        # rank order (the same order on every rank), into a workspace buffer. gloo's
        # reduce-scatter clones its input and all-reduces all of it: twice the bytes on the
        # wire and a fresh buffer per call.
        W = len(sizes_W)
        parts = _all_to_all(x_M, [N] * W, sizes_W, group).view(W, N, *x_M.shape[1:])
        return torch.sum(parts, dim=0, out=_rows_buffer(x_M, N))
    cap = max(sizes_W)
    blocks = torch.split(x_M, sizes_W)
    padded = torch.cat([_pad_rows(b, cap) for b in blocks])
    return _reduce_scatter_even(padded, group)[:N]


def _split_own(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    world = group_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {world} "
                         f"ranks. Fix: make that dim a multiple of the group size")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = group_size(group)
    buf = _gather_even(x.unsqueeze(0), group)  # [W, ...]
    return torch.cat(buf.unbind(0), dim=-1) if world > 1 else x


# --- autograd Functions ----------------------------------------------------------------------

class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x_N, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        ctx.arena = workspace.current_arena()  # backward's small buffers: the same layer's
        return _all_to_all(x_N, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_M):
        # Rows go back the way they came: swap the splits.
        with workspace.ctx_arena(ctx):
            grad_N = _AllToAll.apply(grad_M, ctx.in_splits, ctx.out_splits, ctx.group)
        return grad_N, None, None, None


class _GatherScatter(Function):
    """Uneven all-gather of rows (``gather``) or reduce-scatter: each is the other's adjoint,
    so backward runs the other direction."""

    @staticmethod
    def forward(ctx, x, sizes_W, group, gather):
        ctx.group, ctx.sizes_W, ctx.gather = group, sizes_W, gather
        ctx.arena = workspace.current_arena()  # backward's small buffers: the same layer's
        return (_gather_uneven if gather else _reduce_scatter_uneven)(x, sizes_W, group)

    @staticmethod
    def backward(ctx, grad):
        with workspace.ctx_arena(ctx):
            return (_GatherScatter.apply(grad, ctx.sizes_W, ctx.group, not ctx.gather),
                    None, None, None)


class _AllReduce(Function):
    """Forward all-reduce; backward all-reduce (``grad_is_replicated=False``) or identity."""

    @staticmethod
    def forward(ctx, x, group, grad_is_replicated):
        ctx.group, ctx.grad_is_replicated = group, grad_is_replicated
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=active_group(group))
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_replicated:
            return grad, None, None
        return _AllReduce.apply(grad, ctx.group, False), None, None


class _CopyToRegion(Function):
    """Identity forward; all-reduce backward (each rank's branch adds to the input's grad)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(grad, ctx.group, True), None


class _Split(Function):
    """Keep this rank's chunk of ``dim``; backward all-gathers the chunks' grads."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_own(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _Gather.apply(grad, ctx.dim, ctx.group, False), None, None


class _Gather(Function):
    """All-gather along dim 0 or -1 (even sizes). Backward: reduce-scatter when every rank's
    downstream differs (``reduce_grad``), else just this rank's chunk (replicated downstream)."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return _gather_even(x, group) if dim == 0 else _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            W = group_size(ctx.group)
            grad = _GatherScatter.apply(grad, [grad.shape[0] // W] * W, ctx.group, False)
            return grad, None, None, None
        return _Split.apply(grad, ctx.dim, ctx.group), None, None, None


class PendingAllToAll:
    """One all-to-all in flight (from :func:`all_to_all_start`); ``wait()`` returns its output.

    Per call, never kept on a module: it holds the splits, the forward's work handle and, once
    the backward has started the reverse exchange, that one's handle and buffer."""

    __slots__ = ("out_splits", "in_splits", "group", "out_M", "work", "grad_N", "grad_work")

    def __init__(self, out_splits: list[int], in_splits: list[int], group: Any) -> None:
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.out_M = self.work = self.grad_N = self.grad_work = None

    def wait(self) -> torch.Tensor:
        """The exchanged rows (differentiable); blocks until they have landed."""
        if self.work is None and self.out_M is None:
            raise RuntimeError("PendingAllToAll.wait() called twice. Fix: wait once and keep "
                               "the tensor it returns")
        out_M, self.out_M = self.out_M, None
        return _AllToAllWait.apply(out_M, self) if self.work is not None else out_M


class _AllToAllStart(Function):
    """Forward: start the all-to-all (async) and return its output buffer, not yet written
    (only :meth:`PendingAllToAll.wait` hands it out). Backward: wait for the reverse exchange
    that :class:`_AllToAllWait`'s backward started, and return its result."""

    @staticmethod
    def forward(ctx, x_N, pending):
        ctx.pending = pending
        out_M = _rows_buffer(x_N, sum(pending.out_splits))
        # The exchange keeps x_N and out_M alive until it completes.
        pending.work = start(dist.all_to_all_single, out_M, x_N.contiguous(),
                             pending.out_splits, pending.in_splits, group=pending.group)
        return out_M

    @staticmethod
    def backward(ctx, grad_M):
        p = ctx.pending
        if p.grad_work is None:  # no wait node in between (cannot happen via wait()): exchange now
            return _all_to_all(grad_M, p.in_splits, p.out_splits, p.group), None
        p.grad_work.wait()
        grad_N, p.grad_N, p.grad_work = p.grad_N, None, None
        return grad_N, None


class _AllToAllWait(Function):
    """Forward: block until the exchange has landed (identity on its buffer). Backward: start
    the reverse exchange of the gradient and return at once, so autograd runs other ready
    nodes (another chunk's experts) before it reaches :class:`_AllToAllStart`, which waits."""

    @staticmethod
    def forward(ctx, out_M, pending):
        pending.work.wait()
        pending.work = None
        ctx.pending = pending
        ctx.arena = workspace.current_arena()
        return out_M.view_as(out_M)

    @staticmethod
    def backward(ctx, grad_M):
        p = ctx.pending
        grad_M = grad_M.contiguous()
        with workspace.ctx_arena(ctx):
            p.grad_N = _rows_buffer(grad_M, sum(p.in_splits))
        p.grad_work = start(dist.all_to_all_single, p.grad_N, grad_M, p.in_splits,
                            p.out_splits, group=p.group)
        # Delayed expert weight gradients (model.moe.delay_wgrad_compute) run in its shadow.
        delayed_wgrad.run_pending(in_flight=True)
        # grad_M stands in for the gradient of the buffer; _AllToAllStart.backward returns
        # p.grad_N (the real one) instead of reading it.
        return grad_M, None


# --- public API --------------------------------------------------------------------------------

def all_to_all(x_N: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: Any) -> torch.Tensor:
    """Send rows ``x_N[sum(input_splits[:r]) : ...+input_splits[r]]`` to rank r; receive
    ``output_splits[r]`` rows from rank r, concatenated in rank order. Zero-size splits are fine."""
    world = group_size(group)
    in_splits = _check_splits("input_splits", input_splits, world, x_N.shape[0])
    out_splits = _check_splits("output_splits", output_splits, world, None)
    if world == 1:
        if out_splits != in_splits:
            raise ValueError(f"output_splits {out_splits} ≠ input_splits {in_splits} on a single "
                             "rank. Fix: without a group every row stays, so pass the same splits")
        return x_N
    return _AllToAll.apply(x_N, out_splits, in_splits, group)


def all_to_all_start(x_N: torch.Tensor, output_splits: Sequence[int],
                     input_splits: Sequence[int], group: Any) -> PendingAllToAll:
    """:func:`all_to_all` split in two: start it now (it runs on the backend's own threads, gloo
    or NCCL), take the rows with ``.wait()`` later; compute issued in between overlaps it. The
    backward is split the same way (started by the wait's backward, waited for by the start's),
    so autograd can run another chunk's backward while the gradient travels. Same rows, same
    gradients as :func:`all_to_all`; at one rank ``wait()`` returns ``x_N``."""
    world = group_size(group)
    in_splits = _check_splits("input_splits", input_splits, world, x_N.shape[0])
    out_splits = _check_splits("output_splits", output_splits, world, None)
    pending = PendingAllToAll(out_splits, in_splits, group)
    if world == 1:
        if out_splits != in_splits:
            raise ValueError(f"output_splits {out_splits} ≠ input_splits {in_splits} on a single "
                             "rank. Fix: without a group every row stays, so pass the same splits")
        pending.out_M = x_N
        return pending
    pending.out_M = _AllToAllStart.apply(x_N, pending)
    return pending


def all_gather(x_N: torch.Tensor, group: Any, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's rows along dim 0, in rank order; ranks may hold different row
    counts. ``sizes`` (rows per rank) saves one small collective when the caller knows them.
    Backward: reduce-scatter (sum of all ranks' grads of this rank's rows)."""
    world = group_size(group)
    if world == 1:
        if sizes is not None:
            _check_splits("sizes", sizes, 1, x_N.shape[0])
        return x_N
    sizes_W = (gather_ints(x_N.shape[0], group) if sizes is None else
               _check_splits("sizes", sizes, world, None))
    if sizes_W[group_rank(group)] != x_N.shape[0]:
        raise ValueError(f"sizes[{group_rank(group)}] = {sizes_W[group_rank(group)]} but this "
                         f"rank has {x_N.shape[0]} rows. Fix: pass this rank's true row count")
    return _GatherScatter.apply(x_N, sizes_W, group, True)


def reduce_scatter(x_M: torch.Tensor, group: Any, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum ``x_M`` over ranks and keep rank r's block of rows (``sizes[r]`` rows; equal blocks
    when ``sizes`` is None). Backward: all-gather."""
    world = group_size(group)
    if sizes is None:
        if x_M.shape[0] % world:
            raise ValueError(f"reduce_scatter: dim 0 has {x_M.shape[0]} rows, not divisible by "
                             f"the group size {world}. Fix: pad the rows or pass sizes=")
        sizes = [x_M.shape[0] // world] * world
    sizes_W = _check_splits("sizes", sizes, world, x_M.shape[0])
    if world == 1:
        return x_M
    return _GatherScatter.apply(x_M, sizes_W, group, False)


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ranks. Backward all-reduces the grad: each rank's loss depends on the sum."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group, False)


# Megatron tensor-parallel regions (megatron/core/tensor_parallel/mappings.py, same semantics).

def copy_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a TP region (column-parallel input): identity; backward all-reduce."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region (row-parallel output): all-reduce; backward identity, because the code
    after it is replicated on every TP rank and its grad is already the same everywhere."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group, True)


def scatter_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers the last dim."""
    return x if group_size(group) == 1 else _Split.apply(x, -1, group)


def gather_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather the last dim; backward keeps this rank's chunk (replicated downstream)."""
    return x if group_size(group) == 1 else _Gather.apply(x, -1, group, False)


def scatter_to_sp_region(x_N: torch.Tensor, group: Any) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dim 0); backward all-gathers dim 0."""
    return x_N if group_size(group) == 1 else _Split.apply(x_N, 0, group)


def gather_from_sp_region(x_N: torch.Tensor, group: Any,
                          tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (dim 0). Backward reduce-scatters when the consumer is a TP region
    whose ranks produce different partial grads (the default), else keeps this rank's chunk."""
    if group_size(group) == 1:
        return x_N
    return _Gather.apply(x_N, 0, group, tensor_parallel_output_grad)


def reduce_scatter_to_sp_region(x_M: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a TP region into sequence-parallel: reduce-scatter dim 0; backward all-gather."""
    return reduce_scatter(x_M, group)
