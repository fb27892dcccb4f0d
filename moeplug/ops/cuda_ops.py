"""permute, unpermute and SwiGLU on CUDA tensors through moeplug._runtime_cuda (autograd).

The CPU ops (permute.py, swiglu.py) call the C++ core; on a GPU they call these when the CUDA
extension is loaded, and fall back to the plain-torch references otherwise (``available()``).
The references cost the MoE layer most of its non-GEMM time on an H200 at a Qwen3-30B-A3B
shape: SwiGLU upcasts [S, 2F] to fp32, unpermute gathers [S, D] in fp32, and the backward of
the permute gather is an index_put with a sort (docs/GPU.md has the profile).

Kernels run on torch's current stream. Shape legend: T tokens, K top-k, D hidden, S = T*K
routed rows, F expert FFN size.
"""

from __future__ import annotations

import torch

from moeplug.runtime import DTYPE_CODES, RuntimeMissingError, get_cuda_runtime


def available(t: torch.Tensor) -> bool:
    """Whether the CUDA kernels can take ``t``: a CUDA tensor of a kernel dtype, extension loaded."""
    if t.device.type != "cuda" or t.dtype not in DTYPE_CODES:
        return False
    try:
        get_cuda_runtime()
    except RuntimeMissingError:
        return False
    return True


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _sum_rows(rows_SD: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    # A row_map entry of -1 adds nothing (the kernel skips it).
    T, K = row_map_TK.shape
    rows_SD = rows_SD.contiguous()
    out_TD = torch.empty(T, rows_SD.shape[1], dtype=rows_SD.dtype, device=rows_SD.device)
    get_cuda_runtime().unpermute(
        y=rows_SD.data_ptr(), row_map=row_map_TK.data_ptr(),
        probs=0, y_out=out_TD.data_ptr(),  # the plain sum: weighted unpermute stays in torch
        num_tokens=T, top_k=K, hidden=rows_SD.shape[1], dtype=DTYPE_CODES[rows_SD.dtype],
        stream=_stream())
    return out_TD


def _spread_rows(x_TD: torch.Tensor, row_map_TK: torch.Tensor, num_rows: int | None = None
                 ) -> torch.Tensor:
    # num_rows None: the T*K packed rows, each written once. Else a [num_rows, D] table with
    # rows no choice maps to (and -1 entries, skipped) left at zero.
    T, K = row_map_TK.shape
    x_TD = x_TD.contiguous()
    out_SD = (torch.empty(T * K, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device)
              if num_rows is None else
              torch.zeros(num_rows, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device))
    get_cuda_runtime().permute(x=x_TD.data_ptr(), row_map=row_map_TK.data_ptr(),
                               x_out=out_SD.data_ptr(), num_tokens=T, top_k=K,
                               hidden=x_TD.shape[1], dtype=DTYPE_CODES[x_TD.dtype],
                               stream=_stream())
    return out_SD


class _Permute(torch.autograd.Function):
    """x_TD -> rows, row row_map[t, k] = x[t]; its backward sums each token's K rows.
    ``num_rows`` None: the T*K packed rows (row_map a permutation of them). Else a zeroed
    [num_rows, D] table (the sync-free layer's budget slots), -1 entries skipped."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, row_map_TK: torch.Tensor, num_rows: int | None):
        ctx.save_for_backward(row_map_TK)
        return _spread_rows(x_TD, row_map_TK, num_rows)

    @staticmethod
    def backward(ctx, grad_SD):
        (row_map_TK,) = ctx.saved_tensors
        return _sum_rows(grad_SD, row_map_TK), None, None


class _Unpermute(torch.autograd.Function):
    """The plain sum of each token's K rows (no probs: the dispatchers apply the routing
    weights in the experts); its backward is :class:`_Permute`'s forward. ``packed``: the rows
    are the T*K packed ones; else a slot table, whose rows no choice reads get zero grad."""

    @staticmethod
    def forward(ctx, y_SD: torch.Tensor, row_map_TK: torch.Tensor, packed: bool):
        ctx.save_for_backward(row_map_TK)
        ctx.num_rows = None if packed else y_SD.shape[0]
        return _sum_rows(y_SD, row_map_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        (row_map_TK,) = ctx.saved_tensors
        return _spread_rows(grad_TD, row_map_TK, ctx.num_rows), None, None


def to_slots(x_TD: torch.Tensor, slot_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The sync-free layer's gather: each token's row at its K budget slots (static shapes)."""
    return _Permute.apply(x_TD, slot_TK.contiguous(), num_rows)


def from_slots(y_RD: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """The sync-free layer's combine: each token's sum over its K slots' rows."""
    return _Unpermute.apply(y_RD, slot_TK.contiguous(), False)


def row_map(ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_map_TK, counts_E): the permuted row of every (t, k), experts in order and (t, k)
    order inside each, as the CPU kernel numbers them; counts on the host."""
    T, K = ids_TK.shape
    order_S = torch.argsort(ids_TK.reshape(-1), stable=True)
    row_map_TK = torch.empty_like(order_S)
    row_map_TK[order_S] = torch.arange(T * K, device=ids_TK.device)
    # scatter_add, not bincount: CUDA bincount syncs twice to size its output; the one sync
    # left is the .cpu() the dynamic-shape path needs.
    counts_E = device_counts(ids_TK, num_experts)
    return row_map_TK.view(T, K), counts_E.cpu()


def device_counts(ids_TK: torch.Tensor, num_experts: int,
                  keep_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Choices per expert on the ids' device without a host sync (``keep_TK``: only those)."""
    ids = ids_TK.reshape(-1)
    ones = (torch.ones_like(ids) if keep_TK is None else keep_TK.reshape(-1).to(ids.dtype))
    return torch.zeros(num_experts, dtype=ids.dtype, device=ids.device).scatter_add_(0, ids, ones)


def permute(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    row_map_TK, counts_E = row_map(ids_TK, num_experts)
    return _Permute.apply(x_TD, row_map_TK, None), row_map_TK, counts_E


def unpermute(y_SD: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    return _Unpermute.apply(y_SD, row_map_TK.contiguous(), True)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_S2F: torch.Tensor, probs_S: torch.Tensor | None):
        h_S2F = h_S2F.contiguous()
        S, F2 = h_S2F.shape
        p32 = None if probs_S is None else probs_S.detach().float().contiguous()
        a_SF = torch.empty(S, F2 // 2, dtype=h_S2F.dtype, device=h_S2F.device)
        get_cuda_runtime().swiglu_forward(
            h=h_S2F.data_ptr(), probs=0 if p32 is None else p32.data_ptr(), a=a_SF.data_ptr(),
            num_rows=S, ffn_hidden=F2 // 2, dtype=DTYPE_CODES[h_S2F.dtype], stream=_stream())
        ctx.save_for_backward(h_S2F, p32)
        ctx.probs_dtype = None if probs_S is None else probs_S.dtype
        return a_SF

    @staticmethod
    def backward(ctx, grad_SF):
        h_S2F, p32 = ctx.saved_tensors
        S, F2 = h_S2F.shape
        grad_SF = grad_SF.contiguous()
        grad_h = torch.empty_like(h_S2F)
        want_p = p32 is not None and ctx.needs_input_grad[1]
        grad_p = torch.empty(S, dtype=torch.float32, device=h_S2F.device) if want_p else None
        get_cuda_runtime().swiglu_backward(
            grad_a=grad_SF.data_ptr(), h=h_S2F.data_ptr(),
            probs=0 if p32 is None else p32.data_ptr(), grad_h=grad_h.data_ptr(),
            grad_probs=0 if grad_p is None else grad_p.data_ptr(), num_rows=S,
            ffn_hidden=F2 // 2, dtype=DTYPE_CODES[h_S2F.dtype], stream=_stream())
        return grad_h, None if grad_p is None else grad_p.to(ctx.probs_dtype)


def swiglu(h_S2F: torch.Tensor, probs_S: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:] * p`` in h's dtype, fp32 inside (as the reference)."""
    return _SwiGLU.apply(h_S2F, probs_S)
