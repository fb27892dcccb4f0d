"""direct_write under ``model.moe.overlap_chunks``: chunks 1, chunks 3 with the dispatcher's own
start/wait split, and chunks 3 with the whole exchange in ``*_start`` (the Dispatcher base
class's split), interleaved; per rank the medians of the step time and of the time blocked in
the heap's DONE waits (peers' rows / reads) and ARRIVE waits (the count barrier) per step.
Not in the suite (a script beside benchmarks/test_bench_overlap.py):

    python benchmarks/direct_write_overlap_time.py [EP ranks, default 2]
"""
import statistics
import sys
import time

import numpy as np

from moeplug.testing.distributed import run_distributed

WORLD, ROUNDS, WARMUP = int(sys.argv[1]) if len(sys.argv) > 1 else 2, 10, 2


def _cfg(chunks, dispatcher):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 128, "first_k_dense": 0, "dense_ffn_hidden_size": 256,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 256,
                          "shared_expert_ffn_hidden_size": 256, "overlap_chunks": chunks}},
        "plugins": {"dispatcher": dispatcher},
        "train": {"steps": 100, "micro_batch_size": 4, "seq_len": 128, "warmup_steps": 1,
                  "grad_accum_steps": 2},
        "parallel": {"ep": WORLD}})


def _unsplit(d):
    """``d`` with the whole exchange in *_start, *_wait returning it (Dispatcher's defaults)."""
    from moeplug_plugins.dispatchers.direct_write import DirectWriteDispatcher as DW
    d.dispatch_start = lambda x, r: DW.dispatch_wait(d, DW.dispatch_start(d, x, r))
    d.dispatch_wait = lambda p: p
    d.combine_start = lambda y, meta: DW.combine_wait(d, DW.combine_start(d, y, meta))
    d.combine_wait = lambda p: p


def _run(rank, world):
    import torch.distributed as dist

    from moeplug.parallel import ParallelGroups, shm_heap
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import (
        build_rank_optimizer,
        seed_everything,
        step_batches,
        train_step,
    )
    clock = {"done": 0.0, "arrive": 0.0}
    real_wait, real_arrive = shm_heap.SymmetricHeap.wait_done, shm_heap.SymmetricHeap.arrive

    def wait_done(self, seq):
        t0 = time.perf_counter(); real_wait(self, seq); clock["done"] += time.perf_counter() - t0

    def arrive(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return real_arrive(self, *a, **k)
        finally:
            clock["arrive"] += time.perf_counter() - t0
    shm_heap.SymmetricHeap.wait_done, shm_heap.SymmetricHeap.arrive = wait_done, arrive
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    ids = np.random.default_rng(0).integers(0, 256, 200_000).astype(np.int64)
    runs = {}
    from moeplug_plugins.dispatchers.direct_write import DirectWriteDispatcher as DW
    for name, chunks in (("dw chunks=1", 1), ("dw chunks=3 split", 3), ("dw chunks=3 unsplit", 3)):
        cfg = _cfg(chunks, "direct_write")
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        seed_everything(0)
        model = build_rank_model(cfg, host, 256, groups)
        if name.endswith("unsplit"):  # the base class's split: whole exchange in *_start
            dws = [m.dispatcher for m in model.modules()
                   if isinstance(getattr(m, "dispatcher", None), DW)]
            assert dws
            for d in dws:
                _unsplit(d)
        runs[name] = (cfg, groups, model, build_rank_optimizer(model, cfg, groups))
    s = {n: {"step": [], "done": [], "arrive": []} for n in runs}
    for rnd in range(ROUNDS + WARMUP):
        for name, (cfg, groups, model, opt) in runs.items():
            batches = step_batches(ids, cfg.train, rnd, groups)
            dist.barrier()
            clock["done"] = clock["arrive"] = 0.0
            t0 = time.perf_counter()
            train_step(model, opt, batches, cfg.train, precision, groups)
            dist.barrier()
            if rnd >= WARMUP:
                s[name]["step"].append(time.perf_counter() - t0)
                s[name]["done"].append(clock["done"]); s[name]["arrive"].append(clock["arrive"])
    return {n: {k: statistics.median(v) * 1e3 for k, v in d.items()} for n, d in s.items()}


if __name__ == "__main__":
    import os
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, EP{WORLD}")
    for r, res in enumerate(run_distributed(_run, WORLD, timeout=900, pg_timeout=600)):
        for n, t in res.items():
            print(f"rank {r} {n}: step {t['step']:.1f} ms, blocked in DONE waits {t['done']:.1f} ms, "
                  f"in ARRIVE (count barrier) {t['arrive']:.1f} ms")
