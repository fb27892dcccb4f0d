"""Measure a real CPU training run for the planner's validation: step time and peak memory.

    python -m moeplug.plan.measure CONFIG            # one process
    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m moeplug.plan.measure CONFIG               # a gloo layout (config's parallel section)

Writes ``OUT_DIR/measured_rank{R}.json``: ``rss_delta`` (bytes) and ``step_s`` (seconds).

Memory is the peak resident set (``ru_maxrss``) minus the resident set just before the model is
built. A tiny model of the same architecture trains two steps first, and freed heap is handed
back (``malloc_trim``), so the delta holds the run's tensors, not libtorch's code pages or the
corpus. Step time is the trainer's own last logged window (tokens per step / tokens per second),
which leaves the first ``log_interval`` steps (warm-up) out when the run has two windows.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import resource
import sys


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(path: str) -> int:
    import torch

    from moeplug.cli import _load_host, check_plugins
    from moeplug.config import load_config
    from moeplug.data import prepare_corpus
    from moeplug.training import distributed as D
    from moeplug.training.trainer import seed_everything, train

    cfg = load_config(path)
    host = _load_host(cfg)
    precision = check_plugins(host, cfg)
    groups = D.init_distributed(cfg)
    cpu = torch.device("cpu")
    try:
        corpus = prepare_corpus(cfg.data)
        names = {k: getattr(cfg.plugins, k) for k in ("router", "dispatcher", "experts",
                                                      "precision")}
        m = cfg.model
        small = dataclasses.replace(
            cfg, model=dataclasses.replace(m, hidden_size=8 * m.num_heads, kv_channels=0),
            train=dataclasses.replace(cfg.train, steps=2, warmup_steps=1, micro_batch_size=1,
                                      out_dir=os.path.join(cfg.train.out_dir, "warmup")))
        seed_everything(cfg.train.seed)
        train(small, D.build_rank_model(small, host, corpus.vocab_size, groups, cpu), corpus,
              precision, names, groups=groups)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        seed_everything(cfg.train.seed)
        before = _rss_now()
        model = D.build_rank_model(cfg, host, corpus.vocab_size, groups, cpu)
        train(cfg, model, corpus, precision, names, groups=groups)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        D.shutdown(groups)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(cfg.train.out_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if '"train"' in line][-1]
    tc, par = cfg.train, cfg.parallel
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (par.tp * par.cp * par.pp)
    tokens = dp * tc.micro_batch_size * tc.seq_len * tc.grad_accum_steps
    out = {"rss_delta": peak - before, "step_s": tokens / last["tokens_per_s"]}
    with open(os.path.join(tc.out_dir, f"measured_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
