"""MFU of a whole ``train_step`` of a mid-size MoE model, against the measured square matmul.

Model: D=1024, 8 heads (GQA 8/4), 2 MoE layers of 16 experts top-4 with F=1408 (SwiGLU,
grouped experts), seq 1024, 4 sequences per step (T=4096 tokens: the standard MoE-layer shape
in every layer), vocabulary 4096, fp32 AdamW. The real ``train_step`` (forward, backward, clip,
optimizer step) is timed interleaved round-robin with a block of 2048^3 matmuls of about the
same FLOPs (so both samples span the same stretch of a drifting, shared machine).

    MFU = model FLOP/s / matmul FLOP/s
model FLOPs: Megatron's count (moeplug.modules.flops: matmuls on the active path x 6, routed
experts K per token; no router, norm or softmax FLOPs), as the train records report it.

Run: pytest -q benchmarks/test_bench_train_step.py -s     (about 2-4 minutes on 2 cores)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.conftest import gflops, interleave

D, E, K, F, SEQ, BATCH, LAYERS, VOCAB = 1024, 16, 4, 1408, 1024, 4, 2, 4096
MATMUL_N = 2048
TARGET_MFU_FP32 = 0.50  # issue 7 (Parallel Folding reports 49.3 % MFU on H100)


def _setup(precision_name: str):
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, step_batches
    cfg = config_from_dict({
        "model": {"hidden_size": D, "num_layers": LAYERS, "num_heads": 8, "num_kv_heads": 4,
                  "max_seq_len": SEQ, "first_k_dense": 0, "vocab_size": VOCAB,
                  "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": F}},
        "train": {"steps": 100, "micro_batch_size": BATCH, "seq_len": SEQ, "warmup_steps": 1,
                  "grad_accum_steps": 1},
    })
    host = PluginHost.load()
    seed_everything(0)
    model = build_model(cfg, host, VOCAB)
    ids = np.random.default_rng(0).integers(0, VOCAB, 200_000).astype(np.int64)
    precision = host.create("precision", precision_name, {})
    return cfg, model, build_rank_optimizer(model, cfg), step_batches(ids, cfg.train, 0), precision


@pytest.mark.parametrize("precision_name", ["fp32"])
def test_train_step_mfu(report, precision_name):
    from moeplug.training.trainer import train_step
    cfg, model, opt, batches, precision = _setup(precision_name)
    tokens = BATCH * SEQ
    step_flop = model.flops_per_token(SEQ) * tokens
    a_NN, b_NN = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    mm_calls = max(1, round(step_flop / (2 * MATMUL_N ** 3)))

    def step():
        train_step(model, opt, batches, cfg.train, precision)

    def matmuls():
        for _ in range(mm_calls):
            torch.mm(a_NN, b_NN)

    times = interleave({"train_step": step, "matmul": matmuls}, repeats=3, warmup=1)
    model_gflops = gflops(step_flop, times["train_step"])
    mm_gflops = gflops(mm_calls * 2 * MATMUL_N ** 3, times["matmul"])
    print(f"\ntrain_step {times['train_step'] * 1e3:.0f} ms for {step_flop / 1e9:.0f} GFLOP "
          f"= {model_gflops:.0f} GFLOP/s; matmul {mm_gflops:.0f} GFLOP/s; "
          f"MFU {model_gflops / mm_gflops:.3f}")
    report.row(f"train_step {precision_name} D{D} E{E} top{K} F{F} seq{SEQ} x{LAYERS} layers",
               "MFU (model FLOP/s / matmul)", model_gflops / mm_gflops,
               target=TARGET_MFU_FP32 if precision_name == "fp32" else None,
               note=f"{model_gflops:.0f} vs {mm_gflops:.0f} GFLOP/s, "
                    f"{times['train_step'] * 1e3:.0f} ms/step")


def test_train_step_old_vs_new(report):
    """#44 item 8: this file's model and train_step in the baseline tree and in this one,
    alternating step by step in one run (benchmarks/_baseline.py): every step's loss and grad
    norm bitwise equal, the new/old step time within the noise band."""
    from benchmarks._baseline import NOISE_BAND, old_vs_new
    params = {"model": {"hidden_size": D, "num_layers": LAYERS, "num_heads": 8,
                        "num_kv_heads": 4, "max_seq_len": SEQ, "first_k_dense": 0,
                        "vocab_size": VOCAB,
                        "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": F}},
              "train": {"steps": 100, "micro_batch_size": BATCH, "seq_len": SEQ,
                        "warmup_steps": 1, "grad_accum_steps": 1},
              "vocab": VOCAB}
    res = old_vs_new("train_step", params, pairs=4, warmup=1)
    report.row(f"train_step fp32 D{D} E{E} top{K} F{F} seq{SEQ} x{LAYERS} layers",
               "new / old (median pair)", res.median, note=res.note())
    print(f"\ntrain_step old vs new: {res.median:.3f} ({res.note()}); "
          f"band {NOISE_BAND[0]:.2f}-{NOISE_BAND[1]:.2f}; losses {res.new_digest}")
    res.check()
