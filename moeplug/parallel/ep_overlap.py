"""Combined 1F1B EP overlap without pipelining (Megatron ``overlap_moe_expert_parallel_comm``,
``combined_1f1b_schedule_for_no_pipelining``): with two micro-batches in flight, the backward
of one runs while the next one runs forward, so each one's expert-parallel exchanges hide
behind the other's compute.

Legend: M micro-batches of one optimizer step; F_m / B_m the forward / backward of micro-batch m.

    F_0 | B_0 || F_1 | B_1 || F_2 | ... | B_{M-2} || F_{M-1} | B_{M-1}

``B_{m-1} || F_m``: the backward runs on a helper thread (CPU autograd runs a backward on the
thread that calls it) while this thread runs the forward; torch ops and gloo waits release the
GIL, so both compute, and while one waits on an exchange the other's compute fills the gap.
Megatron interleaves the two at sub-layer granularity on CUDA streams; here the operating
system interleaves two threads, which needs no per-layer split of the model.

Collective order: each thread's collectives must be issued in the same order on every rank,
but two threads race. The helper thread therefore issues its collectives on twins of the
process groups (``ParallelGroups.twins``, same ranks, own gloo context;
``moeplug.parallel.comm.on_twin_groups``): the main thread's order on the groups is
F_0..F_{M-1}, B_{M-1} and the helper's on the twins is B_0..B_{M-2}, each fixed on all ranks.

Every layout's collectives take that path, so the schedule composes with all of them: EP/ETP
exchanges and TP/SP regions (moeplug.parallel.comm), the vocab-parallel loss
(tensor_parallel), the CP K/V exchange, all-gather or ring (context_parallel: the ring's
isend/irecv would otherwise share (group, tag) with the next micro-batch's forward ring and
swap blocks between them), and the routers' count sums all pass their group through
``comm.active_group``. A collective on a group without a twin raises instead of hanging.
Tested bitwise, overlap on vs off, at EP2, EP4, EP2 x DP2, PP2 x EP2, TP2 x SP x EP2,
TP2 x DP2 (no SP), CP2 x EP2 (both CP modes), TP2 x SP x PP2 x EP2, TP2 x SP x EP2 with
the dense MLP recomputed (its TP collectives rerun inside the backward), ETP2, ETP2 x EP2,
TP2 x SP x ETP2 x EP2, PP2 x ETP2, MLA (EP2 with its up projections recomputed, TP2 x SP x
EP2), MTP (EP2), PP2 x EP2 with MLA and MTP, the MoE layer recomputed (EP2, PP2 x EP2; full
recompute at TP2 x SP x EP2 and with direct_write) and the hierarchical dispatcher (2 nodes x
2 ranks: its subgroups register twins) (tests/test_overlap.py; the validation loss after the
steps too). Both threads checkpoint (the forward saves the RNG state, the backward's recompute
replays it): torch's own RNG save can deadlock between two threads, so checkpoints save and
replay it under moeplug.modules.recompute._RNG_LOCK.
Still refused by config: one micro-batch, runtime.stash, and any recompute while the router
draws input jitter (the replay on the helper thread would move the generator the forward
draws from).

Numerics: every micro-batch runs the same ops as in the plain loop, on the same intra-op thread
count (the helper thread takes the caller's), and the backwards still run
one after another in micro-batch order (B_{m-1} is joined before B_m starts), so parameter
gradients accumulate in the same order: losses and gradients are bitwise those of the plain
loop (tests/test_overlap.py). Only the forward of m reads parameters while B_{m-1} writes
``.grad``, which the forward never reads.

With pipeline parallelism (moeplug.parallel.schedules) the same :func:`run_beside` runs every
"backward, then forward" pair of a rank's 1F1B op list side by side, e.g. rank 0 of PP2 with
M = 4: ``F0 F1 | B0 || F2 | B1 || F3 | B2 B3``. A forward never waits on a backward of its own
rank and every op starts no later than in the plain order, so the tagged pipeline messages
(moeplug.parallel.p2p, on the base pipeline group from either thread) cannot deadlock; every
rank of an EP/DP group sits at the same pipeline rank, so both threads' collective orders agree
across the group.

Split weight-gradient computation (``model.moe.delay_wgrad_compute``, moeplug.ops.delayed_wgrad)
composes with both: the queue is per thread, so each backward's deferred expert GEMMs run
during that backward's own dispatch exchange.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Mapping, TypeVar

import torch

from moeplug.observability.timing import stage
from moeplug.parallel.comm import on_twin_groups

Out = TypeVar("Out")


def run_beside(backward: Callable[[], None], forward: Callable[[], Out],
               twins: Mapping[Any, Any], name: str = "moeplug-backward") -> Out:
    """``backward()`` on a helper thread over the twin groups while ``forward()`` runs here;
    returns the forward's result once both finished (an exception on either is raised here).
    The join is the sync point: the backward's gradients are in ``.grad`` before the caller's
    next backward starts, so gradients accumulate in the plain order."""
    errors: list[BaseException] = []
    threads = torch.get_num_threads()

    def run_backward() -> None:
        try:
            # A new thread's MKL runs on the process default thread count (the cores, or
            # OMP_NUM_THREADS as the process started), not on what torch.set_num_threads set
            # here (torch.get_num_threads() on that thread still reports this one's). A GEMM
            # that MKL splits rounds by the split: the backward was bitwise the plain loop's
            # only where MKL happened not to split its GEMMs, and N ranks ran N x cores MKL
            # threads (tests/test_overlap.py::test_the_overlapped_backward_...).
            torch.set_num_threads(threads)
            with on_twin_groups(twins):
                backward()
        except BaseException as exc:  # re-raised on the caller's thread below
            errors.append(exc)

    helper = threading.Thread(target=run_backward, name=name)
    helper.start()
    try:
        out = forward()
    finally:
        # The stage clock is per thread: what it shows as "backward" here is the part the
        # forward did not hide.
        with stage("backward"):
            helper.join()
    if errors:
        raise errors[0]
    return out


def combined_1f1b(forward: Callable[[int], Out], backward: Callable[[int, Out], None],
                  num_microbatches: int, twins: Mapping[Any, Any]) -> None:
    """Run ``forward(m)`` and ``backward(m, forward's result)`` for m = 0..M-1 with B_{m-1}
    overlapping F_m. An exception on either thread is raised here after both finished."""
    out = forward(0)
    for m in range(1, num_microbatches):
        out = run_beside(functools.partial(backward, m - 1, out), functools.partial(forward, m),
                         twins, name=f"moeplug-backward-{m - 1}")
    backward(num_microbatches - 1, out)
