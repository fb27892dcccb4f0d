"""Memory levers at the standard MoE shape: peak activation bytes and step time vs baseline.

Model: 2 MoE blocks at the standard shape (D=1024, F=1408, E=16, top-4, SwiGLU, gqa 8 heads),
T = B*S tokens per step (512; MOEPLUG_BENCH_SEQ=2048 gives the standard 4096), vocabulary 512.
One model; each lever switches on it, the baseline with one change:
    recompute <names>   model.recompute selective
    full recompute      model.recompute granularity full (uniform, 1 layer)
    bf16 moments        train.optimizer_dtype bf16 (optimizer bytes; step includes AdamW)
Peak activation bytes: moeplug.training.memory.ActivationMeter over one forward+backward (what
autograd holds for backward, parameters excluded), measured in an untimed pass per lever.
Step time: forward + backward + AdamW step, interleaved round-robin (medians), as a ratio to
the baseline timed in the same run. Memory-efficient permutation has no switch (the permuted
rows are always kept unweighted, tests/test_memory.py); the row it saves, one [T*K, D] fp32
copy per MoE layer, is printed as arithmetic.

Run: pytest -q benchmarks/test_bench_memory.py -s     (a few minutes on 2 cores)
"""

from __future__ import annotations

import os

import torch

from benchmarks.conftest import interleave
from moeplug.config import (ModelConfig, MoEConfig, RecomputeConfig, RootConfig, TrainConfig)
from moeplug.modules import build_model
from moeplug.modules.recompute import apply_recompute, remove_recompute
from moeplug.plugin_host import PluginHost
from moeplug.training.memory import ActivationMeter, optimizer_tensors, tensor_bytes
from moeplug.training.optim import build_optimizer

D, F, E, K, V = 1024, 1408, 16, 4, 512
B, S = 2, int(os.environ.get("MOEPLUG_BENCH_SEQ", "256"))  # T = B*S tokens per step
LEVERS = {
    "baseline": {},
    "recompute core_attn": {"modules": ["core_attn"]},
    "recompute layernorm": {"modules": ["layernorm"]},
    "recompute moe_act": {"modules": ["moe_act"]},
    "recompute moe": {"modules": ["moe"]},
    "full recompute": {"granularity": "full"},
    "bf16 moments": {"optimizer_dtype": "bf16"},
}


def _recompute_cfg(lever: dict) -> RecomputeConfig:
    if "modules" in lever:
        return RecomputeConfig(granularity="selective", modules=lever["modules"])
    return RecomputeConfig(granularity=lever.get("granularity", "none"))


def test_memory_levers(report):
    # One model (the levers switch on it: this machine has no room for seven), two optimizers.
    moe = MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F, aux_loss_coeff=1e-2)
    m = ModelConfig(hidden_size=D, num_layers=2, num_heads=8, num_kv_heads=8, first_k_dense=0,
                    max_seq_len=S, moe=moe)
    tc = TrainConfig(seq_len=S, warmup_steps=0)
    torch.manual_seed(0)
    model = build_model(RootConfig(model=m, train=tc), PluginHost.load(), V)
    opts = {dtype: build_optimizer(model, TrainConfig(seq_len=S, optimizer_dtype=dtype))
            for dtype in ("fp32", "bf16")}
    g = torch.Generator().manual_seed(1)
    tok, tgt = (torch.randint(0, V, (B, S), generator=g) for _ in range(2))

    def switch(lever: dict):
        remove_recompute(model)
        model.cfg.recompute = rc = _recompute_cfg(lever)
        apply_recompute(model, rc)
        return opts[lever.get("optimizer_dtype", "fp32")]

    def step_for(lever: dict):
        def step():
            opt = switch(lever)
            opt.zero_grad(set_to_none=True)
            model(tok, tgt).loss.backward()
            opt.step()
        return step

    peaks, opt_bytes = {}, {}
    for name, lever in LEVERS.items():
        opt = switch(lever)
        meter = ActivationMeter(model)
        opt.zero_grad(set_to_none=True)
        with meter.active():
            model(tok, tgt).loss.backward()
        opt.step()
        peaks[name], opt_bytes[name] = meter.peak, tensor_bytes(optimizer_tensors(opt))
    times = interleave({name: step_for(lever) for name, lever in LEVERS.items()}, repeats=3)
    base = peaks["baseline"]
    print(f"\nT = {B * S} tokens, 2 MoE blocks; baseline activations {base / 2**20:.1f} MiB, "
          f"optimizer {opt_bytes['baseline'] / 2**20:.1f} MiB, step {times['baseline']:.2f} s")
    print(f"{'lever':<22} {'activations MiB':>16} {'saved MiB':>10} {'optimizer MiB':>14} "
          f"{'step time x':>12}")
    for name in LEVERS:
        saved = base - peaks[name]
        ratio = times[name] / times["baseline"]
        print(f"{name:<22} {peaks[name] / 2**20:>16.1f} {saved / 2**20:>10.1f} "
              f"{opt_bytes[name] / 2**20:>14.1f} {ratio:>12.2f}")
        report.row("memory levers", f"{name} activations", peaks[name] / base, "x",
                   note=f"{saved / 2**20:.1f} MiB saved")
        report.row("memory levers", f"{name} step time", ratio, "x")
    perm = 2 * B * S * K * D * 4
    print(f"memory-efficient permutation: the unkept weighted copy is {perm / 2**20:.1f} MiB "
          f"(2 layers x T*K x D fp32)", flush=True)
    # Recompute must save activation bytes; bf16 moments halve the optimizer state.
    assert all(peaks[n] < base for n in LEVERS if n.startswith(("recompute", "full")))
    assert opt_bytes["bf16 moments"] * 2 == opt_bytes["baseline"]


def test_memory_stats_overhead(report):
    """train.memory_stats' saved-tensor meter (a Python object per saved tensor) on the default
    model's real train_step: step time with the meter over without, interleaved."""
    from moeplug.config import load_config
    from moeplug.training.trainer import train_step
    cfg = load_config()
    torch.manual_seed(0)
    host = PluginHost.load()
    model = build_model(cfg, host, 2048)
    opt = build_optimizer(model, cfg.train)
    precision = host.create("precision", "fp32", {})
    tc = cfg.train
    g = torch.Generator().manual_seed(1)
    batch = [tuple(torch.randint(0, 2048, (tc.micro_batch_size, tc.seq_len), generator=g)
                   for _ in range(2))]
    meter = ActivationMeter(model)

    def on():
        with meter.active():
            train_step(model, opt, batch, tc, precision)
    times = interleave({"off": lambda: train_step(model, opt, batch, tc, precision), "on": on},
                       repeats=7)
    ratio = times["on"] / times["off"]
    print(f"\nmemory_stats meter: step {times['off'] * 1e3:.0f} ms off, on / off {ratio:.3f}")
    report.row("memory_stats", "step time on / off", ratio, "x")
