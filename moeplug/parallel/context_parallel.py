"""Context parallelism (CP): causal self-attention over a sequence split across ``groups.cp``.

Layout (Megatron's load balancing for causal attention): the full sequence of N tokens is cut
into 2·W chunks of c = N / (2·W) tokens and CP rank i holds chunks i and 2·W-1-i, in that order.
Under a causal mask a late chunk attends to many keys and an early one to few, so pairing the
i-th earliest with the i-th latest gives every rank the same amount of attention work.

Only attention mixes tokens, so it is the only module that communicates: RoPE rotates each held
token at its *global* position, and each rank's queries need the keys/values of every causally
visible token. Two ways to get them (``ParallelConfig.cp_comm``):

  allgather  all-gather every rank's K, V (one collective); each local query chunk attends to
             the keys up to its own end with a global-position causal mask. The all-gather's
             backward reduce-scatters dK, dV back to the ranks that own them.
  ring       W steps; at each step a rank attends to the K, V block it holds and passes it to the
             next rank (send/recv, overlapped with the compute). Partial results are merged with
             the flash-attention log-sum-exp rule. The backward is its own ring: K, V travel
             again together with their dK, dV accumulators, which arrive home after W hops.

Packed documents (``data.document_mask``): each held token also carries its position in its
document, sharded with the tokens. RoPE rotates at those positions, and a query at global index
i with position p sees only the keys in [i - p, i] (moeplug.data.documents.visible): the
allgather mask and each ring block's mask come from the queries' positions and the keys' global
indices, so no document ids travel. In the ring a query row may see no key of a block at all
(the block lies in earlier documents); its partial result is empty (log-sum-exp -inf) and the
merge gives it weight 0. Blocks that no query sees are skipped, as under the causal mask.

Everything else (norms, MLP, MoE, the LM head) is per token and runs unchanged on the shard.
The loss is the mean over every token of the CP group (:func:`cp_cross_entropy`); gradients of
replicated parameters are then averaged over DP x CP by ``sync_gradients`` (its ``dp_cp``
group), which gives the single-process gradient (see ``cp_cross_entropy``).

Legend: B batch, N full sequence, S = N / W tokens held by this rank, c = S / 2 chunk length,
J key tokens of one block, H query heads, G key/value heads (H % G == 0), Dh head dim, W CP ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from moeplug.data.documents import attention_mask, visible
from moeplug.parallel.comm import active_group, all_gather, all_reduce, group_rank, group_size
from moeplug.parallel.tensor_parallel import vocab_parallel_cross_entropy

CP_COMMS = ("allgather", "ring")

# Tags keep the forward ring, the backward K/V ring and the backward dK/dV ring apart, so a
# message can never be taken for another even if a future change overlaps them.
_TAG_KV, _TAG_DKV = 11, 12


# --- the load-balanced layout ------------------------------------------------------------------

def _check_layout(seq_len: int, cp_size: int, cp_rank: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size = {cp_size!r} must be a positive integer. Fix: pass "
                         "groups.size('cp')")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank = {cp_rank} is outside the CP group of size {cp_size}. "
                         "Fix: pass groups.rank_in('cp')")
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(f"seq_len = {seq_len} is not divisible by 2·CP = {2 * cp_size}: context "
                         f"parallelism cuts each sequence into 2·CP equal chunks. Fix: choose "
                         f"train.seq_len a multiple of {2 * cp_size}")


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, ...]:
    """The chunks (of 2·CP) that CP rank ``cp_rank`` holds, in local order."""
    _check_layout(0, cp_size, cp_rank)
    return (0,) if cp_size == 1 else (cp_rank, 2 * cp_size - 1 - cp_rank)


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (int64 [S]) of the tokens CP rank ``cp_rank`` holds, in local order."""
    _check_layout(seq_len, cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in cp_chunk_ids(cp_size, cp_rank)])


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``x`` along the sequence ``dim`` (tokens_BS, targets_BS, x_BSD)."""
    pos_S = cp_positions(x.shape[dim], cp_size, cp_rank).to(x.device)
    return x.index_select(dim, pos_S)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is CP rank r's part; returns the full
    sequence in global order (tests and logging)."""
    W = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    pos_N = torch.cat([cp_positions(seq_len, W, r) for r in range(W)])  # row i holds pos_N[i]
    return torch.cat(list(shards), dim=dim).index_select(dim, torch.argsort(pos_N).to(
        shards[0].device))


# --- the model-facing pieces -------------------------------------------------------------------

class ContextParallelAttention:
    """RoPE at global positions + causal attention for this rank's CP shard.

    Held by :class:`moeplug.modules.attention.Attention` when ``groups.cp`` is set; owns no
    parameters and keeps nothing from a call (the group and the comm mode are configuration).
    """

    def __init__(self, group: Any, comm: str = "allgather") -> None:
        if comm not in CP_COMMS:
            raise ValueError(f"ParallelConfig.cp_comm = {comm!r} is not a CP communication mode. "
                             f"Fix: use one of {', '.join(map(repr, CP_COMMS))}")
        self.group = group
        self.comm = comm

    def __call__(self, q_BHSDh: torch.Tensor, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor,
                 rope: Any, positions_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``positions_BS``: the held tokens' positions in their documents (packed documents):
        RoPE at those, attention within each document; None: RoPE at the global positions."""
        W, r = group_size(self.group), group_rank(self.group)
        if positions_BS is None:
            pos_S = cp_positions(q_BHSDh.shape[-2] * W, W, r).to(q_BHSDh.device)
            q_BHSDh, k_BGSDh = rope(q_BHSDh, k_BGSDh, positions_S=pos_S)
        else:
            q_BHSDh, k_BGSDh = rope(q_BHSDh, k_BGSDh, positions_BS=positions_BS)
        return cp_attention(q_BHSDh, k_BGSDh, v_BGSDh, self.group, self.comm, positions_BS)


def cp_attention_for(groups: Any) -> ContextParallelAttention | None:
    """The CP attention core for a ParallelGroups (None: no CP, or single process)."""
    if groups is None or groups.cp is None:
        return None
    return ContextParallelAttention(groups.cp, groups.config.cp_comm)


def cp_attention(q_BHSDh: torch.Tensor, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor, group: Any,
                 comm: str = "allgather", positions_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole (CP-sharded) sequence.

    Inputs are this rank's shard in the load-balanced layout, RoPE already applied; the output
    equals the matching rows of ``scaled_dot_product_attention(..., is_causal=True)`` on the
    full sequence, and so do the gradients (summed over the ranks' losses). ``positions_BS``
    (this rank's tokens' positions in their documents): with SDPA's block-diagonal causal mask
    of the packed documents instead (moeplug.data.documents.visible).
    """
    if comm not in CP_COMMS:
        raise ValueError(f"cp_comm = {comm!r} is not a CP communication mode. "
                         f"Fix: use one of {', '.join(map(repr, CP_COMMS))}")
    H, G = q_BHSDh.shape[1], k_BGSDh.shape[1]
    if group_size(group) == 1:
        if positions_BS is None:
            return F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh, is_causal=True,
                                                  enable_gqa=G != H)
        index_S = torch.arange(q_BHSDh.shape[-2], device=q_BHSDh.device)
        return F.scaled_dot_product_attention(
            q_BHSDh, k_BGSDh, v_BGSDh, attn_mask=attention_mask(index_S, index_S, positions_BS),
            enable_gqa=G != H)
    _check_layout(q_BHSDh.shape[-2] * group_size(group), group_size(group), group_rank(group))
    if comm == "allgather":
        return _allgather_attention(q_BHSDh, k_BGSDh, v_BGSDh, group, positions_BS)
    return _RingAttention.apply(q_BHSDh, k_BGSDh, v_BGSDh, group, positions_BS)


def cp_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, group: Any,
                     ignore_index: int = -100, tp_group: Any = None) -> torch.Tensor:
    """Mean cross-entropy over every token of the CP group (the same value on each CP rank).

    ``tp_group``: under TP x CP the logits hold this TP rank's V/TP vocabulary columns, and
    each token's loss is the vocab-parallel one (equal on the TP ranks). The CP mean must still
    be taken: the TP loss alone is the mean of this rank's chunk only, which trains right
    (sync_gradients averages over CP) but logs a different loss on each CP rank.

    The token sum goes through a differentiable all-reduce whose backward also all-reduces:
    each rank's grad is then W/N times the grad of its own token sum (plus what attention's
    KV exchange brings in), and averaging over CP in ``sync_gradients`` yields exactly the grad
    of the global mean. The token count is all-reduced as data (it has no grad).
    """
    flat_NV, targets_N = logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1)
    keep_N = targets_N != ignore_index
    if tp_group is None:
        sum_ = F.cross_entropy(flat_NV.float(), targets_N, ignore_index=ignore_index,
                               reduction="sum")
    else:  # ignored tokens: any in-range target, then their loss (and its grad) masked out
        loss_N = vocab_parallel_cross_entropy(flat_NV, targets_N.masked_fill(~keep_N, 0),
                                              tp_group)
        sum_ = (loss_N * keep_N).sum()
    count = keep_N.sum().to(sum_.dtype)
    if group_size(group) > 1:
        dist.all_reduce(count, group=active_group(group))
    return all_reduce(sum_, group) / count


def cp_ahead(ids_BS: torch.Tensor, k: int, fill: int, group: Any) -> torch.Tensor:
    """For each token this CP rank holds, the id ``k`` positions further on in the whole
    sequence, ``fill`` where that is past its end: multi-token prediction's shifted tokens and
    targets (Megatron's roll_tensor, which exchanges the shard boundaries under CP). The ranks'
    chunks are not contiguous (chunk r and 2W-1-r), so the ids are all-gathered over the CP
    group (B x N int64: tiny beside one activation), shifted in global order and re-sharded.
    Ids are data, not activations: nothing here has a gradient."""
    W = group_size(group)
    if W == 1:
        return F.pad(ids_BS[:, k:], (0, k), value=fill)
    shards = [torch.empty_like(ids_BS) for _ in range(W)]
    dist.all_gather(shards, ids_BS.contiguous(), group=active_group(group))
    whole_BN = unshard_sequence(shards)
    return shard_sequence(F.pad(whole_BN[:, k:], (0, k), value=fill), W, group_rank(group))


def moe_token_group(groups: Any) -> Any:
    """The ranks whose MoE layers route other chunks of the same sequences: TP x CP. Routers sum
    their aux-loss expert counts over it (Megatron reduces them over TP x CP), so each chunk's
    aux loss uses the whole sequences' f_i. None for one process."""
    return None if groups is None else groups.tp_cp


class _ScaleGrad(Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def cp_aux_loss(aux: torch.Tensor, group: Any) -> torch.Tensor:
    """The aux loss with its gradient multiplied by the CP size (Megatron's loss_scale·cp).

    Each CP rank's aux loss is already the CP group's mean (counts summed over
    :func:`moe_token_group`, the layer averages the ranks' values), so its grad is 1/CP of this
    rank's share; ``sync_gradients`` then *averages* over CP, which needs every rank's grad at CP
    times its share - the same convention as :func:`cp_cross_entropy`.
    """
    W = group_size(group)
    return aux if W == 1 else _ScaleGrad.apply(aux, float(W))


# --- all-gather KV exchange --------------------------------------------------------------------

def _allgather_attention(q_BHSDh, k_BGSDh, v_BGSDh, group, positions_BS=None):
    W, r = group_size(group), group_rank(group)
    B, H, S, Dh = q_BHSDh.shape
    G, N, c = k_BGSDh.shape[1], S * W, S // 2
    # One collective for K and V together; sequence on dim 0 because comm gathers rows.
    kv_S2BGDh = torch.stack([k_BGSDh, v_BGSDh]).permute(3, 0, 1, 2, 4)
    kv_gathered = all_gather(kv_S2BGDh, group, sizes=[S] * W)  # rank-major: rank w's S rows
    # Reorder the gathered rows into global positions (a differentiable gather).
    pos_N = torch.cat([cp_positions(N, W, w) for w in range(W)])
    kv_N2BGDh = kv_gathered.index_select(0, torch.argsort(pos_N).to(q_BHSDh.device))
    k_BGNDh, v_BGNDh = kv_N2BGDh.permute(1, 2, 3, 0, 4).unbind(0)
    outs = []
    for j, chunk in enumerate(cp_chunk_ids(W, r)):
        # Chunk `chunk` sees the keys [0, (chunk+1)·c): the earlier chunks fully and its own
        # block causally (a bottom-right-aligned mask; SDPA's is_causal would align top-left).
        # Packed documents: also within each query's document ([B, 1, c, J]).
        end = (chunk + 1) * c
        q_pos_c = torch.arange(chunk * c, end, device=q_BHSDh.device)
        mask = attention_mask(q_pos_c, torch.arange(end, device=q_BHSDh.device),
                              None if positions_BS is None else
                              positions_BS[:, j * c:(j + 1) * c])
        outs.append(F.scaled_dot_product_attention(
            q_BHSDh[:, :, j * c:(j + 1) * c], k_BGNDh[:, :, :end], v_BGNDh[:, :, :end],
            attn_mask=mask, enable_gqa=G != H))
    return torch.cat(outs, dim=2)


# --- ring KV exchange ---------------------------------------------------------------------------

def _ring_exchange(send: torch.Tensor, group: Any, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next CP rank and receiving the previous rank's tensor of the
    same shape; returns the receive buffer and the requests to wait on.

    On ``active_group(group)``: under combined 1F1B (moeplug.parallel.ep_overlap) the backward
    ring of micro-batch m-1 runs on the helper thread while the forward ring of m runs here.
    Tags alone cannot keep them apart (both rings carry _TAG_KV blocks of one shape between the
    same neighbours, so a block could land in the other micro-batch's buffer); the twin group
    is its own channel."""
    W, r = group_size(group), group_rank(group)
    recv = torch.empty_like(send)
    group = active_group(group)  # same ranks in the same order: group_dst/src are unchanged
    reqs = [dist.isend(send, group=group, group_dst=(r + 1) % W, tag=tag),
            dist.irecv(recv, group=group, group_src=(r - 1) % W, tag=tag)]
    return recv, reqs


def _visible(pos_q_S: torch.Tensor, pos_k_J: torch.Tensor, positions_BS: torch.Tensor | None):
    """Mask of one block, [1 or B, 1, s, j] (causal; packed documents: also within each query's
    document, per row), and the query rows / key columns that take part at all in any row
    (under the load-balanced layout half of them do not, so skipping them halves the block's
    work; documents skip more)."""
    vis = visible(pos_q_S, pos_k_J, positions_BS)
    vis_BSJ = vis[None] if positions_BS is None else vis
    any_SJ = vis_BSJ.any(0)
    rows = any_SJ.any(1).nonzero().squeeze(1)
    cols = any_SJ.any(0).nonzero().squeeze(1)
    return vis_BSJ[:, rows][:, :, cols].unsqueeze(1), rows, cols


def _expand_kv(x_BGJDh: torch.Tensor, H: int) -> torch.Tensor:
    # Query head h uses kv head h // (H / G), as SDPA's enable_gqa (repeat_interleave).
    return x_BGJDh.repeat_interleave(H // x_BGJDh.shape[1], dim=1)


def _block_forward(q_BHSDh, kv_2BGJDh, vis_sj, rows, cols, scale):
    """Partial attention of the visible rows over one K/V block: (out_BHsDh, lse_BHs), fp32."""
    H = q_BHSDh.shape[1]
    q = q_BHSDh[:, :, rows].float()
    k, v = (_expand_kv(t[:, :, cols], H).float() for t in kv_2BGJDh.unbind(0))
    s_BHsj = (q @ k.transpose(-1, -2)) * scale
    s_BHsj = s_BHsj.masked_fill(~vis_sj, float("-inf"))
    # -inf where a row sees no key of this block (packed documents: the block lies in earlier
    # documents of that row); its partial output is then 0 and the merge weighs it 0.
    lse_BHs = torch.logsumexp(s_BHsj, dim=-1)
    return torch.exp(s_BHsj - _finite(lse_BHs)[..., None]) @ v, lse_BHs


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (nothing seen) replaced by 0: exp(-inf - 0) = 0, not exp(nan)."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _merge(out_BHSDh, lse_BHS, o_BHsDh, lse_BHs, rows):
    """Log-sum-exp merge of a block's partial result into the running one (rows ``rows``)."""
    old_o, old_lse = out_BHSDh[:, :, rows], lse_BHS[:, :, rows]
    new_lse = torch.logaddexp(old_lse, lse_BHs)  # either may be -inf (nothing seen yet)
    base = _finite(new_lse)  # both -inf: both weights exp(-inf) = 0, the row stays 0
    out_BHSDh[:, :, rows] = (old_o * torch.exp(old_lse - base)[..., None]
                             + o_BHsDh * torch.exp(lse_BHs - base)[..., None])
    lse_BHS[:, :, rows] = new_lse


def _block_backward(q_BHSDh, kv_2BGJDh, vis_sj, rows, cols, scale, lse_BHS, dout_BHSDh, delta_BHS):
    """Flash-attention backward of one block given the final lse: (dq_BHsDh, dk_BGjDh, dv_BGjDh)."""
    H, G = q_BHSDh.shape[1], kv_2BGJDh.shape[2]
    q = q_BHSDh[:, :, rows].float()
    k, v = (_expand_kv(t[:, :, cols], H).float() for t in kv_2BGJDh.unbind(0))
    s_BHsj = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~vis_sj, float("-inf"))
    p_BHsj = torch.exp(s_BHsj - lse_BHS[:, :, rows, None])  # the final softmax's entries
    dout = dout_BHSDh[:, :, rows]
    dv_BHjDh = p_BHsj.transpose(-1, -2) @ dout
    ds_BHsj = p_BHsj * (dout @ v.transpose(-1, -2) - delta_BHS[:, :, rows, None])
    dq_BHsDh = (ds_BHsj @ k) * scale
    dk_BHjDh = (ds_BHsj.transpose(-1, -2) @ q) * scale

    def per_kv_head(x_BHjDh):  # sum the H / G query heads that share a kv head
        B, _, j, Dh = x_BHjDh.shape
        return x_BHjDh.view(B, G, H // G, j, Dh).sum(2)

    return dq_BHsDh, per_kv_head(dk_BHjDh), per_kv_head(dv_BHjDh)


class _RingAttention(Function):
    """Ring attention; forward and backward each pass K/V blocks around the CP ring."""

    @staticmethod
    def forward(ctx, q_BHSDh, k_BGSDh, v_BGSDh, group, positions_BS=None):
        W, r = group_size(group), group_rank(group)
        B, H, S, Dh = q_BHSDh.shape
        scale = Dh ** -0.5
        pos_q_S = cp_positions(S * W, W, r).to(q_BHSDh.device)
        kv = torch.stack([k_BGSDh, v_BGSDh]).contiguous()  # one message per step
        out_BHSDh = q_BHSDh.new_zeros((B, H, S, Dh), dtype=torch.float32)
        lse_BHS = q_BHSDh.new_full((B, H, S), float("-inf"), dtype=torch.float32)
        for step in range(W):
            src = (r - step) % W  # the rank whose K/V this rank holds at this step
            if step < W - 1:  # overlap: the next block travels while this one is computed
                nxt, reqs = _ring_exchange(kv, group, _TAG_KV)
            pos_k = cp_positions(S * W, W, src).to(q_BHSDh.device)
            vis, rows, cols = _visible(pos_q_S, pos_k, positions_BS)
            if rows.numel():  # packed documents: a block may hold no key any query sees
                o, lse = _block_forward(q_BHSDh, kv, vis, rows, cols, scale)
                _merge(out_BHSDh, lse_BHS, o, lse, rows)
            if step < W - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
        ctx.group = group
        ctx.save_for_backward(q_BHSDh, k_BGSDh, v_BGSDh, out_BHSDh, lse_BHS, positions_BS)
        return out_BHSDh.to(q_BHSDh.dtype)

    @staticmethod
    def backward(ctx, dout_BHSDh):
        q_BHSDh, k_BGSDh, v_BGSDh, out_BHSDh, lse_BHS, positions_BS = ctx.saved_tensors
        group = ctx.group
        W, r = group_size(group), group_rank(group)
        S, Dh = q_BHSDh.shape[2], q_BHSDh.shape[3]
        scale = Dh ** -0.5
        pos_q_S = cp_positions(S * W, W, r).to(q_BHSDh.device)
        dout_BHSDh = dout_BHSDh.float()
        delta_BHS = (dout_BHSDh * out_BHSDh).sum(-1)  # rowsum(dO ∘ O), softmax backward term
        dq_BHSDh = torch.zeros_like(out_BHSDh)
        kv = torch.stack([k_BGSDh, v_BGSDh]).contiguous()
        # dK/dV accumulator of the block this rank holds; it travels with the block.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(W):
            src = (r - step) % W
            if step < W - 1:
                nxt, reqs = _ring_exchange(kv, group, _TAG_KV)
            pos_k = cp_positions(S * W, W, src).to(q_BHSDh.device)
            vis, rows, cols = _visible(pos_q_S, pos_k, positions_BS)
            if rows.numel():
                dq, dk, dv = _block_backward(q_BHSDh, kv, vis, rows, cols, scale, lse_BHS,
                                             dout_BHSDh, delta_BHS)
                dq_BHSDh[:, :, rows] += dq
                dkv[0][:, :, cols] += dk
                dkv[1][:, :, cols] += dv
            if step < W - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
            # Pass the accumulator on with its block; after the last step this hop brings each
            # block's finished dK/dV home (block `src` was last on rank src - 1).
            dkv, dreqs = _ring_exchange(dkv, group, _TAG_DKV)
            for req in dreqs:
                req.wait()
        dk_BGSDh, dv_BGSDh = dkv.to(k_BGSDh.dtype).unbind(0)
        return dq_BHSDh.to(q_BHSDh.dtype), dk_BGSDh, dv_BGSDh, None, None
