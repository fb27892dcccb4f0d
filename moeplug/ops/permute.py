"""permute / unpermute: group token rows by expert and sum them back (autograd over C++ kernels).

Shape legend: T tokens, K top-k, D hidden, E experts, S = T*K routed rows.
"""

from __future__ import annotations

import torch

from moeplug.ops import cuda_ops, reference
from moeplug.runtime import workspace
from moeplug.ops._checks import check_index, check_probs, check_rows, ptr
from moeplug.runtime import get_runtime


def _sum_rows(grad_SD: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    """grad_TD[t] = sum_k grad_SD[row_map[t, k]] (permute's backward, unpermute's forward)."""
    T, K = row_map_TK.shape
    grad_TD = workspace.empty((T, grad_SD.shape[1]), grad_SD.dtype)
    get_runtime().unpermute(y=grad_SD.data_ptr(), row_map=row_map_TK.data_ptr(), probs=0,
                            y_out=grad_TD.data_ptr(), num_tokens=T, top_k=K,
                            hidden=grad_SD.shape[1], num_rows=grad_SD.shape[0],
                            dtype=check_rows("permute.backward", "grad", grad_SD, 2, "[S, D]"))
    return grad_TD


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int):
        T, D = x_TD.shape
        K = ids_TK.shape[1]
        x_SD = workspace.empty((T * K, D), x_TD.dtype)
        row_map_TK = workspace.empty((T, K), torch.int64)
        counts_E = workspace.empty((num_experts,), torch.int64)
        get_runtime().permute(x=x_TD.data_ptr(), ids=ids_TK.data_ptr(), x_out=x_SD.data_ptr(),
                              row_map=row_map_TK.data_ptr(), counts=counts_E.data_ptr(),
                              num_tokens=T, top_k=K, hidden=D, num_experts=num_experts,
                              dtype=check_rows("permute", "x_TD", x_TD, 2, "[T, D]"))
        ctx.save_for_backward(row_map_TK)
        ctx.mark_non_differentiable(row_map_TK, counts_E)
        # No zero grads materialised for the two index outputs (they would be allocated).
        ctx.set_materialize_grads(False)
        ctx.arena = workspace.current_arena()
        return x_SD, row_map_TK, counts_E

    @staticmethod
    def backward(ctx, grad_SD, _grad_row_map, _grad_counts):
        if grad_SD is None:
            return None, None, None
        (row_map_TK,) = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            return _sum_rows(grad_SD.contiguous(), row_map_TK), None, None


def permute(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x_TD`` grouped by expert: returns (x_SD, row_map_TK, counts_E).

    Stable: inside an expert, rows are in (token, k) order. ``x_SD[row_map_TK[t, k]] == x_TD[t]``.
    Differentiable w.r.t. ``x_TD``; ``counts_E`` is an int64 CPU tensor.
    """
    if x_TD.device.type != "cpu":  # the CUDA kernels where loaded, else plain torch (autograd)
        if cuda_ops.traced(x_TD):
            return cuda_ops.permute(x_TD, ids_TK, num_experts)
        x_SD, row_map_TK, counts_E = reference.permute(x_TD, ids_TK, num_experts)
        return x_SD, row_map_TK, counts_E.cpu()
    check_rows("permute", "x_TD", x_TD, 2, "[T, D]")
    check_index("permute", "ids_TK", ids_TK, None, "[T, K]")
    if ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"permute: ids_TK has {ids_TK.shape[0]} rows but x_TD has "
                         f"{x_TD.shape[0]} tokens. Fix: pass one row of expert ids per token")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"permute: num_experts = {num_experts!r} must be an integer >= 1. "
                         f"Fix: pass the model's moe.num_experts")
    return _Permute.apply(x_TD, ids_TK, num_experts)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD: torch.Tensor, row_map_TK: torch.Tensor, probs_TK: torch.Tensor | None,
                probs32_TK: torch.Tensor | None):
        S, D = y_SD.shape
        T, K = row_map_TK.shape
        y_TD = workspace.empty((T, D), y_SD.dtype)
        get_runtime().unpermute(y=y_SD.data_ptr(), row_map=row_map_TK.data_ptr(),
                                probs=ptr(probs32_TK), y_out=y_TD.data_ptr(), num_tokens=T,
                                top_k=K, hidden=D, num_rows=S,
                                dtype=check_rows("unpermute", "y_SD", y_SD, 2, "[S, D]"))
        needs_probs_grad = probs_TK is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(row_map_TK, probs32_TK, y_SD if needs_probs_grad else None)
        ctx.num_rows = S
        ctx.probs_dtype = None if probs_TK is None else probs_TK.dtype
        ctx.arena = workspace.current_arena()
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        with workspace.ctx_arena(ctx):
            return _Unpermute._backward(ctx, grad_TD)

    @staticmethod
    def _backward(ctx, grad_TD):
        row_map_TK, probs32_TK, y_SD = ctx.saved_tensors
        grad_TD = grad_TD.contiguous()
        T, K = row_map_TK.shape
        S, D = ctx.num_rows, grad_TD.shape[1]
        # Rows no (t, k) reads get zero gradient; when S == T*K every row is written.
        grad_SD = workspace.empty((S, D), grad_TD.dtype)
        if S != T * K:
            grad_SD.zero_()
        grad_probs_TK = workspace.empty((T, K), torch.float32) if y_SD is not None else None
        get_runtime().unpermute_backward(
            grad=grad_TD.data_ptr(), y=ptr(y_SD), row_map=row_map_TK.data_ptr(),
            probs=ptr(probs32_TK), grad_y=grad_SD.data_ptr(), grad_probs=ptr(grad_probs_TK),
            num_tokens=T, top_k=K, hidden=D, num_rows=S,
            dtype=check_rows("unpermute.backward", "grad", grad_TD, 2, "[T, D]"))
        if grad_probs_TK is not None:
            grad_probs_TK = grad_probs_TK.to(ctx.probs_dtype)
        return grad_SD, None, grad_probs_TK, None


def unpermute(y_SD: torch.Tensor, row_map_TK: torch.Tensor,
              probs_TK: torch.Tensor | None = None) -> torch.Tensor:
    """``y_TD[t] = sum_k probs_TK[t, k] * y_SD[row_map_TK[t, k]]`` (plain sum without probs).

    Sums in fp32 (also for bf16 rows). ``row_map_TK`` entries must be distinct rows of ``y_SD``
    (as :func:`permute` returns them); rows no entry reads get zero gradient.
    """
    if y_SD.device.type != "cpu":  # the CUDA kernels where loaded, else plain torch (autograd)
        if probs_TK is None and cuda_ops.traced(y_SD):
            return cuda_ops.unpermute(y_SD, row_map_TK)
        return reference.unpermute(y_SD, row_map_TK, probs_TK)
    check_rows("unpermute", "y_SD", y_SD, 2, "[S, D]")
    check_index("unpermute", "row_map_TK", row_map_TK, None, "[T, K]")
    probs32_TK = None
    if probs_TK is not None:
        probs32_TK = check_probs("unpermute", "probs_TK", probs_TK, tuple(row_map_TK.shape))
    return _Unpermute.apply(y_SD, row_map_TK, probs_TK, probs32_TK)


class _PermuteProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs_TK: torch.Tensor, row_map_TK: torch.Tensor):
        # Every row is written: row_map_TK is a permutation of the T*K rows.
        probs_R = workspace.empty((row_map_TK.numel(),), probs_TK.dtype)
        probs_R.index_put_((row_map_TK.reshape(-1),), probs_TK.reshape(-1))
        ctx.save_for_backward(row_map_TK)
        ctx.arena = workspace.current_arena()
        return probs_R

    @staticmethod
    def backward(ctx, grad_R):
        (row_map_TK,) = ctx.saved_tensors
        with workspace.ctx_arena(ctx):
            grad_TK = workspace.empty(tuple(row_map_TK.shape), grad_R.dtype)
        torch.index_select(grad_R, 0, row_map_TK.reshape(-1), out=grad_TK.view(-1))
        return grad_TK, None


def permute_probs(probs_TK: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    """``probs_R[row_map_TK[t, k]] = probs_TK[t, k]``: the routing weights in :func:`permute`'s
    row order (``row_map_TK`` as it returns it, covering all T*K rows). Differentiable w.r.t.
    ``probs_TK``; the same numbers as ``new_zeros(T*K).index_put((row_map,), probs)`` without
    allocating after warm-up (buffers from the running layer's workspace arena)."""
    if probs_TK.device.type != "cpu" or tuple(probs_TK.shape) != tuple(row_map_TK.shape):
        return probs_TK.new_zeros(row_map_TK.numel()).index_put(
            (row_map_TK.reshape(-1),), probs_TK.reshape(-1))
    return _PermuteProbs.apply(probs_TK.contiguous(), row_map_TK)
