"""The intra-node stage of the hierarchical dispatcher: "redistribute these rows among the ranks of
my node", and back. This module is the seam: the hierarchical dispatcher calls nothing else to
move rows inside a node, so a shared-memory transport (direct writes into the owner's receive
buffer, counts published in a symmetric heap) replaces :class:`TorchIntraNode` without touching
the dispatcher. Two transports: :class:`ShmIntraNode`, that shared-memory one (the default on
the CPU: HybridEP's intra-node stage, writes into the owners' memory), and
:class:`TorchIntraNode`, a torch.distributed all-to-all on the node's subgroup (gloo on the
CPU, NCCL on GPUs).

Legend: n ranks in the node, X chunks per destination rank (the dispatcher uses X = L local
experts x N source nodes), S rows this rank receives.

Contract of a transport (what a replacement must keep):
    plan(counts_nX)  counts_nX[j, x]: rows this rank sends to node rank j in chunk x. Returns a
                     frozen plan holding, as :class:`~moeplug_plugins.dispatchers._ep_comm.A2APlan`
                     does, send_W / recv_W (rows per peer), counts_WL (rows received from node
                     rank j in chunk x, int64 CPU [n, X]; the sort by local expert reads it
                     to turn arrival order (source j, chunk x)-major into (chunk x, source
                     j)-major).
    there(rows, plan) rows grouped by destination (j-major, chunk-major inside) -> this rank's
                     rows in arrival order (source j, chunk x)-major; differentiable, its backward
                     is ``back``.
    back(rows, plan)  the inverse of ``there`` (rows in arrival order); differentiable.
At one rank (group None) every step is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeplug.api import active_group, heap_for, shm_rows, workspace
from moeplug_plugins.dispatchers import _ep_comm


class TorchIntraNode:
    """torch.distributed all-to-all over the node's subgroup (``group``; None = one rank)."""

    def __init__(self, group: Any):
        self.group = group

    def plan(self, counts_nX: torch.Tensor) -> _ep_comm.A2APlan:
        counts_nX = counts_nX.to(torch.int64).cpu()
        if self.group is None:  # one rank: its rows stay (the row sum in Python: no tensor)
            return _ep_comm.local_plan(counts_nX.reshape(-1), sum(counts_nX.reshape(-1).tolist()))
        # exchange_counts views the flat counts as [n, X]: peer j gets row j.
        return _ep_comm.exchange_counts(counts_nX.reshape(-1), self.group)

    def there(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.group is None else _ep_comm.all_to_all_there(rows, plan, self.group)

    def back(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.group is None else _ep_comm.all_to_all_back(rows, plan, self.group)


@dataclass(frozen=True)
class ShmPlan(_ep_comm.A2APlan):
    """An :class:`~moeplug_plugins.dispatchers._ep_comm.A2APlan` plus where the rows go in the
    node ranks' heaps. Runs are (src_row, node rank, dest_row, rows), as shm_rows.to_sources
    copies them."""

    there_C4: torch.Tensor    # my rows, grouped by destination, into each receiver's area
    back_C4: torch.Tensor     # the rows I received, back to their sources' grouped order
    recv_rows_n: list[int]    # rows every node rank receives on the way there
    sent_rows_n: list[int]    # rows every node rank sent (what it receives back)
    num_slots: int            # the heap's count slots (one heap per group and slot count)


class ShmIntraNode:
    """Direct writes through the node's shared-memory heap (moeplug.parallel.shm_heap): every rank
    publishes its counts in its heap slots (one barrier, no count all-to-all), then writes each
    destination's rows straight into that rank's receive area at the place the counts give it;
    the receiver's rows are tensors over its area (no copy out). ``back`` is the same with the
    roles swapped. The node's ranks must share one machine (the heap checks it at set-up)."""

    def __init__(self, group: Any, heap_bytes: int, timeout_s: float = 300.0):
        self.group = group
        self.heap_bytes = heap_bytes
        self.timeout_s = timeout_s

    def _heap(self, num_slots: int):
        # Looked up per call: inside the combined 1F1B's overlapped backward the node group's
        # twin has a heap of its own, so the two threads' ops never share a sequence.
        return heap_for(active_group(self.group), self.heap_bytes, num_slots, self.timeout_s)

    def plan(self, counts_nX: torch.Tensor) -> ShmPlan:
        counts_nX = counts_nX.to(torch.int64).cpu().contiguous()
        n, X = counts_nX.shape
        heap = self._heap(1 + n * X)
        heap.arrive(0, counts_nX.reshape(-1))
        all_SRX = heap.read_slots(n * X).view(n, n, X)  # [source, destination, chunk]
        me = heap.rank
        # Every tensor an out= result in the running layer's workspace, the row sums Python's.
        new = workspace.empty
        rows_SR = torch.sum(all_SRX, 2, out=new((n, n), torch.int64))
        # rows of the earlier sources, per dest; rows to the earlier dests, per source
        before_S = torch.cumsum(rows_SR, 0, out=new((n, n), torch.int64)).sub_(rows_SR)
        before_R = torch.cumsum(rows_SR, 1, out=new((n, n), torch.int64)).sub_(rows_SR)
        ranks = torch.arange(n, out=new((n,), torch.int64))
        # there: my block for destination j (at before_R[me, j] in my grouped rows) lands in j's
        # area after the blocks of the sources before me (before_S[me, j]). Runs of 0 rows copy
        # nothing (kept: the tables' sizes are n whatever the routing).
        there = torch.stack([before_R[me], ranks, before_S[me], rows_SR[me]], dim=1,
                            out=new((n, 4), torch.int64))
        # back: the block I received from source j (at before_S[j, me] in my arrival order) goes
        # back to where j had it in its grouped rows (before_R[j, me]).
        back = torch.stack([before_S[:, me], ranks, before_R[:, me], rows_SR[:, me]], dim=1,
                           out=new((n, 4), torch.int64))
        rows = rows_SR.tolist()
        return ShmPlan(send_W=rows[me], recv_W=[r[me] for r in rows],
                       counts_WL=new((n, X), torch.int64).copy_(all_SRX[:, me, :]),
                       there_C4=there, back_C4=back,
                       recv_rows_n=[sum(r[j] for r in rows) for j in range(n)],
                       sent_rows_n=[sum(r) for r in rows], num_slots=1 + n * X)

    def there(self, rows: torch.Tensor, plan: ShmPlan) -> torch.Tensor:
        return _ShmMove.apply(self, plan, True, rows)

    def back(self, rows: torch.Tensor, plan: ShmPlan) -> torch.Tensor:
        return _ShmMove.apply(self, plan, False, rows)

    def move(self, rows: torch.Tensor, plan: ShmPlan, there: bool) -> torch.Tensor:
        """One heap op: this rank's runs written into the receivers' areas, then the wait for
        every rank's; this rank's received rows over its area."""
        if rows.device.type != "cpu":
            raise ValueError(f"hierarchical's shared-memory intra-node stage moves CPU tensors; "
                             f"got rows on {rows.device}. Fix: set plugins.dispatcher_options."
                             f"intra_node=torch (NCCL inside the node) on GPU")
        rows = rows.contiguous()
        heap = self._heap(plan.num_slots)
        seq = heap.arrive(shm_rows.row_bytes([(rows, False)]))
        chunks, rows_n = ((plan.there_C4, plan.recv_rows_n) if there
                          else (plan.back_C4, plan.sent_rows_n))
        # the heap grows on demand (no fixed size, so no size option to name)
        (got,) = shm_rows.to_sources(heap, seq, [rows], chunks, rows_n)
        return got


class _ShmMove(torch.autograd.Function):
    """there / back through the heap; the backward of each is the other."""

    @staticmethod
    def forward(ctx, intra, plan, there, rows):
        ctx.intra, ctx.plan, ctx.there = intra, plan, there
        ctx.arena = workspace.current_arena()  # backward's small buffers: this layer's
        return intra.move(rows, plan, there)

    @staticmethod
    def backward(ctx, grad):
        with workspace.ctx_arena(ctx):
            return None, None, None, ctx.intra.move(grad, ctx.plan, not ctx.there)
