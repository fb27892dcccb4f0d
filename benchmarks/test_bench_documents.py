"""What document masking (``data.document_mask``) costs against plain causal attention.

Packed samples of documents averaging 256 tokens (an EOD with probability 1/256). Timed
interleaved round-robin, so the shared machine's drift hits both alike; the rows are ratios
(masked time / causal time, lower is better):

* attention forward + backward at B=4, H=8 (GQA 8/4), S=1024, Dh=64, fp32: SDPA with the
  block-diagonal causal boolean mask [B, 1, S, S] (moeplug.data.documents.attention_mask) against
  SDPA ``is_causal``. On the CPU both run torch's flash kernel, but with a mask it computes
  every key block, where ``is_causal`` skips the blocks above the diagonal;
* a whole ``train_step`` of a MoE model (D=512, 2 MoE layers of 8 experts top-2, S=1024, 2
  sequences), with and without the document positions: what the mask costs a step.

Run: pytest -q -s benchmarks/test_bench_documents.py     (about 1-2 minutes on 2 cores)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.conftest import interleave
from moeplug.data.documents import attention_mask, document_positions, with_positions

EOD = 0


def _tokens(B: int, S: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (B, S), generator=g)
    tokens[torch.rand(B, S, generator=g) < 1 / 256] = EOD
    return tokens


def test_masked_attention_vs_causal(report):
    B, H, G, S, Dh = 4, 8, 4, 1024, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, Dh, generator=g).requires_grad_() for h in (H, G, G))
    positions = document_positions(_tokens(B, S, 1000), EOD)
    index = torch.arange(S)

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def masked():  # the mask is built inside, as CoreAttention does per layer
        F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(index, index, positions),
                                       enable_gqa=True).sum().backward()
    times = interleave({"causal": causal, "masked": masked}, repeats=9)
    report.row("document mask: attention fwd+bwd", "masked / causal time",
               times["masked"] / times["causal"],
               note=f"B{B} H{H}/{G} S{S} Dh{Dh} fp32, docs ~256 tokens; causal "
                    f"{times['causal'] * 1e3:.0f} ms")
    # same values where it matters: a row without EOD is the causal attention
    with torch.no_grad():
        one = torch.zeros(1, S, dtype=torch.int64)
        a = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=True, enable_gqa=True)
        b = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], enable_gqa=True,
                                           attn_mask=attention_mask(index, index, one + index))
    assert (a - b).abs().max() < 1e-5


def test_masked_train_step_vs_causal(report):
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)
    D, S, B, V = 512, 1024, 2, 4096
    cfg = config_from_dict({
        "model": {"hidden_size": D, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4,
                  "max_seq_len": S, "first_k_dense": 0, "vocab_size": V,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 704}},
        "train": {"steps": 100, "micro_batch_size": B, "seq_len": S, "warmup_steps": 1}})
    host = PluginHost.load()
    seed_everything(0)
    model = build_model(cfg, host, V)
    opt = build_rank_optimizer(model, cfg)
    precision = host.create("precision", "fp32", {})
    rng = np.random.default_rng(0)
    ids = rng.integers(1, V, 100_000).astype(np.int64)
    ids[rng.random(ids.size) < 1 / 256] = EOD
    plain = step_batches(ids, cfg.train, 0)
    masked = with_positions(plain, EOD)
    times = interleave({
        "causal": lambda: train_step(model, opt, plain, cfg.train, precision),
        "masked": lambda: train_step(model, opt, masked, cfg.train, precision)}, repeats=5)
    report.row("document mask: MoE train_step", "masked / causal time",
               times["masked"] / times["causal"],
               note=f"D{D} S{S} B{B}, 2 MoE layers E8 top-2, fp32; causal "
                    f"{times['causal']:.2f} s/step")
