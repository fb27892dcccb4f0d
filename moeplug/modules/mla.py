"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3), causal, on torch SDPA; masked to
each document of a packed sample when given document positions (moeplug.data.documents).

Legend: B batch, S sequence, D hidden, H heads, Q q_lora_rank, C kv_lora_rank,
N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim.

    q_BHS(N+R) = W_qb norm(W_qa x)            (W_q x when q_lora_rank = 0)
    [c_BSC, kr_BSR] = W_kva x                 the latent c_kv and one rope key shared by all heads
    [k_nope, v] = W_kvb norm(c_kv)            per head: N + V
    k = [k_nope; rope(kr)], q = [q_nope; rope(q_rope)], softmax(q k^T / sqrt(N + R)) v
Parameter names follow Hugging Face DeepseekV3Attention (``kv_a_proj_with_mqa`` -> ``kv_a_proj``,
``*_layernorm`` -> ``*_norm``), so the conversion is a rename.
"""

from __future__ import annotations

import torch
from torch import nn

from moeplug.config import ModelConfig
from moeplug.modules.attention import CoreAttention
from moeplug.modules.norm import RMSNorm
from moeplug.modules.rope import RotaryEmbedding
from moeplug.modules.wiring import LOCAL
from moeplug.ops.discard import release


class MLAttention(nn.Module):
    """No biases (DeepSeek-V3 ``attention_bias = False``); RoPE only on the R rope dims, with the
    model's table built for R (interleaved when ``mla.rope_interleave``)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        m = cfg.mla
        D, H = cfg.hidden_size, cfg.num_heads
        self.num_heads = H
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(D, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.mla_latent_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk_dim, bias=False)
            self.q_proj = None
        else:
            self.q_proj = nn.Linear(D, H * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(D, m.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, cfg.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)
        # Shared RoPE table, not registered per layer (see Attention).
        self._rope = [rope]
        self.core_attn = CoreAttention()
        self.wiring = LOCAL

    def up_projections(self, q_in_BSX: torch.Tensor, c_BSC: torch.Tensor,
                       k_rope_BSR: torch.Tensor, positions_BS: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention's q, k, v from the latents: the latent norms, the up projections and RoPE
        (Megatron's ``mla_up_proj`` region). ``q_in_BSX``: q_proj's output, or with a q LoRA
        q_a_proj's (its latent). Recompute ``mla_up_proj`` runs this without autograd and
        discards q, k, v once attention has run, making them again before its backward
        (moeplug.modules.recompute.discarded_region)."""
        B, S, _ = c_BSC.shape
        H, N, R, V = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        q_BSX = q_in_BSX if self.q_proj is not None else self.q_b_proj(self.q_a_norm(q_in_BSX))
        q_BHSQ = q_BSX.view(B, S, H, N + R).transpose(1, 2)
        q_nope_BHSN, q_rope_BHSR = q_BHSQ.split([N, R], dim=-1)
        kv_BHSX = self.kv_b_proj(self.kv_a_norm(c_BSC)).view(B, S, H, N + V).transpose(1, 2)
        k_nope_BHSN, v_BHSV = kv_BHSX.split([N, V], dim=-1)
        # Attention keeps v for backward; as a view it would keep all of kv_b_proj's output
        # (N + V a head), which nothing else keeps (k goes on through torch.cat).
        v_BHSV = v_BHSV.contiguous()
        # One rope key for all heads (the "MQA" part): rotate it once as a single head.
        q_rope_BHSR, k_rope_B1SR = self._rope[0](q_rope_BHSR, k_rope_BSR.unsqueeze(1),
                                                 positions_BS=positions_BS)
        q_BHSQ = torch.cat((q_nope_BHSN, q_rope_BHSR), dim=-1)
        k_BHSQ = torch.cat((k_nope_BHSN, k_rope_B1SR.expand(B, H, S, R)), dim=-1)
        return q_BHSQ, k_BHSQ, v_BHSV

    def forward(self, x_BsD: torch.Tensor, positions_BS: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``positions_BS``: the tokens' positions in their documents (packed documents, see
        moeplug.data.documents; the whole sequence under SP), or None for one sequence per row.

        Under TP (Megatron's split MLA) the heads are split: the down projections are
        replicated and run on the tokens this rank holds (its sequence chunk under SP), their
        small latents enter the TP region (all-gathered over the sequence under SP, instead of
        the [B, S, D] input), and the up projections, attention and o_proj work on this rank's
        heads."""
        kv_BSX = self.wiring.enter(self.kv_a_proj(x_BsD))
        c_BSC, k_rope_BSR = kv_BSX.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.q_proj is not None:
            q_in_BSX = self.q_proj(self.wiring.enter(x_BsD))
        else:
            q_in_BSX = self.wiring.enter(self.q_a_proj(x_BsD))
        B, S, _ = c_BSC.shape
        qkv = self.up_projections(q_in_BSX, c_BSC, k_rope_BSR, positions_BS)
        # SDPA's default scale is 1/sqrt(q's last dim) = 1/sqrt(N + R), DeepSeek's softmax scale
        # (no YaRN mscale: only the default rope is supported). V may differ from N + R.
        out_BHSV = self.core_attn(*qkv, positions_BS)
        release(qkv, out_BHSV)  # mla_up_proj: q, k, v dropped until attention's backward
        return self.o_proj(out_BHSV.transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim))
