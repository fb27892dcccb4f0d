"""Rotary position embeddings (Su et al. 2021): "rotate half" layout as in Llama/Mixtral, or the
interleaved-pairs layout of DeepSeek checkpoints (``interleaved=True``).

Legend: B batch, H heads, S sequence positions, Dh head dim (even), P max positions.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions [0, max_seq_len).

    The tables are non-persistent buffers: they are a pure function of (head_dim, theta,
    max_seq_len), so keeping them out of checkpoints lets a checkpoint load into a model with a
    different max_seq_len.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, interleaved: bool = False) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.interleaved = interleaved
        # Computed in fp32 exactly like HF (inv_freq in fp32, positions * inv_freq, then cos/sin),
        # so a Mixtral checkpoint sees bit-identical rotations.
        inv_freq_F = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        pos_P = torch.arange(max_seq_len, dtype=torch.int64).float()
        freqs_PF = pos_P[:, None] * inv_freq_F[None, :]
        emb_PDh = torch.cat((freqs_PF, freqs_PF), dim=-1)
        self.register_buffer("cos_PDh", emb_PDh.cos(), persistent=False)
        self.register_buffer("sin_PDh", emb_PDh.sin(), persistent=False)

    def forward(self, q_BHSDh: torch.Tensor, k_BHSDh: torch.Tensor,
                positions_S: torch.Tensor | None = None,
                positions_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys of a sequence that starts at position 0; given
        ``positions_S`` (int64), of tokens at those positions (a context-parallel shard's global
        ones); given ``positions_BS``, each row's own (packed documents: positions restart per
        document, moeplug.data.documents)."""
        positions = positions_S if positions_BS is None else positions_BS
        # Document positions are never past their token's index in the sequence, which
        # RootConfig bounds by max_seq_len (train.seq_len): reading their max would sync a GPU
        # in every layer for nothing.
        seq_len = (q_BHSDh.shape[-2] if positions_S is None or positions_BS is not None
                   else int(positions_S.max()) + 1)
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds ModelConfig.max_seq_len = {self.max_seq_len}. "
                f"Fix: raise model.max_seq_len to at least {seq_len} or shorten train.seq_len")
        rows = slice(0, seq_len) if positions is None else positions
        cos_SDh = self.cos_PDh[rows].to(q_BHSDh.dtype)
        sin_SDh = self.sin_PDh[rows].to(q_BHSDh.dtype)
        if positions_BS is not None:  # [B, S, Dh] -> [B, 1, S, Dh]: the same for every head
            cos_SDh, sin_SDh = cos_SDh.unsqueeze(1), sin_SDh.unsqueeze(1)
        rotate = _rotate_interleaved if self.interleaved else _rotate
        return rotate(q_BHSDh, cos_SDh, sin_SDh), rotate(k_BHSDh, cos_SDh, sin_SDh)


def _rotate(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    half = x_BHSDh.shape[-1] // 2
    x1, x2 = x_BHSDh[..., :half], x_BHSDh[..., half:]
    rotated_BHSDh = torch.cat((-x2, x1), dim=-1)
    return x_BHSDh * cos_SDh + rotated_BHSDh * sin_SDh


def _rotate_interleaved(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor
                        ) -> torch.Tensor:
    # Pairs (x0, x1), (x2, x3), ... each turn by one frequency; the output puts the rotated even
    # members first, then the odd ones (HF apply_rotary_pos_emb_interleave). Queries and keys get
    # the same permutation, so q.k equals the interleaved rotation's exactly.
    half = x_BHSDh.shape[-1] // 2
    cos_SF, sin_SF = cos_SDh[..., :half], sin_SDh[..., :half]  # the tables are cat(freqs, freqs)
    x1, x2 = x_BHSDh[..., 0::2], x_BHSDh[..., 1::2]
    return torch.cat((x1 * cos_SF - x2 * sin_SF, x2 * cos_SF + x1 * sin_SF), dim=-1)
