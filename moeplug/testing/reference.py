"""Slow, obviously-correct references the contract checks compare against.

Legend: S rows, D hidden, F ffn hidden, L local experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


_ACTS = {  # written out here, independent of moeplug.ops.activations
    "swiglu": lambda h, Fh: F.silu(h[..., :Fh]) * h[..., Fh:],
    "geglu": lambda h, Fh: F.gelu(h[..., :Fh]) * h[..., Fh:],
    "gelu": lambda h, Fh: F.gelu(h),
    "squared_relu": lambda h, Fh: torch.relu(h) ** 2,
}


def reference_expert_mlp(x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor,
                         gate_up_proj_L2FD: torch.Tensor, down_proj_LDF: torch.Tensor,
                         activation: str = "swiglu") -> torch.Tensor:
    """y[s] = down_e (silu(gate_e x[s]) * (up_e x[s]) * p[s]) with e the expert owning row s
    (swiglu; for another ``model.moe.activation`` y[s] = down_e(act(gate_up_e x[s]) * p[s]),
    ``gate_up_proj`` then being [L, F, D] for the non-gated ones).

    Deliberately unlike a grouped kernel: every row goes through *every* expert (dense), then
    each row keeps its own expert's result.
    """
    L, D, Fh = down_proj_LDF.shape
    e_S = torch.repeat_interleave(torch.arange(L), counts_L.to(torch.int64).cpu()).to(x_SD.device)
    h_SL2F = torch.einsum("sd,lfd->slf", x_SD, gate_up_proj_L2FD)
    a_SLF = _ACTS[activation](h_SL2F, Fh) * probs_S[:, None, None]
    y_SLD = torch.einsum("slf,ldf->sld", a_SLF, down_proj_LDF)
    return y_SLD[torch.arange(x_SD.shape[0], device=x_SD.device), e_S]
