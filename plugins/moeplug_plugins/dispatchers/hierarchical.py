"""``hierarchical`` dispatcher: each token crosses the network at most once per destination node,
then fans out inside the node (HybridEP's idea, over torch.distributed subgroups).

Legend: T local tokens, K top-k, D hidden, E experts (global), L local experts, N nodes, n EP
ranks per node, M = n*L experts per node, A rows this rank sends over the network (one per
token and destination node), B rows it receives from the network, R their choices in my node
(node-permuted rows), S rows for the local experts. The node split: moeplug_plugins.dispatchers._nodes.

dispatch:
    1. dedupe       one row per (token, destination node), node-major; each carries its K
                    choices as node-local expert ids (M = "not in this node, or dropped") and
                    their probs (0 there)
    2. network      counts, then rows / probs / ids, all-to-all among the ranks with my local
                    index (one per node); rows in FP8 + scales when a low-precision recipe with
                    quantize_dispatch is active (moeplug.quant.wire), as alltoall
    3. node permute group the arrived rows' choices in my node by node-local expert (a stable
                    sort: only real choices are copied, no sink rows)
    4. fan out      the intra-node stage (moeplug_plugins.dispatchers.intra_node) sends each
                    expert's rows to its owner: on the CPU by direct writes into the owner's
                    receive area in the node's shared-memory heap (counts in the heap's slots,
                    no count all-to-all), else a torch.distributed all-to-all in the node
    5. sort         arrival is (node rank j, local expert, source node a)-major: reorder to
                    (local expert, a, j), i.e. (expert, source EP rank a*n + j) - the order the
                    alltoall dispatcher gives, so the experts see the same rows in the same order
    6. pad          as alltoall (capacity * ep_size or pad_multiple, moeplug.routing.rows)
combine runs the inverse: unpad -> unsort -> back inside the node -> index_add per arrived row
(the partial sum of its choices in this node: one row per (token, node) goes back) -> network
back -> sum the nodes' partial rows per token. Dropped choices never leave the rank; a token with all its choices
dropped sends nothing and gets zeros, as with alltoall. At one process every exchange is the
identity (one node of one rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeplug.api import (active_recipe, append_sink_rows, comm, Dispatched, Dispatcher, first_rows,
                         ModelConfig, pad_rows, padded_counts, permute, permute_probs,
                         quantized_exchange, RouterOutput, sink_dropped, unpad_rows, unpermute,
                         workspace)
from moeplug_plugins.dispatchers import _ep_comm, _nodes
from moeplug_plugins.dispatchers._group import ep_layout
from moeplug_plugins.dispatchers.direct_write import default_heap_bytes
from moeplug_plugins.dispatchers.intra_node import ShmIntraNode, TorchIntraNode


def _id_dtype(num_node_experts: int) -> torch.dtype:
    """Smallest dtype gloo and NCCL both carry that holds ids 0..M (M: "not in this node")."""
    return torch.uint8 if num_node_experts < 256 else torch.int32


@dataclass(frozen=True)
class NetworkPlan:
    send_N: list[int]  # rows this rank sends to each node (to the rank with my local index)
    recv_N: list[int]  # rows it receives from each node


@dataclass(frozen=True)
class HierarchicalMeta:
    num_tokens: int            # T, to sum the nodes' partial rows back into
    token_A: torch.Tensor      # local token of each row sent over the network
    net: NetworkPlan           # the network exchange, both directions
    row_map_BK: torch.Tensor   # node-permuted row of each arrived (row, choice) in my node
    num_sink_rows: int         # arrived choices outside my node (cut after the permute)
    intra: _ep_comm.A2APlan    # the intra-node exchange (counts and sort order)
    mover: Any                 # the intra-node transport that planned it (moves it back too)
    pad_index_S: torch.Tensor | None = None  # padded-buffer position of each real row


class HierarchicalDispatcher(Dispatcher):
    quantizes_dispatch = True  # moeplug.quant.wire under a quantize_dispatch recipe
    def __init__(self, model: ModelConfig, group=None, node_size: int = 0,
                 intra_node: str = "auto"):  # as the plugin option
        self.group = group
        self.ep_size, self.ep_rank, self.num_local_experts = ep_layout(model, group)
        self.num_experts = model.moe.num_experts
        if group is None:  # one process: one node of one rank, whatever node_size says
            self.split = _nodes.NodeSplit(num_nodes=1, node_size=1, node=0, local=0)
            intra, self.inter = None, None
        else:
            members = dist.get_process_group_ranks(group)
            self.split = _nodes.split(members, self.ep_rank, node_size)
            intra, self.inter = _nodes.node_groups(members, self.split,
                                                   _nodes.group_timeout(group))
            if comm.has_twin(group):
                # combined 1F1B: the overlapped backward's exchanges need twins of these
                # subgroups too (built in the same order on every member, as the subgroups)
                twins = _nodes.node_groups(members, self.split, _nodes.group_timeout(group))
                for sub, twin in zip((intra, self.inter), twins):
                    if sub is not None:
                        comm.register_twin(sub, twin)
        self._torch_intra = TorchIntraNode(intra)
        # the node's rows move through its shared-memory heap, unless asked otherwise or the
        # platform lacks it (plugins.dispatcher_options.intra_node); CUDA tokens take torch's
        # all-to-all under "auto" (moved by NCCL, no host staging)
        self.intra_node = intra_node
        if intra_node == "auto":
            from moeplug_plugins.dispatchers import direct_write_unavailable
            intra_node = "torch" if direct_write_unavailable() else "shm"
        self.intra = (ShmIntraNode(intra, default_heap_bytes(model, self.split.node_size),
                                   _nodes.group_timeout_s(group))
                      if intra_node == "shm" and intra is not None else self._torch_intra)

    def dispatch(self, x_TD: torch.Tensor, routing: RouterOutput) -> Dispatched:
        N, n, L = self.split.num_nodes, self.split.node_size, self.num_local_experts
        M = n * L
        T, K = routing.ids_TK.shape
        new = workspace.allocator(x_TD.device)  # on the CPU the running layer's workspace
        # 1. dedupe: one row per (token, destination node)
        ids_TK = sink_dropped(routing.ids_TK, routing.dropped_TK, self.num_experts)
        node_TK = torch.floor_divide(ids_TK, _number(new, M), out=new((T, K), torch.int64))
        token_A, node_A, send_N = _dedupe(node_TK, N, new)  # dropped choices: node N, none
        A = token_A.shape[0]
        nodes_AK = torch.index_select(node_TK, 0, token_A, out=new((A, K), torch.int64))
        elsewhere_AK = torch.ne(nodes_AK, node_A.unsqueeze(1), out=new((A, K), torch.bool))
        local_AK = torch.index_select(ids_TK, 0, token_A, out=new((A, K), torch.int64))
        local_AK.sub_(torch.mul(node_A, _number(new, M), out=new((A,), torch.int64)).unsqueeze(1))
        local_AK.masked_fill_(elsewhere_AK, M)  # M: not in this row's node
        probs_AK = _IndexRows.apply(routing.probs_TK, token_A, T, True, elsewhere_AK)
        x_AD = _IndexRows.apply(x_TD, token_A, T, True, None)
        # 2. network
        net = self._network_plan(send_N)
        x_BD = self._send_rows(x_AD, net)
        probs_BK = self._network(probs_AK, net)
        with torch.no_grad():  # node-local ids in one byte when they fit: less metadata
            ids_small = new((A, K), _id_dtype(M)).copy_(local_AK)
            local_BK = self._network(ids_small, net)
            B = local_BK.shape[0]
            local_BK = new((B, K), torch.int64).copy_(local_BK)
        # 3. node permute: the arrived rows' choices in my node, grouped by (node-local
        #    expert, source node) - the same order as by expert alone, since rows arrive
        #    source-node-major - and kept in (row, choice) order inside a group (permute is
        #    stable); choices outside the node go to a sink group M*N, sorted last and cut off
        src_B = new((B,), torch.int64)
        at = 0
        for a, rows in enumerate(net.recv_N):
            src_B[at:at + rows].fill_(a)
            at += rows
        group_BK = torch.mul(local_BK, _number(new, N), out=new((B, K), torch.int64))
        group_BK.add_(src_B.unsqueeze(1))
        group_BK.masked_fill_(torch.eq(local_BK, M, out=new((B, K), torch.bool)), M * N)
        x_RD, row_map_BK, counts = permute(x_BD, group_BK, M * N + 1)
        probs_R = permute_probs(probs_BK, row_map_BK)
        num_sink = int(counts[M * N])
        if num_sink:  # a slice's backward zero-fills and copies the whole buffer: only if needed
            R = x_RD.shape[0] - num_sink
            x_RD, probs_R = first_rows(x_RD, R), first_rows(probs_R, R)
        counts_MN = counts[:M * N]  # rows per (node expert, source node)
        # 4. fan out inside the node  5. sort to (local expert, source EP rank)
        mover = self._intra_for(x_TD)
        intra = mover.plan(counts_MN.view(n, L * N))
        x_SD = _ep_comm.sort_by_local_expert(mover.there(x_RD, intra), intra)
        probs_S = _ep_comm.sort_by_local_expert(mover.there(probs_R, intra), intra)
        # 6. pad
        counts_L = torch.sum(intra.counts_WL.view(n, L, N), dim=(0, 2),
                             out=workspace.empty((L,), torch.int64))
        target_L = padded_counts(counts_L, routing.capacity, routing.pad_multiple, self.ep_size,
                                 self._capacities(routing.capacity))
        x_SD, probs_S, pad_index_S = pad_rows(x_SD, probs_S, counts_L, target_L)
        return Dispatched(x_SD, probs_S, target_L,
                          HierarchicalMeta(num_tokens=T, token_A=token_A, net=net,
                                           row_map_BK=row_map_BK, num_sink_rows=num_sink,
                                           intra=intra, mover=mover, pad_index_S=pad_index_S))

    def combine(self, y_SD: torch.Tensor, meta: HierarchicalMeta) -> torch.Tensor:
        y_SD = _ep_comm.unsort_by_local_expert(unpad_rows(y_SD, meta.pad_index_S), meta.intra)
        y_RD = meta.mover.back(y_SD, meta.intra)
        # the partial sum of each arrived row's choices in my node: one row per (token, node)
        y_BD = unpermute(append_sink_rows(y_RD, meta.num_sink_rows), meta.row_map_BK)
        y_AD = self._network_back(y_BD, meta.net)
        return _IndexRows.apply(y_AD, meta.token_A, meta.num_tokens, False, None)

    def _intra_for(self, x_TD: torch.Tensor) -> Any:
        if x_TD.device.type != "cpu" and self.intra_node == "auto":
            return self._torch_intra
        return self.intra

    # ---- the network stage (identity with one node; see _ep_comm / comm) --------------------
    def _network_plan(self, send_N: torch.Tensor) -> NetworkPlan:
        if self.inter is None:
            return NetworkPlan(send_N=send_N.tolist(), recv_N=send_N.tolist())
        N = len(send_N)
        with torch.no_grad():
            recv_N = comm.all_to_all(send_N.to(torch.int64), [1] * N, [1] * N, self.inter)
        return NetworkPlan(send_N=send_N.tolist(), recv_N=recv_N.tolist())

    def _network(self, rows: torch.Tensor, net: NetworkPlan) -> torch.Tensor:
        return rows if self.inter is None else comm.all_to_all(rows, net.recv_N, net.send_N,
                                                               self.inter)

    def _network_back(self, rows: torch.Tensor, net: NetworkPlan) -> torch.Tensor:
        return rows if self.inter is None else comm.all_to_all(rows, net.send_N, net.recv_N,
                                                               self.inter)

    def _send_rows(self, x_AD: torch.Tensor, net: NetworkPlan) -> torch.Tensor:
        recipe = active_recipe()
        if recipe is None or not recipe.quantize_dispatch:
            return self._network(x_AD, net)
        # Quantized at one process too, so a single process sees alltoall's numerics.
        return quantized_exchange(x_AD, recipe, lambda t: self._network(t, net),
                                  lambda g: self._network_back(g, net))

    def _capacities(self, capacity: int | None) -> list[int] | None:
        if capacity is None or self.ep_size == 1:
            return None
        return _ep_comm.gather_capacities(capacity, self.group)


def _number(new, value: int) -> torch.Tensor:
    """``value`` as a 0-d int64 tensor from ``new``: an op given a Python number wraps it in a
    freshly allocated tensor each call."""
    return new((), torch.int64).fill_(value)


def _dedupe(node_TK: torch.Tensor, N: int, new) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_A, node_A, send_N): one entry per (token, destination node) among nodes 0..N-1
    (node N: dropped), node-major and in token order inside a node; rows per node."""
    T = node_TK.shape[0]
    # int64, not bool: a bool sum into int64 casts a copy of its input first
    hit_TN = new((T, N + 1), torch.int64).zero_().scatter_(1, node_TK, 1)[:, :N]
    send_N = torch.sum(hit_TN, 0, out=new((N,), torch.int64))
    A = sum(send_N.tolist())
    nz_A2 = torch.nonzero(hit_TN.t(), out=new((A, 2), torch.int64))
    node_A = new((A,), torch.int64).copy_(nz_A2[:, 0])
    token_A = new((A,), torch.int64).copy_(nz_A2[:, 1])
    return token_A, node_A, send_N


class _IndexRows(torch.autograd.Function):
    """``gather``: ``x[index]`` (rows of ``mask``, when given, zeroed); else the adjoint,
    ``zeros(num_rows, ...).index_add_(0, index, x)``. Each one's backward is the other, into
    workspace buffers (index_select's backward and index_add's forward allocated zeros)."""

    @staticmethod
    def forward(ctx, x, index, num_rows, gather, mask):
        ctx.save_for_backward(index)
        ctx.num_rows, ctx.gather, ctx.mask = x.shape[0], gather, mask
        ctx.arena = workspace.current_arena()
        return _index_rows(x, index, num_rows, gather, mask)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            return (_index_rows(grad, index, ctx.num_rows, not ctx.gather, ctx.mask),
                    None, None, None, None)


def _index_rows(x: torch.Tensor, index: torch.Tensor, num_rows: int, gather: bool,
                mask: torch.Tensor | None) -> torch.Tensor:
    new = workspace.allocator(x.device)
    if gather:
        out = torch.index_select(x, 0, index, out=new((index.shape[0], *x.shape[1:]), x.dtype))
        return out if mask is None else out.masked_fill_(mask, 0)
    if mask is not None:
        x = new(tuple(x.shape), x.dtype).copy_(x).masked_fill_(mask, 0)
    return new((num_rows, *x.shape[1:]), x.dtype).zero_().index_add_(0, index, x)

