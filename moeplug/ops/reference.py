"""Slow, obviously-correct plain-torch versions of every op in :mod:`moeplug.ops` (for tests).

Shape legend: T tokens, K top-k, D hidden, E experts, L local experts, S routed rows,
F expert FFN hidden size. All math in fp32; results are cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def permute(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K = ids_TK.shape
    order_S = torch.argsort(ids_TK.reshape(-1), stable=True)  # (t, k) order inside each expert
    row_map_TK = torch.empty_like(order_S)  # on the input's device, like every result
    row_map_TK[order_S] = torch.arange(T * K, device=order_S.device)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=num_experts)
    return x_TD[order_S // K], row_map_TK.view(T, K), counts_E


def unpermute(y_SD: torch.Tensor, row_map_TK: torch.Tensor,
              probs_TK: torch.Tensor | None = None) -> torch.Tensor:
    rows_TKD = y_SD.float()[row_map_TK]
    if probs_TK is not None:
        rows_TKD = rows_TKD * probs_TK.float().unsqueeze(-1)
    return rows_TKD.sum(dim=1).to(y_SD.dtype)


def swiglu(h_S2F: torch.Tensor, probs_S: torch.Tensor | None = None) -> torch.Tensor:
    g_SF, u_SF = h_S2F.float().chunk(2, dim=-1)
    a_SF = F.silu(g_SF) * u_SF
    if probs_S is not None:
        a_SF = a_SF * probs_S.float().unsqueeze(-1)
    return a_SF.to(h_S2F.dtype)


def expert_mlp(x_SD: torch.Tensor, probs_S: torch.Tensor, counts_L: torch.Tensor,
               gate_up_proj_L2FD: torch.Tensor, down_proj_LDF: torch.Tensor) -> torch.Tensor:
    """Per-expert loop: y_e = down_e(silu(gate_e x) * (up_e x) * p)."""
    outputs = []
    start = 0
    for e, n in enumerate(counts_L.tolist()):
        x_nD = x_SD[start:start + n]
        h_n2F = x_nD @ gate_up_proj_L2FD[e].t()
        a_nF = swiglu(h_n2F, probs_S[start:start + n])
        outputs.append(a_nF @ down_proj_LDF[e].t())
        start += n
    return torch.cat(outputs) if outputs else x_SD.new_zeros(0, down_proj_LDF.shape[1])
