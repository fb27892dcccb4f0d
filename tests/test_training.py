"""Optimizer groups, LR schedule, throughput accounting, metrics output, and the loop itself."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moeplug.config import TrainConfig
from moeplug.training.flops import achieved_tflops, measure_peak_tflops, mfu, slow_bf16_note
from moeplug.training.metrics import MetricsWriter, Progress, expert_load, read_metrics
from moeplug.training.optim import build_optimizer, lr_at, param_groups


# --------------------------------------------------------------------------------------------
# LR schedule: checked against points computed by hand from the formula's definition
# --------------------------------------------------------------------------------------------

def test_warmup_is_linear_and_reaches_lr():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(1e-4)       # 1/10 of lr, never 0
    assert lr_at(4, cfg) == pytest.approx(5e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)


def test_cosine_goes_from_lr_to_min_lr():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx((1e-3 + 1e-4) / 2)  # halfway: cos(pi/2) = 0
    assert lr_at(35, cfg) == pytest.approx(1e-4 + 0.9e-3 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(500, cfg) == pytest.approx(1e-4)
    decay = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_no_warmup():
    cfg = TrainConfig(steps=10, warmup_steps=0, lr=2e-3, min_lr=0.0)
    assert lr_at(0, cfg) == pytest.approx(2e-3)
    assert lr_at(5, cfg) == pytest.approx(1e-3)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.experts = nn.Parameter(torch.zeros(2, 4, 4))


def test_weight_decay_only_on_matrices_that_are_not_embeddings():
    model = _Toy()
    decay, no_decay = param_groups(model, 0.1)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert sorted(by_id[id(p)] for p in decay["params"]) == ["experts", "proj.weight"]
    assert sorted(by_id[id(p)] for p in no_decay["params"]) == [
        "embed.weight", "norm.bias", "norm.weight", "proj.bias"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_optimizer_uses_config_betas():
    opt = build_optimizer(_Toy(), TrainConfig(beta1=0.8, beta2=0.9))
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)


# --------------------------------------------------------------------------------------------
# Throughput accounting
# --------------------------------------------------------------------------------------------

def test_measured_peak_is_plausible_and_quick():
    import time
    t0 = time.perf_counter()
    peak = measure_peak_tflops(budget_s=0.2, size=256)
    assert time.perf_counter() - t0 < 5
    assert 1e-4 < peak < 1e3  # TFLOP/s: between a very slow core and a very large GPU


def test_tflops_and_mfu_arithmetic():
    assert achieved_tflops(6e6, 1000, 2.0) == pytest.approx(3e-3)
    assert mfu(0.05, 0.2) == pytest.approx(0.25)
    assert mfu(1.0, 0.0) == 0.0


def test_a_cpu_bf16_peak_below_half_of_fp32_is_warned_about():
    """The warning compares the bf16 peak with an fp32 matmul it times itself: no CPU's fp32 is as
    slow as 1 kFLOP/s or as fast as 1 PFLOP/s; accelerators are not
    checked. (Which side this host falls on depends on its ISA: AVX2-only CPUs are warned.)"""
    note = slow_bf16_note(1e-9, "cpu")
    assert note and "plugins.precision: fp32" in note and "TFLOP/s" in note
    assert slow_bf16_note(1e3, "cpu") is None
    assert slow_bf16_note(1e-9, "meta") is None


def test_expert_load_max_mean():
    load = expert_load([torch.tensor([4, 0, 2, 2]), torch.tensor([2, 2, 2, 2])])
    assert load[0] == {"layer": 0, "max": 4.0, "mean": 2.0, "max_over_mean": 2.0}
    assert load[1]["max_over_mean"] == 1.0


def test_metrics_writer_appends_json_lines(tmp_path):
    path = str(tmp_path / "m" / "metrics.jsonl")
    w = MetricsWriter(path, append=False)
    w.write({"kind": "val", "step": 1, "val_loss": 2.5})
    w.close()
    w = MetricsWriter(path, append=True)
    w.write({"kind": "val", "step": 2, "val_loss": 2.0})
    w.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    w = MetricsWriter(path, append=False)  # a fresh run starts a fresh file
    w.close()
    assert read_metrics(path) == []


def test_progress_without_terminal_prints_plain_lines():
    lines: list[str] = []
    p = Progress(total=10, initial=0, log=lines.append, use_bar=False)
    record = {"step": 5, "loss": 3.0, "lm_loss": 2.9, "aux_loss": 0.1, "lr": 1e-3,
              "grad_norm": 0.5, "tokens_per_s": 1234.0, "tflops": 0.01, "mfu": 0.05}
    p.step(None)
    p.step(record)
    p.message("val")
    p.close()
    assert len(lines) == 2
    assert "step      5" in lines[0] and "loss 3.0000" in lines[0] and "MFU 5.0%" in lines[0]
    assert lines[1] == "val"


def test_progress_bar_on_a_terminal_replaces_log_lines():
    lines: list[str] = []
    p = Progress(total=3, initial=1, log=lines.append, use_bar=True)
    p.step({"step": 2, "loss": 3.0, "lm_loss": 2.9, "aux_loss": 0.1, "lr": 1e-3,
            "grad_norm": 0.5, "tokens_per_s": 1.0, "tflops": 0.0, "mfu": 0.0})
    assert p._bar.n == 2 and "loss" in p._bar.postfix
    p.close()
    assert lines == []


# --------------------------------------------------------------------------------------------
# The loop on the real model, data and plugins
# --------------------------------------------------------------------------------------------

def _real_pieces(cfg):
    from moeplug.cli import check_plugins
    from moeplug.data import prepare_corpus
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import seed_everything
    host = PluginHost.load()
    precision = check_plugins(host, cfg)
    corpus = prepare_corpus(cfg.data)
    seed_everything(cfg.train.seed)
    return build_model(cfg, host, corpus.vocab_size), corpus, precision


def test_grad_accumulation_matches_one_big_batch(tiny_cfg, tmp_path):
    """2 micro-batches of 4, each loss divided by 2, must leave the gradient of the mean of the
    two micro-batch losses (checked on .grad, which the loop leaves in place after its last
    step: Adam alone would hide a wrong scale), and the same weights after the step."""
    from moeplug.training.trainer import step_batches, train
    cfg = tiny_cfg("train.steps=1", "train.warmup_steps=0", "train.micro_batch_size=4",
                   "train.grad_accum_steps=2", "train.grad_clip=0", "train.eval_batches=1")
    model, corpus, precision = _real_pieces(cfg)
    ref, _, _ = _real_pieces(cfg)  # same seed: identical initial weights
    train(cfg, model, corpus, precision, {}, log=lambda _: None, use_bar=False)

    opt = build_optimizer(ref, cfg.train)
    for g in opt.param_groups:
        g["lr"] = lr_at(0, cfg.train)
    # step 1's two micro-batches: the first 8 samples of the training stream
    batches = step_batches(corpus.train_samples(cfg.train.seq_len, cfg.train.seed), cfg.train, 0)
    assert len(batches) == 2 and batches[0][0].shape == (4, cfg.train.seq_len)
    loss = sum(ref(t, y).loss for t, y in batches) / 2
    loss.backward()
    opt.step()
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5), name
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name


def test_non_finite_loss_stops_with_a_fix(tiny_cfg):
    from moeplug.training.trainer import train
    cfg = tiny_cfg("train.steps=3", "train.warmup_steps=1")
    model, corpus, precision = _real_pieces(cfg)
    with torch.no_grad():
        model.embed.weight.fill_(float("nan"))
    from moeplug.training.faults import TrainingFault
    with pytest.raises(TrainingFault) as err:  # train.nonfinite = stop (the default)
        train(cfg, model, corpus, precision, {}, log=lambda _: None, use_bar=False)
    msg = str(err.value)
    assert "non-finite step 1: loss nan" in msg and "train.lr" in msg and "Fix:" in msg
