"""cuda_ffn: the routed experts' FFN on a GPU (the grouped experts backend's CUDA form).

Legend: S rows (grouped by expert), D hidden, F expert FFN hidden, L local experts, B rows of
each expert when all have the same.

    y_e = down_e(act(gate_up_e x) * p)
Two GEMM forms, autograd included:
  * :func:`grouped_mm_ffn` (SwiGLU, rows of any counts): torch's grouped GEMM
    (``torch.nn.functional.grouped_mm``) around the runtime's fused CUDA SwiGLU
    (moeplug.ops.cuda_ops; the plain one where the extension is not loaded). The group ends go
    to the device from pinned memory, non-blocking: a pageable host-to-device copy would wait
    for the stream to drain (one more host sync per layer).
  * :func:`batched_ffn` (every expert B rows: runtime.sync_free's budget rows, capacity
    padding): two batched GEMMs, nothing read on the host, so a CUDA graph records it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeplug.ops import cuda_ops, reference
from moeplug.ops.discard import discarding, release
from moeplug.ops.offload_marks import note
from moeplug.ops._grouped import host_counts


def grouped_mm_ffn(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts: list[int],
                   w13_L2FD: torch.Tensor, w2_LDF: torch.Tensor,
                   compute_dtype: torch.dtype, recompute_act: bool = False) -> torch.Tensor:
    """SwiGLU experts over rows grouped by the host ``counts`` (this path also runs on CPU
    tensors, where torch's grouped GEMM has a CPU kernel). ``recompute_act`` (moe_act
    recompute): the activation, which FC2 keeps for backward, is freed once FC2 has run and
    made again from FC1's output just before FC2's backward (moeplug.ops.discard, as
    Megatron discards it)."""
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    if x_SD.device.type == "cuda":
        offs = offs.pin_memory().to(x_SD.device, non_blocking=True)
    x_c = x_SD.to(compute_dtype)
    # model.offload's names (moeplug.modules.offload), said before the op that saves each.
    note("expert_fc1", x_c)
    h_S2F = F.grouped_mm(x_c, w13_L2FD.to(compute_dtype).transpose(-2, -1), offs=offs)
    if not recompute_act:
        # Under moe_act recompute the rebuild's closure (moeplug.ops.discard) holds h on the
        # device: moving autograd's reference would free nothing and add a copy in backward.
        note("moe_act", h_S2F)
    act = cuda_ops.swiglu if cuda_ops.traced(h_S2F) else reference.swiglu
    a_SF = discarding(act, h_S2F, probs_S) if recompute_act else act(h_S2F, probs_S)
    y_SD = F.grouped_mm(a_SF, w2_LDF.to(compute_dtype).transpose(-2, -1), offs=offs)
    release(a_SF, y_SD)  # nothing unless noted by discarding()
    return y_SD


def same_rows(counts_L: torch.Tensor) -> bool:
    """Every local expert has the same rows (budget rows, or capacity padding): one batched
    GEMM fits them (a host read of the CPU counts, no device sync)."""
    counts = host_counts(counts_L)
    return bool(counts) and min(counts) == max(counts)


def batched_ffn(x_SD: torch.Tensor, probs_S: torch.Tensor | None, w13_LXD: torch.Tensor,
                w2_LDF: torch.Tensor, activation: str) -> torch.Tensor:
    """``down(act(gate_up x) * p)`` for L experts of equal rows (x_SD [L*B, D]) as two batched
    GEMMs (autocast picks their dtype) around the activation: for SwiGLU the runtime's fused
    CUDA kernel with the weight inside. No host read, the same kernels every call: what a CUDA
    graph records (runtime.capture); empty slots (zero rows of weight 0) add nothing."""
    from moeplug.ops.activations import activation_fn
    L = w13_LXD.shape[0]
    h_LBX = torch.bmm(x_SD.view(L, -1, x_SD.shape[1]), w13_LXD.transpose(1, 2))
    h_SX = h_LBX.view(-1, h_LBX.shape[2])
    if activation == "swiglu" and cuda_ops.traced(h_SX):
        a_SF = cuda_ops.swiglu(h_SX, probs_S)
    else:
        a_SF = activation_fn(activation)(h_SX)
        if probs_S is not None:
            a_SF = a_SF * probs_S.unsqueeze(-1).to(a_SF.dtype)
    y_LBD = torch.bmm(a_SF.view(L, -1, a_SF.shape[1]), w2_LDF.transpose(1, 2))
    return y_LBD.view(-1, y_LBD.shape[2])
