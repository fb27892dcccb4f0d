"""Causal grouped-query self-attention (Ainslie et al. 2023) on torch SDPA, with optional
per-head q/k RMSNorm (Qwen3) and a head dim independent of hidden / heads (``kv_channels``).
Given the tokens' positions in their documents (``positions_BS``, packed documents under
``data.document_mask``), attention stays inside each document and RoPE restarts per document
(moeplug.data.documents).

Legend: B batch, S sequence, D hidden, H query heads, G key/value heads (H % G == 0), Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeplug.config import ModelConfig
from moeplug.data.documents import attention_mask
from moeplug.modules.norm import RMSNorm
from moeplug.modules.rope import RotaryEmbedding
from moeplug.modules.wiring import LOCAL


class CoreAttention(nn.Module):
    """Causal softmax(q k^T / sqrt(Dh)) v on SDPA: Megatron's ``core_attn``, a module of its
    own so that recompute (model.recompute.modules: [core_attn]) can checkpoint just it.
    ``positions_BS`` (packed documents): also masked to each query's document, a boolean
    block-diagonal causal mask [B, 1, S, S] built here from the positions."""

    def forward(self, q_BHSDh: torch.Tensor, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor,
                positions_BS: torch.Tensor | None = None) -> torch.Tensor:
        # enable_gqa lets SDPA broadcast the G kv heads over H query heads without
        # materialising repeated K/V.
        gqa = k_BGSDh.shape[1] != q_BHSDh.shape[1]
        if positions_BS is None:
            return F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh, is_causal=True,
                                                  enable_gqa=gqa)
        index_S = torch.arange(q_BHSDh.shape[-2], device=q_BHSDh.device)
        return F.scaled_dot_product_attention(
            q_BHSDh, k_BGSDh, v_BGSDh, attn_mask=attention_mask(index_S, index_S, positions_BS),
            enable_gqa=gqa)


class Attention(nn.Module):
    """q/k/v/o projections without bias, RoPE on q and k, causal SDPA with shared kv heads.
    Built for one process; moeplug.parallelize makes q/k/v column- and o row-parallel (TP) and
    sets ``wiring`` (the TP region's entry; under CP its ``cp_attention``)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # Qwen3: normalising q and k per head bounds the attention logits; one weight [Dh] each,
        # shared by all heads. Registered only when on, so other checkpoints have no such keys.
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # One RoPE table shared by every layer; held in a list so it is not registered (and
        # counted, moved, saved) once per layer.
        self._rope = [rope]
        self.core_attn = CoreAttention()
        self.wiring = LOCAL

    def forward(self, x_BSD: torch.Tensor, positions_BS: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``positions_BS``: each token's position in its document (packed documents; this
        CP rank's tokens, the whole sequence under SP), or None for one sequence per row."""
        x_BSD = self.wiring.enter(x_BSD)  # TP: gather the sequence (SP) once for q, k, v
        B, S, _ = x_BSD.shape
        q_BHSDh = self.q_proj(x_BSD).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k_BGSDh = self.k_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BGSDh = self.v_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q_BHSDh, k_BGSDh = self.q_norm(q_BHSDh), self.k_norm(k_BGSDh)
        cp = self.wiring.cp_attention
        if cp is not None:
            # Context parallel: x holds a load-balanced shard of the sequence, so RoPE and the
            # causal mask use global positions and K/V are exchanged over the CP group.
            out_BHSDh = cp(q_BHSDh, k_BGSDh, v_BGSDh, self._rope[0], positions_BS)
        else:
            q_BHSDh, k_BGSDh = self._rope[0](q_BHSDh, k_BGSDh, positions_BS=positions_BS)
            # Positional: a recomputed core_attn's forward takes *args only.
            out_BHSDh = self.core_attn(q_BHSDh, k_BGSDh, v_BGSDh, positions_BS)
        return self.o_proj(out_BHSDh.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))
