"""grouped_rows_mm: ``y[rows of group g] = x[rows of group g] @ w[g]^T`` over a static-shaped
buffer whose first ``sum(counts)`` rows are the groups' rows in order, as one op whose kernel
reads the counts itself - for the sync-free static region (moeplug.modules.static_moe).

Legend: S rows (the static buffer), G groups (experts), N output and K input features.

Why an op of our own around ``torch._grouped_mm``: the static region's experts ran as a
batched GEMM over every budget slot, so with ``runtime.token_budget: 2.0`` half the GEMM rows
were padding. ``torch._grouped_mm`` takes the group ends as a tensor (no host read on the
Python side; the CPU kernel reads them as it reads its operands, a GPU kernel on the device),
but inductor cannot compile it outside bf16 (its fake kernel checks CUDA's dtype rules), so
``torch.compile(fullgraph=True)`` of an fp32 static region would fail. As a
``torch.library.custom_op`` with a fake kernel it is one opaque node of static shape in the
captured graph, forward and backward.

Rows past ``sum(counts)`` are left unwritten (whatever the buffer held): the caller never reads
them into a real row (static_moe.combine_rows masks them). Feature counts whose rows are no
multiple of 16 bytes (which ``torch._grouped_mm`` refuses) are zero-padded for the call and cut
after: a copy, for odd sizes only. Registered for the CPU only; on a GPU the static region
keeps its own path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _offsets(counts_G: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts_G, 0, dtype=torch.int32)


def _aligned(n: int, dtype: torch.dtype) -> int:
    """n rounded up so that n elements span a multiple of 16 bytes: ``torch._grouped_mm``
    refuses row strides that do not (hidden sizes of real models always do)."""
    per = max(1, 16 // dtype.itemsize)
    return -(-n // per) * per


def _pad_last(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with its last dim zero-padded to ``n`` (``t`` itself when it already is)."""
    return t if t.shape[-1] == n else F.pad(t, (0, n - t.shape[-1]))


def _padded(w_GNK: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """(w zero-padded to [G, Np, Kp], Np, Kp): both feature counts aligned for ``dtype``."""
    N, K = w_GNK.shape[1:]
    Np, Kp = _aligned(N, dtype), _aligned(K, dtype)  # zero features add nothing to a product
    w = _pad_last(w_GNK, Kp)
    return (w if Np == N else F.pad(w, (0, 0, 0, Np - N))), Np, Kp


@torch.library.custom_op("moeplug::grouped_rows_mm", mutates_args=(), device_types="cpu")
def grouped_rows_mm(x_SK: torch.Tensor, w_GNK: torch.Tensor, counts_G: torch.Tensor
                    ) -> torch.Tensor:
    """[S, K] rows x [G, N, K] weights -> [S, N]; group g takes the next counts_G[g] rows."""
    N = w_GNK.shape[1]
    w, Np, Kp = _padded(w_GNK, x_SK.dtype)
    y = F.grouped_mm(_pad_last(x_SK, Kp), w.transpose(1, 2), offs=_offsets(counts_G))
    return y if Np == N else y[:, :N].contiguous()


@grouped_rows_mm.register_fake
def _(x_SK, w_GNK, counts_G):
    return x_SK.new_empty(x_SK.shape[0], w_GNK.shape[1])


@torch.library.custom_op("moeplug::grouped_rows_mm_backward", mutates_args=(),
                         device_types="cpu")
def grouped_rows_mm_backward(g_SN: torch.Tensor, x_SK: torch.Tensor, w_GNK: torch.Tensor,
                             counts_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [S, K], dw [G, N, K]); an empty group's dw is zero."""
    offs = _offsets(counts_G)
    N, K = w_GNK.shape[1:]
    w, Np, Kp = _padded(w_GNK, g_SN.dtype)
    g, x = _pad_last(g_SN, Np), _pad_last(x_SK, Kp)
    dx_SK = F.grouped_mm(g, w, offs=offs)
    dw_GNK = torch._grouped_mm(g.t(), x, offs=offs)  # K-grouped: per-group g^T x
    if (Np, Kp) != (N, K):
        dx_SK, dw_GNK = dx_SK[:, :K].contiguous(), dw_GNK[:, :N, :K].contiguous()
    return dx_SK, dw_GNK


@grouped_rows_mm_backward.register_fake
def _(g_SN, x_SK, w_GNK, counts_G):
    return x_SK.new_empty(x_SK.shape), w_GNK.new_empty(w_GNK.shape)


def _setup_context(ctx, inputs, output):
    x_SK, w_GNK, counts_G = inputs
    ctx.save_for_backward(x_SK, w_GNK, counts_G)


def _backward(ctx, g_SN):
    x_SK, w_GNK, counts_G = ctx.saved_tensors
    dx_SK, dw_GNK = grouped_rows_mm_backward(g_SN.contiguous(), x_SK, w_GNK, counts_G)
    return dx_SK, dw_GNK, None


grouped_rows_mm.register_autograd(_backward, setup_context=_setup_context)
