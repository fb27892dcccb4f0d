"""permute, unpermute and SwiGLU on CUDA tensors through moeplug._runtime_cuda (autograd).

The CPU ops (permute.py, swiglu.py) call the C++ core; on a GPU they call these when the CUDA
extension is loaded, and fall back to the plain-torch references otherwise (``available()``).
The references cost the MoE layer most of its non-GEMM time on an H200 at a Qwen3-30B-A3B
shape: SwiGLU upcasts [S, 2F] to fp32, unpermute gathers [S, D] in fp32, and the backward of
the permute gather is an index_put with a sort (docs/GPU.md has the profile).

Kernels run on torch's current stream. Each is an op of the ``moeplug`` torch.library
namespace (a CUDA kernel and a ``register_fake`` shape function): on the meta device and under
FakeTensorMode the same autograd Functions run, saving what they save on a GPU, so
``moeplug plan --dry-run`` traces this path (:func:`traced`) and not the fp32 references.
Shape legend: T tokens, K top-k, D hidden, S = T*K routed rows, F expert FFN size.
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


def traced(t: torch.Tensor) -> bool:
    """Whether the permute, unpermute and SwiGLU ops below take ``t``: where
    :func:`available`, and on the meta device (the dry run of a GPU job), where their fake
    kernels give the shapes."""
    return available(t) or (t.is_meta and t.dtype in DTYPE_CODES)


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


_lib = torch.library.Library("moeplug", "FRAGMENT")
_lib.define("cuda_spread_rows(Tensor x_TD, Tensor row_map_TK, int? num_rows) -> Tensor")
_lib.define("cuda_sum_rows(Tensor rows_SD, Tensor row_map_TK) -> Tensor")
_lib.define("cuda_swiglu(Tensor h_S2F, Tensor? probs32_S) -> Tensor")
_lib.define("cuda_swiglu_backward(Tensor grad_SF, Tensor h_S2F, Tensor? probs32_S, "
            "bool want_probs) -> (Tensor, Tensor)")


def _sum_rows(rows_SD: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    return torch.ops.moeplug.cuda_sum_rows(rows_SD.contiguous(), row_map_TK)


@torch.library.register_fake("moeplug::cuda_sum_rows", lib=_lib)
def _sum_rows_fake(rows_SD: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    return rows_SD.new_empty(row_map_TK.shape[0], rows_SD.shape[1])


def _sum_rows_cuda(rows_SD: torch.Tensor, row_map_TK: torch.Tensor) -> torch.Tensor:
    # A row_map entry of -1 adds nothing (the kernel skips it).
    T, K = row_map_TK.shape
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
    return torch.ops.moeplug.cuda_spread_rows(x_TD.contiguous(), row_map_TK, num_rows)


@torch.library.register_fake("moeplug::cuda_spread_rows", lib=_lib)
def _spread_rows_fake(x_TD: torch.Tensor, row_map_TK: torch.Tensor, num_rows: int | None
                      ) -> torch.Tensor:
    return x_TD.new_empty(row_map_TK.numel() if num_rows is None else num_rows, x_TD.shape[1])


def _spread_rows_cuda(x_TD: torch.Tensor, row_map_TK: torch.Tensor, num_rows: int | None
                      ) -> torch.Tensor:
    T, K = row_map_TK.shape
    out_SD = (torch.empty(T * K, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device)
              if num_rows is None else
              torch.zeros(num_rows, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device))
    get_cuda_runtime().permute(x=x_TD.data_ptr(), row_map=row_map_TK.data_ptr(),
                               x_out=out_SD.data_ptr(), num_tokens=T, top_k=K,
                               hidden=x_TD.shape[1], dtype=DTYPE_CODES[x_TD.dtype],
                               stream=_stream())
    return out_SD


_lib.impl("cuda_sum_rows", _sum_rows_cuda, "CUDA")
_lib.impl("cuda_spread_rows", _spread_rows_cuda, "CUDA")


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


def _swiglu_cuda(h_S2F: torch.Tensor, p32: torch.Tensor | None) -> torch.Tensor:
    S, F2 = h_S2F.shape
    a_SF = torch.empty(S, F2 // 2, dtype=h_S2F.dtype, device=h_S2F.device)
    get_cuda_runtime().swiglu_forward(
        h=h_S2F.data_ptr(), probs=0 if p32 is None else p32.data_ptr(), a=a_SF.data_ptr(),
        num_rows=S, ffn_hidden=F2 // 2, dtype=DTYPE_CODES[h_S2F.dtype], stream=_stream())
    return a_SF


def _swiglu_backward_cuda(grad_SF: torch.Tensor, h_S2F: torch.Tensor, p32: torch.Tensor | None,
                          want_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    S, F2 = h_S2F.shape
    grad_h = torch.empty_like(h_S2F)
    # No grad of the weight wanted: an empty one (an op's outputs are tensors, never None).
    grad_p = torch.empty(S if want_p else 0, dtype=torch.float32, device=h_S2F.device)
    get_cuda_runtime().swiglu_backward(
        grad_a=grad_SF.data_ptr(), h=h_S2F.data_ptr(),
        probs=0 if p32 is None else p32.data_ptr(), grad_h=grad_h.data_ptr(),
        grad_probs=grad_p.data_ptr() if want_p else 0, num_rows=S,
        ffn_hidden=F2 // 2, dtype=DTYPE_CODES[h_S2F.dtype], stream=_stream())
    return grad_h, grad_p


@torch.library.register_fake("moeplug::cuda_swiglu", lib=_lib)
def _swiglu_fake(h_S2F: torch.Tensor, p32: torch.Tensor | None) -> torch.Tensor:
    return h_S2F.new_empty(h_S2F.shape[0], h_S2F.shape[1] // 2)


@torch.library.register_fake("moeplug::cuda_swiglu_backward", lib=_lib)
def _swiglu_backward_fake(grad_SF: torch.Tensor, h_S2F: torch.Tensor, p32: torch.Tensor | None,
                          want_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(h_S2F),
            h_S2F.new_empty(h_S2F.shape[0] if want_p else 0, dtype=torch.float32))


_lib.impl("cuda_swiglu", _swiglu_cuda, "CUDA")
_lib.impl("cuda_swiglu_backward", _swiglu_backward_cuda, "CUDA")


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_S2F: torch.Tensor, probs_S: torch.Tensor | None):
        h_S2F = h_S2F.contiguous()
        p32 = None if probs_S is None else probs_S.detach().float().contiguous()
        ctx.save_for_backward(h_S2F, p32)
        ctx.probs_dtype = None if probs_S is None else probs_S.dtype
        return torch.ops.moeplug.cuda_swiglu(h_S2F, p32)

    @staticmethod
    def backward(ctx, grad_SF):
        h_S2F, p32 = ctx.saved_tensors
        want_p = p32 is not None and ctx.needs_input_grad[1]
        grad_h, grad_p = torch.ops.moeplug.cuda_swiglu_backward(grad_SF.contiguous(), h_S2F,
                                                                p32, want_p)
        return grad_h, grad_p.to(ctx.probs_dtype) if want_p else None


def swiglu(h_S2F: torch.Tensor, probs_S: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:] * p`` in h's dtype, fp32 inside (as the reference)."""
    return _SwiGLU.apply(h_S2F, probs_S)
