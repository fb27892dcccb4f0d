"""Memory levers at the standard MoE shape: peak memory and step time of each vs the baseline.

Model: 2 MoE blocks at the standard shape (D=1024, F=1408, E=16, top-4, SwiGLU, gqa 8 heads),
T = B*S tokens per step (512; MOEPLUG_BENCH_SEQ=2048 gives the issue's standard 4096: every
lever in ~6 minutes on a quiet 2-core machine, far longer under load; MOEPLUG_BENCH_LEVERS picks
a comma-separated subset of the names below, whose references are added),
vocabulary 512. MOEPLUG_BENCH_REPEATS sets the timed rounds (3). One model; each lever switches
on it, the baseline with one change:
    recompute <names>   model.recompute selective
    full recompute      model.recompute granularity full (uniform, 1 layer)
    offload <names>     model.offload (module inputs to the file-backed second tier)
    stash               runtime.stash (the routed experts' saved tensors in the paged pool)
    bf16 moments        train.optimizer_dtype bf16 (optimizer bytes; step includes AdamW)
    bf16 master         train.master_dtype bf16 (a second model with bf16 parameters, stepped
                        under bf16 autocast; compare with "bf16 autocast + AdamW")
Per lever, in an untimed pass: the peak bytes held for backward (ActivationMeter: what autograd
saves, parameters excluded; offloaded tensors are not held) and the process's resident peak
over one step above its resident size before it (VmHWM, reset first; the workspace cache
cleared, so buffers a lever frees are not counted as held). Step time: forward + backward +
AdamW step, interleaved round-robin, as per-round ratios to the baseline timed in the same round
("bf16 master" to "bf16 autocast"): the wall-time median, and the process CPU time's median
and range. The baseline is timed twice per round; its ratio to itself is the run's noise band,
and a lever's cost is stated only when all its rounds lie outside that band. Memory-efficient
permutation has no switch (the permuted rows are always kept unweighted, tests/test_memory.py);
the row it saves, one [T*K, D] fp32 copy per MoE layer, is printed as arithmetic.

Run: pytest -q benchmarks/test_bench_memory.py -s -k levers    (~15 minutes on 2 loaded cores)
     MOEPLUG_BENCH_SEQ=2048 \
     MOEPLUG_BENCH_LEVERS="recompute moe_act,offload expert_fc1+moe_act,bf16 master" \
     pytest -q benchmarks/test_bench_memory.py -s -k levers       (T = 4096, the standard shape)
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile

import torch

from benchmarks.conftest import interleave, interleave_samples, paired_ratios
from moeplug.config import (ModelConfig, MoEConfig, RecomputeConfig, RootConfig, RuntimeSection,
                            TrainConfig)
from moeplug.build import build_model
from moeplug.modules.recompute import apply_recompute, remove_recompute
from moeplug.modules.offload import Offloader, apply_offload, remove_offload
from moeplug.runtime import workspace
from moeplug.plugin_host import PluginHost
from moeplug.runtime import stream
from moeplug.training.memory import (ActivationMeter, optimizer_tensors, process_peak,
                                     reset_process_peak, tensor_bytes)
from moeplug.training.optim import apply_param_dtype, build_optimizer

D, F, E, K, V = 1024, 1408, 16, 4, 512
B, S = 2, int(os.environ.get("MOEPLUG_BENCH_SEQ", "256"))  # T = B*S tokens per step
ATTN = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
LEVERS = {
    "baseline": {},
    "recompute moe_act": {"modules": ["moe_act"]},
    "recompute moe": {"modules": ["moe"]},
    "full recompute": {"granularity": "full"},
    "offload expert_fc1+moe_act": {"offload": ["expert_fc1", "moe_act"]},
    "offload attention pieces": {"offload": ATTN},
    "offload all": {"offload": ATTN + ["expert_fc1", "moe_act"]},
    "stash": {"stash": True},
    # Optimizer levers: timed with the AdamW step, against the same reference with one.
    "baseline + AdamW": {"adamw": True},
    "bf16 moments": {"optimizer_dtype": "bf16", "adamw": True},
    "bf16 autocast + AdamW": {"autocast": True, "adamw": True},
    "bf16 master": {"master": True, "autocast": True, "adamw": True},
}
REFERENCE = {"bf16 moments": "baseline + AdamW", "bf16 autocast + AdamW": "baseline + AdamW",
             "bf16 master": "bf16 autocast + AdamW"}


def _reference(name: str) -> str:
    return REFERENCE.get(name, "baseline + AdamW" if LEVERS[name].get("adamw") else "baseline")


def _chosen() -> dict:
    """MOEPLUG_BENCH_LEVERS (all when unset), with each one's references and the baseline."""
    names = [n.strip() for n in os.environ.get("MOEPLUG_BENCH_LEVERS", "").split(",") if n.strip()]
    if not names:
        return LEVERS
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise ValueError(f"MOEPLUG_BENCH_LEVERS: unknown lever(s) {unknown}; known: {list(LEVERS)}")
    keep = {"baseline"}
    for n in names:
        while n not in keep:
            keep.add(n)
            n = _reference(n)
    return {n: lever for n, lever in LEVERS.items() if n in keep}


def _recompute_cfg(lever: dict) -> RecomputeConfig:
    if "modules" in lever:
        return RecomputeConfig(granularity="selective", modules=lever["modules"])
    return RecomputeConfig(granularity=lever.get("granularity", "none"))


AGAIN = "baseline (again)"


def _verdict(ratios: list[float], noise: list[float]) -> str:
    """A lever's per-round CPU-time ratios against the baseline-vs-itself band of the same run:
    a cost only when every round lies outside the band (3 rounds: no single lucky sample)."""
    if min(ratios) > max(noise):
        return f"+{(statistics.median(ratios) - 1) * 100:.0f} %"
    if max(ratios) < min(noise):
        return f"{(statistics.median(ratios) - 1) * 100:.0f} %"
    return "noise"


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_memory_levers(report):
    # One model (the levers switch on it: this machine has no room for a dozen), built with the
    # stash registered (off until its lever), and a bf16-parameter twin for the master lever.
    moe = MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F, aux_loss_coeff=1e-2)
    m = ModelConfig(hidden_size=D, num_layers=2, num_heads=8, num_kv_heads=8, first_k_dense=0,
                    max_seq_len=S, moe=moe)
    tc = TrainConfig(seq_len=S, warmup_steps=0, micro_batch_size=B)
    cfg = RootConfig(model=m, train=tc, runtime=RuntimeSection(stash=True))
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), V)
    model.runtime.stash_active = False
    torch.manual_seed(0)
    master_cfg = TrainConfig(seq_len=S, warmup_steps=0, master_dtype="bf16")
    twin = apply_param_dtype(build_model(RootConfig(model=m, train=tc), PluginHost.load(), V),
                              master_cfg)
    opts = {dtype: build_optimizer(model, TrainConfig(seq_len=S, optimizer_dtype=dtype))
            for dtype in ("fp32", "bf16")}
    opts["master"] = build_optimizer(twin, master_cfg)
    offloader = Offloader(tempfile.gettempdir(), 65536, 64 << 30)
    g = torch.Generator().manual_seed(1)
    tok, tgt = (torch.randint(0, V, (B, S), generator=g) for _ in range(2))

    def switch(lever: dict):
        remove_recompute(model)
        remove_offload(model)
        model.cfg.recompute = rc = _recompute_cfg(lever)
        apply_recompute(model, rc)
        if lever.get("offload"):
            apply_offload(model, lever["offload"], offloader)
        model.runtime.stash_active = bool(lever.get("stash"))
        if lever.get("master"):
            return twin, opts["master"]
        return model, opts[lever.get("optimizer_dtype", "fp32")]

    def one_step(lever: dict, meter: ActivationMeter | None = None):
        mdl, opt = switch(lever)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(lever.get("autocast"))):
            if meter is None:
                mdl(tok, tgt).loss.backward()
            else:
                with meter.active():
                    mdl(tok, tgt).loss.backward()
        if lever.get("adamw"):
            opt.step()
        stream("offload").synchronize()  # the tier's frees ran: the next lever starts clean
        return mdl, opt

    levers = _chosen()
    for lever in ({}, {"optimizer_dtype": "bf16"}, {"master": True, "autocast": True},
                  {"stash": True}):  # warm: every optimizer's state exists, the pool is made
        if not lever or any(all(lv.get(k) == v for k, v in lever.items())
                            for lv in levers.values()):
            one_step({**lever, "adamw": True})
    repeats = int(os.environ.get("MOEPLUG_BENCH_REPEATS", "3"))
    peaks, rss, opt_bytes, wg_bytes = {}, {}, {}, {}
    for name, lever in levers.items():
        workspace.clear()
        gc.collect()
        meter = ActivationMeter(twin if lever.get("master") else model)
        before = _rss()
        reset_process_peak(torch.device("cpu"))
        mdl, opt = one_step(lever, meter)
        rss[name] = process_peak(torch.device("cpu")) - before
        params = list(mdl.parameters())
        peaks[name], opt_bytes[name] = meter.peak, tensor_bytes(optimizer_tensors(opt))
        wg_bytes[name] = tensor_bytes(params) + tensor_bytes(p.grad for p in params)
    # The baseline timed twice per round: how far two runs of the same step drift apart in this
    # run is the noise band a lever's step-time cost must leave to count as a cost.
    timed = {**levers, AGAIN: levers["baseline"]}
    wall, cpu = interleave_samples({name: (lambda lv=lever: one_step(lv))
                                    for name, lever in timed.items()}, repeats=repeats, warmup=0)
    times = {name: statistics.median(s) for name, s in wall.items()}
    noise = {kind: paired_ratios(samples, AGAIN, "baseline")
             for kind, samples in (("wall", wall), ("cpu", cpu))}
    base = peaks["baseline"]
    mib = 2 ** 20
    print(f"\nT = {B * S} tokens, 2 MoE blocks (D {D}, F {F}, E {E}, top-{K}); baseline "
          f"activations {base / mib:.1f} MiB, step {times['baseline']:.2f} s")
    print("saved = activation bytes held for backward below the baseline's; state saved = "
          "weights + grads + optimizer bytes below the lever's reference's")
    print(f"{'lever':<28} {'held MiB':>9} {'saved MiB':>10} {'RSS peak MiB':>13} "
          f"{'weights+grads MiB':>18} {'optimizer MiB':>14} {'state saved MiB':>16} "
          f"{'step time x':>12} {'CPU time x [range]':>20} {'cost':>12}  vs")
    section = f"memory levers T={B * S}"
    for name in levers:
        ref = _reference(name)
        ratio = statistics.median(paired_ratios(wall, name, ref))
        cpu_r = paired_ratios(cpu, name, ref)
        verdict = _verdict(cpu_r, noise["cpu"]) if name != ref else ""
        saved = base - peaks[name]
        state_saved = (wg_bytes[ref] + opt_bytes[ref]) - (wg_bytes[name] + opt_bytes[name])
        cpu_txt = f"{statistics.median(cpu_r):.2f} [{min(cpu_r):.2f}-{max(cpu_r):.2f}]"
        print(f"{name:<28} {peaks[name] / mib:>9.1f} {saved / mib:>10.1f} "
              f"{rss[name] / mib:>13.1f} {wg_bytes[name] / mib:>18.1f} "
              f"{opt_bytes[name] / mib:>14.1f} {state_saved / mib:>16.1f} {ratio:>12.2f} "
              f"{cpu_txt:>20} {verdict:>12}  {ref}")
        report.row(section, f"{name} held", peaks[name] / base, "x",
                   note=f"{saved / mib:.1f} MiB saved")
        report.row(section, f"{name} RSS peak", rss[name] / rss["baseline"], "x",
                   note=f"{(rss['baseline'] - rss[name]) / mib:.1f} MiB saved")
        report.row(section, f"{name} step time", ratio, "x", note=f"vs {ref}")
        report.row(section, f"{name} step CPU time", statistics.median(cpu_r), "x",
                   note=f"vs {ref}, rounds {min(cpu_r):.2f}-{max(cpu_r):.2f}: {verdict}")
    lo, hi = min(noise["cpu"]), max(noise["cpu"])
    print(f"noise: the baseline against itself, per round: CPU time {lo:.2f}-{hi:.2f}, wall "
          f"{min(noise['wall']):.2f}-{max(noise['wall']):.2f}. cost = every round of the lever "
          f"above {hi:.2f} (a real cost), below {lo:.2f} (faster), else within noise")
    perm = 2 * B * S * K * D * 4
    print(f"memory-efficient permutation: the unkept weighted copy is {perm / mib:.1f} MiB "
          f"(2 layers x T*K x D fp32)")
    print(f"offload: {offloader.stats()}", flush=True)
    # Recompute and offloading must lower what is held; bf16 moments halve the optimizer state,
    # bf16 master weights halve the weights and grads.
    assert all(peaks[n] < base for n in levers
               if n.startswith(("recompute", "full", "offload")))
    if "bf16 moments" in levers:
        assert opt_bytes["bf16 moments"] * 2 == opt_bytes["baseline + AdamW"]
    if "bf16 master" in levers:
        assert wg_bytes["bf16 master"] * 2 == wg_bytes["baseline"]


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
