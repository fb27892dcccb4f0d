"""The intra-node stage of the hierarchical dispatcher: "redistribute these rows among the ranks of
my node", and back. This module is the seam: the hierarchical dispatcher calls nothing else to
move rows inside a node, so a shared-memory transport (direct writes into the owner's receive
buffer, counts published in a symmetric heap) replaces :class:`TorchIntraNode` without touching
the dispatcher. Today it is a torch.distributed all-to-all on the node's subgroup (gloo on the
CPU, NCCL on GPUs).

Legend: n ranks in the node, X chunks per destination rank (the dispatcher uses X = L local
experts x N source nodes), S rows this rank receives.

Contract of a transport (what a replacement must keep):
    plan(counts_nX)  counts_nX[j, x]: rows this rank sends to node rank j in chunk x. Returns a
                     frozen plan holding, as :class:`~moeplug_plugins.dispatchers._ep_comm.A2APlan`
                     does, send_W / recv_W (rows per peer), counts_WL (rows received from node
                     rank j in chunk x, int64 CPU [n, X]) and order_S (sorts arrival order
                     (source j, chunk x)-major into (chunk x, source j)-major).
    there(rows, plan) rows grouped by destination (j-major, chunk-major inside) -> this rank's
                     rows in arrival order (source j, chunk x)-major; differentiable, its backward
                     is ``back``.
    back(rows, plan)  the inverse of ``there`` (rows in arrival order); differentiable.
At one rank (group None) every step is the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from moeplug_plugins.dispatchers import _ep_comm


class TorchIntraNode:
    """torch.distributed all-to-all over the node's subgroup (``group``; None = one rank)."""

    def __init__(self, group: Any):
        self.group = group

    def plan(self, counts_nX: torch.Tensor) -> _ep_comm.A2APlan:
        counts_nX = counts_nX.to(torch.int64).cpu()
        if self.group is None:
            return _ep_comm.A2APlan(send_W=[int(counts_nX.sum())], recv_W=[int(counts_nX.sum())],
                                    counts_WL=counts_nX, order_S=_ep_comm.chunk_order(counts_nX))
        # exchange_counts views the flat counts as [n, X]: peer j gets row j.
        return _ep_comm.exchange_counts(counts_nX.reshape(-1), self.group)

    def there(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.group is None else _ep_comm.all_to_all_there(rows, plan, self.group)

    def back(self, rows: torch.Tensor, plan: _ep_comm.A2APlan) -> torch.Tensor:
        return rows if self.group is None else _ep_comm.all_to_all_back(rows, plan, self.group)
