"""Tensor parallelism (Megatron TP) and sequence parallelism (Megatron SP) for the dense model.

Legend: B batch, S sequence, s = S / W sequence shard, D hidden, V vocabulary, Vl = V / W local
vocabulary rows, N tokens (flattened), W ranks in the TP group, r this rank's index in it.

Layout (Shoeybi et al. 2019; Korthikanti et al. 2022):
  * attention: q/k/v column-parallel by heads (each rank holds H/W query heads and G/W kv heads,
    so GQA groups never straddle ranks), o row-parallel;
  * dense SwiGLU: gate/up column-parallel, down row-parallel;
  * embedding: vocab-parallel (rows [r*Vl, (r+1)*Vl)); output head: column-parallel over the
    vocabulary, fed to :func:`vocab_parallel_cross_entropy`, which never gathers the logits;
  * MLA attention (Megatron's split): the q/kv down projections replicated, their latents
    entering the region; the up projections column-parallel by heads, o row-parallel.

This module holds the regions, layers and loss; applying them to a built model (which layers
become which, the ``wiring`` the modules call at the regions' edges) is
moeplug.parallelize.tp's job, from outside the model's modules.

The column-parallel layer is *only* the local matmul over a weight shard: the region is entered
once by :func:`enter_tp_region`, so one sequence all-gather feeds q, k and v (Megatron gets the
same by fusing QKV into one linear). The row-parallel layer leaves the region itself.

Without SP every TP rank holds the whole [B, S, D] activation: entering a region is the identity
(backward all-reduce), leaving it all-reduces the partial sums. With SP the activations between
regions are [B, s, D] (this rank's sequence chunk): entering all-gathers the sequence, leaving
reduce-scatters it, so norms and residuals run on 1/W of the tokens. Their weights then see only
this rank's tokens: such parameters carry ``sequence_parallel = True`` and
:func:`sum_partial_grads_over_tp` sums their grads over TP (``sync_gradients`` calls it).

Sharded parameters carry ``partition_dim`` (0: rows, 1: columns), which
:func:`moeplug.parallel.sharding.shard_state_dict`
uses to cut a single-process state dict into this rank's shards (names are unchanged).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from moeplug.runtime import workspace
from moeplug.parallel import comm


def check_divisible(what: str, value: int, W: int, fix: str) -> None:
    if value % W:
        raise ValueError(f"{what} = {value} is not divisible by the tensor-parallel size {W}. "
                         f"Fix: {fix}")


# --- regions (communication) ----------------------------------------------------------------

def _seq_first(x_BSD: torch.Tensor) -> torch.Tensor:
    # comm's sequence functions split/gather dim 0 (Megatron keeps activations [S, B, D]); ours
    # are [B, S, D], so the sequence is moved to the front and back around each collective.
    return x_BSD.transpose(0, 1)


def gather_sequence(x_BsD: torch.Tensor, group: Any, grad_is_partial: bool = True) -> torch.Tensor:
    """[B, s, D] -> [B, S, D]. Backward reduce-scatters (``grad_is_partial``: every rank's
    consumer holds a different part of the grad) or keeps this rank's chunk (replicated consumer)."""
    if comm.group_size(group) == 1:
        return x_BsD
    return _seq_first(comm.gather_from_sp_region(_seq_first(x_BsD), group, grad_is_partial))


def scatter_sequence(x_BSD: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, S, D] -> this rank's [B, s, D] chunk; backward all-gathers the chunks' grads."""
    if comm.group_size(group) == 1:
        return x_BSD
    S = x_BSD.shape[1]
    check_divisible("sequence length", S, comm.group_size(group),
                     "choose train.seq_len a multiple of ParallelConfig.tp")
    return _seq_first(comm.scatter_to_sp_region(_seq_first(x_BSD), group))


def reduce_scatter_sequence(y_BSD: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum partial [B, S, D] outputs over the group and keep this rank's [B, s, D] chunk."""
    if comm.group_size(group) == 1:
        return y_BSD
    check_divisible("sequence length", y_BSD.shape[1], comm.group_size(group),
                     "choose train.seq_len a multiple of ParallelConfig.tp")
    return _seq_first(comm.reduce_scatter_to_sp_region(_seq_first(y_BSD), group))


def enter_tp_region(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Input of column-parallel layers: all-gather the sequence (SP) or identity with an
    all-reduce backward. Identity at TP = 1."""
    if sequence_parallel:
        return gather_sequence(x, group)
    return comm.copy_to_tp_region(x, group)


def exit_tp_region(y: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Output of row-parallel layers: reduce-scatter the sequence (SP) or all-reduce."""
    if sequence_parallel:
        return reduce_scatter_sequence(y, group)
    return comm.reduce_from_tp_region(y, group)


# --- layers (local compute over a weight shard) ---------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y[..., out/W] = x @ W_r^T with W_r rows [r*out/W, (r+1)*out/W) of the full [out, in]
    weight. The input must already be in the TP region (:func:`enter_tp_region`)."""

    def __init__(self, in_features: int, out_features: int, group: Any) -> None:
        super().__init__()
        W = comm.group_size(group)
        check_divisible("ColumnParallelLinear out_features", out_features, W,
                         "choose tp dividing the layer's output size")
        self.weight = nn.Parameter(torch.empty(out_features // W, in_features))
        self.weight.partition_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y[..., out] = sum over ranks of x[..., in/W] @ W_r^T, W_r columns [r*in/W, (r+1)*in/W)
    of the full weight. Unlike the column layer it communicates itself (:func:`exit_tp_region`):
    its output always leaves the region, and callers (e.g. attention's two output paths) then
    need no TP code at all."""

    def __init__(self, in_features: int, out_features: int, group: Any,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        W = comm.group_size(group)
        check_divisible("RowParallelLinear in_features", in_features, W,
                         "choose tp dividing the layer's input size")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // W))
        self.weight.partition_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_tp_region(F.linear(x, self.weight), self.group, self.sequence_parallel)


class GatheredColumnParallelLinear(nn.Module):
    """Megatron's ColumnParallelLinear followed by ``gather_from_tensor_model_parallel_region``
    (the MTP ``eh_proj``): rows [r*out/W, (r+1)*out/W) of the [out, in] weight, the input
    entered into the TP region here, the [..., out/W] outputs all-gathered along the last dim
    (backward: this rank's columns of the replicated grad). Under SP the input is this rank's
    [B, s, in] chunk, gathered over the sequence first, and the output is scattered back to
    its [B, s, out] chunk: the same contract as ``nn.Linear(in, out)`` on the activation."""

    def __init__(self, in_features: int, out_features: int, group: Any,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        W = comm.group_size(group)
        check_divisible("GatheredColumnParallelLinear out_features", out_features, W,
                         "choose tp dividing the hidden size")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // W, in_features))
        self.weight.partition_dim = 0

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        y_BSDl = F.linear(enter_tp_region(x_BSD, self.group, self.sequence_parallel), self.weight)
        y_BSD = comm.gather_from_tp_region(y_BSDl.contiguous(), self.group)
        return scatter_sequence(y_BSD, self.group) if self.sequence_parallel else y_BSD


class VocabParallelEmbedding(nn.Module):
    """Rows [r*Vl, (r+1)*Vl) of the [V, D] table; ids outside this range look up zeros, and the
    ranks' partial results are summed (all-reduce, or reduce-scatter over the sequence under SP,
    which hands each rank its [B, s, D] chunk)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: Any,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        W = comm.group_size(group)
        check_divisible("vocab_size", vocab_size, W,
                         f"set model.vocab_size to a multiple of {W} (it may pad the tokenizer's)")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = comm.group_rank(group) * (vocab_size // W)
        self.weight = nn.Parameter(torch.empty(vocab_size // W, hidden_size))
        self.weight.partition_dim = 0

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        local_BS = tokens_BS - self.vocab_start
        outside_BS = (local_BS < 0) | (local_BS >= self.weight.shape[0])
        x_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        x_BSD = x_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)
        return exit_tp_region(x_BSD, self.group, self.sequence_parallel)


# --- vocab-parallel cross-entropy -------------------------------------------------------------

class _VocabParallelCE(Function):
    """Megatron's vocab-parallel cross-entropy: three all-reduces of [N] vectors (max, target
    logit, sum of exps) instead of gathering [N, V] logits. Every rank returns the same per-token
    loss; the backward needs no communication (softmax - one_hot on this rank's columns).
    Its all-reduces go through ``comm.active_group``: a forward rerun by recompute inside the
    combined 1F1B's overlapped backward must use the twin group (moeplug.parallel.ep_overlap)."""

    @staticmethod
    def forward(ctx, logits_NVl, targets_N, group):
        # One fp32 [N, V/TP] buffer, shifted and exponentiated in place (as Megatron's): the
        # loss stage's peak is logit-sized, and this is its largest tensor.
        shifted_NVl = logits_NVl.float() if logits_NVl.dtype != torch.float32 \
            else logits_NVl.clone()
        Vl = shifted_NVl.shape[1]
        max_N = shifted_NVl.max(dim=1).values
        if group is not None:
            dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=comm.active_group(group))
        shifted_NVl.sub_(max_N.unsqueeze(1))
        local_N = targets_N - comm.group_rank(group) * Vl
        outside_N = (local_N < 0) | (local_N >= Vl)
        local_N = local_N.masked_fill(outside_N, 0)
        rows_N = torch.arange(shifted_NVl.shape[0], device=shifted_NVl.device)
        target_logit_N = shifted_NVl[rows_N, local_N].masked_fill(outside_N, 0.0)
        exp_NVl = shifted_NVl.exp_()
        sum_exp_N = exp_NVl.sum(dim=1)
        if group is not None:
            both_2N = torch.stack([target_logit_N, sum_exp_N])  # one collective for two sums
            dist.all_reduce(both_2N, group=comm.active_group(group))
            target_logit_N, sum_exp_N = both_2N[0], both_2N[1]
        loss_N = sum_exp_N.log() - target_logit_N
        exp_NVl.div_(sum_exp_N.unsqueeze(1))  # now this rank's softmax columns
        ctx.save_for_backward(exp_NVl, local_N, outside_N)
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        softmax_NVl, local_N, outside_N = ctx.saved_tensors
        grad_NVl = softmax_NVl.clone()
        rows_N = torch.arange(grad_NVl.shape[0], device=grad_NVl.device)
        grad_NVl[rows_N, local_N] -= (~outside_N).to(grad_NVl.dtype)
        return grad_NVl.mul_(grad_N.unsqueeze(1)), None, None


def vocab_parallel_cross_entropy(logits_NVl: torch.Tensor, targets_N: torch.Tensor,
                                 group: Any) -> torch.Tensor:
    """Per-token CE [N] (fp32) of logits split over the vocabulary: rank r holds columns
    [r*Vl, (r+1)*Vl). Equals ``F.cross_entropy(full_logits, targets, reduction='none')``; the
    result is the same on every rank of ``group`` (None: one process, the whole vocabulary)."""
    if logits_NVl.dim() != 2 or targets_N.shape != logits_NVl.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits_NVl.shape)} and "
                         f"targets {tuple(targets_N.shape)} must be [N, V/TP] and [N]. "
                         "Fix: flatten batch and sequence first (reshape(-1, ...))")
    return _VocabParallelCE.apply(logits_NVl, targets_N, group)


# --- the MoE layer's aux loss over its token group -------------------------------------------

def average_over_token_group(aux: torch.Tensor, group: Any) -> torch.Tensor:
    """Mean over ``group`` of each rank's aux loss (forward all-reduce / W, backward identity /
    W): with expert counts already summed over the group by the router, the mean of the ranks'
    losses over equal token chunks is the loss of the unsplit batch (every aux loss is
    sum_i f_i * mean over tokens), and every rank gets the same value to log and add."""
    W = comm.group_size(group)
    if W == 1:
        return aux
    if aux.device.type == "cpu" and workspace.current_arena() is not None:
        return _MeanOverGroup.apply(aux, group, W)  # the same numbers, in the layer's arena
    return comm.reduce_from_tp_region(aux, group) / W


class _MeanOverGroup(Function):
    """``reduce_from_tp_region(aux, group) / W`` over the running layer's workspace arena (no
    allocation after warm-up, issue 7): forward the all-reduced sum divided by W, backward the
    grad divided by W (DivBackward0; the reduce's backward is the identity), op for op."""

    @staticmethod
    def forward(ctx, aux, group, W):
        ctx.W, ctx.arena = W, workspace.current_arena()
        total = workspace.empty((), aux.dtype).copy_(aux)
        comm.blocking(dist.all_reduce, total, group=group)
        return torch.div(total, workspace.number(W, aux.dtype),
                         out=workspace.empty((), aux.dtype))

    @staticmethod
    def backward(ctx, grad):
        with workspace.ctx_arena(ctx):
            return torch.div(grad, workspace.number(ctx.W, grad.dtype),
                             out=workspace.empty((), grad.dtype)), None, None


# --- gradients and state dicts ----------------------------------------------------------------

def mark_sequence_parallel(module: nn.Module) -> None:
    """Flag every parameter of ``module`` as seeing only this rank's token shard."""
    for p in module.parameters():
        p.sequence_parallel = True


@torch.no_grad()
def sum_partial_grads_over_tp(model: nn.Module, tp_group: Any) -> None:
    """Sum over TP the grads of parameters flagged ``sequence_parallel`` (norms under SP, the
    routers of MoE layers whose tokens are split over TP): each rank's grad covers only its
    tokens. One flat buffer, same parameter order on every rank."""
    if tp_group is None:
        return
    params = [p for p in model.parameters()
              if getattr(p, "sequence_parallel", False) and p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not params:
        return
    # FSDP (parallel.fsdp): the TP ranks' shards of a grad cover the same elements; sum those.
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=comm.active_group(tp_group))
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
