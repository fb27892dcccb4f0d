"""cuda_ffn: the routed experts' FFN on a GPU (the grouped experts backend's CUDA form).

Legend: S rows (grouped by expert), D hidden, F expert FFN hidden, L local experts.

    y_e = down_e(silu(gate_e x) * (up_e x) * p)
as torch's grouped GEMM (``torch.nn.functional.grouped_mm``, autograd included) around the
runtime's fused CUDA SwiGLU (moeplug.ops.cuda_ops; the plain one where the extension is not
loaded). The group ends go to the device from pinned memory, non-blocking: a pageable
host-to-device copy would wait for the stream to drain (one more host sync per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeplug.ops import cuda_ops, reference


def grouped_mm_ffn(x_SD: torch.Tensor, probs_S: torch.Tensor | None, counts: list[int],
                   w13_L2FD: torch.Tensor, w2_LDF: torch.Tensor,
                   compute_dtype: torch.dtype) -> torch.Tensor:
    """SwiGLU experts over rows grouped by the host ``counts`` (this path also runs on CPU
    tensors, where torch's grouped GEMM has a CPU kernel)."""
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    if x_SD.device.type == "cuda":
        offs = offs.pin_memory().to(x_SD.device, non_blocking=True)
    x_c = x_SD.to(compute_dtype)
    h_S2F = F.grouped_mm(x_c, w13_L2FD.to(compute_dtype).transpose(-2, -1), offs=offs)
    a_SF = (cuda_ops.swiglu(h_S2F, probs_S) if cuda_ops.available(h_S2F)
            else reference.swiglu(h_S2F, probs_S))
    return F.grouped_mm(a_SF, w2_LDF.to(compute_dtype).transpose(-2, -1), offs=offs)
