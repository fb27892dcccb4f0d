"""What the paged stash (runtime.stash) costs in step time and what it does to activation memory,
and how many allocations a steady-state step still makes on the MoE path.

Two copies of one small MoE model, stash off and on, run the real ``train_step`` interleaved
round-robin in one run (machine drift hits both alike). Reported: off / on median step time
(1.0 = free), and the activation bytes autograd holds at the end of a forward: the unique
storages of every saved tensor that is not a parameter, counted by a saved_tensors_hooks around
the whole forward (the experts stage's own hook takes precedence when the stash is on, so what it
stashed is not counted there). With the stash on, the pool's high-water pages are added back:
that sum is what the stashed run really holds.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.conftest import interleave

MICRO = 2


def _setup(stash: bool):
    from moeplug.config import config_from_dict
    from moeplug.modules import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, step_batches
    cfg = config_from_dict({
        "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 128, "first_k_dense": 0,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 128}},
        "train": {"steps": 100, "micro_batch_size": 4, "seq_len": 128, "warmup_steps": 1,
                  "grad_accum_steps": MICRO},
        "runtime": {"stash": stash},
    })
    host = PluginHost.load()
    seed_everything(0)
    model = build_model(cfg, host, 256)
    ids = np.random.default_rng(0).integers(0, 256, 100_000).astype(np.int64)
    return cfg, model, build_rank_optimizer(model, cfg), step_batches(ids, cfg.train, 0)


def _saved_activation_bytes(model, tokens, targets) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, targets)
    held = sum(storages.values())
    out.loss.backward()  # returns the stash pages
    model.zero_grad(set_to_none=True)
    return held


def test_stash_step_time_and_activation_bytes(report):
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import stash_runtime, train_step
    torch.set_num_threads(1)  # a shared machine: more threads only add scheduling noise
    precision = PluginHost.load().create("precision", "fp32", {})
    runs = {name: _setup(name == "on") for name in ("off", "on")}

    def step(name):
        cfg, model, opt, batches = runs[name]
        return lambda: train_step(model, opt, batches, cfg.train, precision)

    times = interleave({"off": step("off"), "on": step("on")}, repeats=15, warmup=2)
    ratio = times["off"] / times["on"]
    held = {n: _saved_activation_bytes(r[1], *r[3][0]) for n, r in runs.items()}
    pool = stash_runtime(runs["on"][1]).pool
    pool_bytes = pool.stats()["high_water"] * pool.page_bytes
    print(f"\nstep {times['off'] * 1e3:.1f} ms off, {times['on'] * 1e3:.1f} ms on; autograd holds "
          f"{held['off'] / 2**20:.2f} MiB off, {held['on'] / 2**20:.2f} MiB on + "
          f"{pool_bytes / 2**20:.2f} MiB of pool pages (pool {pool.size_bytes / 2**20:.2f} MiB)")
    report.row("stash", "step time off / on", ratio, target=0.9,
               note=f"{times['on'] * 1e3:.1f} ms/step on; 1.0 = free")
    report.row("stash", "torch-held activations on / off", held["on"] / held["off"],
               note="the experts' saves moved to the pool")
    report.row("stash", "activations + pool pages on / off",
               (held["on"] + pool_bytes) / held["off"], note="what the stashed run holds")
    assert held["on"] < held["off"]  # the stash did take the experts' activations


# Backward nodes of the MoE path's ops (dispatch, experts, combine and the fused router).
MOE_BACKWARD_NODES = ("_PermuteBackward", "_ExpertMLPBackward", "_UnpermuteBackward",
                      "_FusedRouteBackward", "IndexPutBackward0")
BIG = 1 << 20  # activation-sized: what the stash and the workspace cache exist for


def _moe_allocations(model, step) -> tuple[int, int, int]:
    """(allocations, of which >= 1 MiB, bytes) made by one step on the MoE path: inside an
    MoELayer's forward (a record_function range opened by hooks) or an MoE op's backward node,
    counted from the profiler's memory accounting: every op whose own (self) CPU allocations
    net of its own frees are positive counts once (an op allocates its output once)."""
    from moeplug.modules.moe import MoELayer
    ranges: list = []
    handles = []
    for m in model.modules():
        if isinstance(m, MoELayer):
            handles.append(m.register_forward_pre_hook(
                lambda *_: ranges.append(_enter(record_function("moeplug::moe_layer")))))
            handles.append(m.register_forward_hook(lambda *_: ranges.pop().close()))
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        for h in handles:
            h.remove()
    count = big = nbytes = 0
    for ev in prof.events():
        if ev.self_cpu_memory_usage <= 0:
            continue
        parent, on_path = ev, False
        while parent is not None and not on_path:
            on_path = parent.name == "moeplug::moe_layer" or any(
                n in parent.name for n in MOE_BACKWARD_NODES)
            parent = parent.cpu_parent
        if on_path:
            count += 1
            big += ev.self_cpu_memory_usage >= BIG
            nbytes += ev.self_cpu_memory_usage
    return count, big, nbytes


def _enter(cm) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(cm)
    return stack


def test_stash_steady_state_allocations(report):
    """After warm-up, the allocations one train_step makes on the MoE path, stash off and on
    (issue 7 target: 0 with the stash)."""
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import train_step
    torch.set_num_threads(1)
    precision = PluginHost.load().create("precision", "fp32", {})
    for name in ("off", "on"):
        cfg, model, opt, batches = _setup(name == "on")

        def step():
            train_step(model, opt, batches, cfg.train, precision)
        for _ in range(3):  # warm-up: pool pages, workspace buffers, optimizer state
            step()
        count, big, nbytes = _moe_allocations(model, step)
        print(f"\nstash {name}: {count} allocations on the MoE path per step, {big} of them "
              f">= 1 MiB, {nbytes / 2**20:.2f} MiB")
        report.row(f"stash {name}", "MoE-path allocations / step", count, unit="",
                   note=f"{big} >= 1 MiB; {nbytes / 2**20:.2f} MiB allocated per step "
                        f"({MICRO} micro-batches x 2 layers)")
        report.row(f"stash {name}", "MoE-path allocations >= 1 MiB / step", big, unit="",
                   note="issue 7 target with the stash: 0")
