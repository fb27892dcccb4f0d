"""Parallel layouts at 4 ranks: where a training step's time goes, and how close the dispatchers
get to a raw gloo all-to-all of the same bytes.

1. Step breakdown for EP4, TP2 x EP4 (attention TP2/DP2, MoE EP4 folded) and EP2 with dense
   DP4 (the expert grid is EP2 x EDP2) on the same small model, each running the real
   ``train_step`` under the library's always-on stage clock (moeplug.observability.timing, the
   ``time_breakdown`` of train records): forward stages attention, router, dispatch, experts,
   combine, then backward, comm_wait, optimizer and the rest; medians over steps, rank 0's
   view.
2. Dispatcher bytes/s: dispatch (counts exchange + permute + all-to-all / all-gather) of T*K
   rows of D fp32 at EP4, timed interleaved with ``dist.all_to_all_single`` of the same number
   of bytes (uniform splits). Ratio = raw time / dispatch time (1.0 = as fast as the raw
   collective).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

from moeplug.observability.timing import STAGES, measure_stages
from moeplug.testing.distributed import run_distributed

WORLD = 4
LAYOUTS = {"ep4": {"ep": 4}, "tp2_ep4": {"tp": 2, "ep": 4, "sequence_parallel": True},
           "ep2_dp4": {"ep": 2}}


def _cfg(parallel: dict, dispatcher: str = "alltoall"):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 128, "first_k_dense": 0, "dense_ffn_hidden_size": 128,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 128}},
        "plugins": {"dispatcher": dispatcher},
        "train": {"steps": 8, "micro_batch_size": 4, "seq_len": 128, "warmup_steps": 1},
        "parallel": parallel,
    })


def _breakdown(rank: int, world: int) -> dict:
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, step_batches, train_step

    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    ids = np.random.default_rng(0).integers(0, 256, 100_000).astype(np.int64)
    out = {}
    for name, par in LAYOUTS.items():
        cfg = _cfg(par)
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        seed_everything(0)
        model = build_rank_model(cfg, host, 256, groups)
        opt = build_rank_optimizer(model, cfg, groups)
        per_step: dict[str, list[float]] = {s: [] for s in (*STAGES, "other", "step")}
        for step in range(cfg.train.steps):
            batches = step_batches(ids, cfg.train, step, groups)
            with measure_stages() as times:
                train_step(model, opt, batches, cfg.train, precision, groups)
            for s, v in per_step.items():
                v.append(times[s])
        # the first two steps warm caches and buffer pools
        out[name] = {s: statistics.median(v[2:]) for s, v in per_step.items()}
    return out


def _dispatch_vs_raw(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.parallel.comm import group_size

    host = PluginHost.load()
    torch.manual_seed(rank)
    out = {}
    for dispatcher in ("alltoall", "allgather"):
        cfg = _cfg({"ep": 4}, dispatcher)
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        m = cfg.model
        router = host.create("router", "topk", {}, m)
        disp = host.create("dispatcher", dispatcher, {}, m, groups.ep)
        T, D = 2048, m.hidden_size
        x_TD = torch.randn(T, D)
        with torch.no_grad():
            routing = router(x_TD)
        rows = T * m.moe.top_k
        send = torch.randn(rows, D)
        recv = torch.empty_like(send)
        W = group_size(groups.ep)

        def run_dispatch():
            with torch.no_grad():
                disp.dispatch(x_TD, routing)

        def run_raw():
            dist.all_to_all_single(recv, send, [rows // W] * W, [rows // W] * W, group=groups.ep)

        samples = {"dispatch": [], "raw": []}
        for i in range(12):
            for name, fn in (("dispatch", run_dispatch), ("raw", run_raw)):
                dist.barrier(group=groups.ep)
                t0 = time.perf_counter()
                fn()
                dist.barrier(group=groups.ep)  # time the slowest rank, like a real step
                if i >= 2:
                    samples[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        nbytes = rows * D * 4
        out[dispatcher] = {"bytes": nbytes, **med}
    return out


@pytest.fixture(scope="module")
def breakdown():
    return run_distributed(_breakdown, WORLD, timeout=900, pg_timeout=300)[0]


def test_step_time_breakdown_at_4_ranks(breakdown, report):
    lines = [f"{'layout':<10} {'step ms':>8} " + " ".join(f"{s:>10}" for s in (*STAGES, "other"))]
    for name, t in breakdown.items():
        lines.append(f"{name:<10} {t['step'] * 1e3:>8.1f} "
                     + " ".join(f"{t[s] / t['step']:>10.1%}" for s in (*STAGES, "other")))
        report.row(f"parallel step {name}", "step time vs ep4", breakdown["ep4"]["step"] / t["step"],
                   note=f"{t['step'] * 1e3:.0f} ms/step; dispatch {t['dispatch'] / t['step']:.0%}, "
                        f"experts {t['experts'] / t['step']:.0%}")
        assert t["step"] >= sum(t[s] for s in STAGES) > 0 and t["comm_wait"] > 0
    print("\n" + "\n".join(lines))


def test_dispatcher_bytes_per_second_vs_raw_all_to_all(report):
    res = run_distributed(_dispatch_vs_raw, WORLD, timeout=600, pg_timeout=300)[0]
    for name, r in res.items():
        ratio = r["raw"] / r["dispatch"]
        report.row(f"dispatch {name} EP4", "raw a2a time / dispatch time", ratio,
                   note=f"{r['bytes'] / r['dispatch'] / 1e9:.2f} GB/s vs raw "
                        f"{r['bytes'] / r['raw'] / 1e9:.2f} GB/s ({r['bytes'] / 1e6:.1f} MB)")
        assert r["dispatch"] > 0 and r["raw"] > 0
