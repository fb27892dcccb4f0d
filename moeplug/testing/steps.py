"""Forward and backward of a few random micro-batches through a built model (recompute and
offloading: on vs off must give the same losses and grads), one-process train steps on fresh
batches (allocation and workspace counts), and a few EP2 training steps per config (stash and
sync-free: on vs off must give the same losses and parameters)."""

from __future__ import annotations

import torch

from moeplug.training.memory import ActivationMeter


def backward_micro_batches(model, vocab: int, micro_batches: int = 2) -> tuple:
    """(loss per micro-batch, the parameters' grads by name, the peak bytes held for backward)
    for ``micro_batches`` batches of 2 x 16 random tokens (fixed seed, drawn on the CPU and moved
    to the model's device), grads accumulated."""
    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    meter, losses = ActivationMeter(model), []
    with meter.active():
        for _ in range(micro_batches):
            tok, tgt = (torch.randint(0, vocab, (2, 16), generator=g) for _ in range(2))
            if device.type != "cpu":  # (HostSyncCounter counts even a no-op .to)
                tok, tgt = tok.to(device), tgt.to(device)
            out = model(tok, tgt)
            (out.loss / micro_batches).backward()
            losses.append(out.loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads, meter.peak


def one_process_trainer(cfg, precision: str = "fp32", vocab: int = 256,
                        num_tokens: int = 50_000) -> tuple:
    """(model, step): ``cfg``'s model built from seed 0 with its optimizer, and ``step()``, one
    train step on the next batch of a fixed random token stream (a new batch every call, so the
    routing and the experts' row counts change step to step)."""
    import numpy as np

    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)
    host = PluginHost.load()
    seed_everything(0)
    model = build_model(cfg, host, vocab)
    opt = build_rank_optimizer(model, cfg)
    ids = np.random.default_rng(0).integers(0, vocab, num_tokens).astype(np.int64)
    prec = host.create("precision", precision, {})
    steps = iter(range(1 << 30))

    def step() -> None:
        train_step(model, opt, step_batches(ids, cfg.train, next(steps)), cfg.train, prec)
    return model, step


def runtime_cfg(**runtime):
    """The runtime tests' model (2 MoE layers of 4 experts, top-2, D 32) and batch shape (2
    micro-batches of 4 x 16 tokens), with ``runtime`` as its runtime section (stash, sync_free,
    their options)."""
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 32, "first_k_dense": 0,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32}},
        "train": {"micro_batch_size": 4, "seq_len": 16, "grad_accum_steps": 2, "lr": 1e-2},
        "runtime": runtime})


def train_ep2_variants(rank: int, world: int, runtimes: dict, vocab: int, stat: str) -> dict:
    """On each rank of a 2-rank gloo run: per named runtime section, ``runtime_cfg``'s model
    under EP2 built from seed 0, trained 2 steps of 2 micro-batches of 4 x 16 random tokens
    (each DP rank its own); returns {name: {"losses", stat, "params"}} where ``stat`` is the
    StepStats field (e.g. "stash", "sync_free") recorded per step."""
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, train_step
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    out = {}
    for name, runtime in runtimes.items():
        cfg = runtime_cfg(**runtime)
        cfg.parallel.ep = 2
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        seed_everything(0)
        model = build_rank_model(cfg, host, vocab, groups)
        opt = build_rank_optimizer(model, cfg, groups)
        gen = torch.Generator().manual_seed(5 + rank)  # each DP rank its own batches
        losses, stats = [], []
        for _ in range(2):
            batches = [(torch.randint(0, vocab, (4, 16), generator=gen),
                        torch.randint(0, vocab, (4, 16), generator=gen)) for _ in range(2)]
            step = train_step(model, opt, batches, cfg.train, precision, groups)
            losses.append(step.losses())
            stats.append(getattr(step, stat))
        out[name] = {"losses": losses, stat: stats,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def two_rank_trainer(rank: int, world: int, dispatcher: str, arenas: bool,
                     options: dict | None = None, parallel: dict | None = None,
                     router_options: dict | None = None, runtime: dict | None = None
                     ) -> tuple:
    """(model, step) on one rank of a 2-rank gloo run: a 2-layer model (8 experts top-2, the
    stash on; EP2 unless ``parallel`` says otherwise) and ``step()``, one train step of 2
    micro-batches on the next random batches (its StepStats). Data-parallel ranks (EP's) get
    batches of their own, tensor-parallel ones the same. ``arenas`` False switches every
    layer's workspace arena off. ``options``: the dispatcher's plugin options;
    ``router_options``: the router's; ``runtime``: more of the ``runtime:`` section."""
    from moeplug.config import config_from_dict
    from moeplug.moe import MoELayer
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, train_step
    torch.set_num_threads(1)
    cfg = config_from_dict({
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 32, "first_k_dense": 0,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 32}},
        "plugins": {"dispatcher": dispatcher, "dispatcher_options": options or {},
                    "router_options": router_options or {}},
        "parallel": parallel or {"ep": 2},
        "train": {"steps": 10, "micro_batch_size": 2, "seq_len": 32, "warmup_steps": 1,
                  "grad_accum_steps": 2},
        "runtime": {"stash": True, **(runtime or {})}})
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    seed_everything(0)
    model = build_rank_model(cfg, host, 256, groups)
    opt = build_rank_optimizer(model, cfg, groups)
    if not arenas:
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.workspace = None
    gen = torch.Generator().manual_seed(5 + rank // (parallel or {}).get("tp", 1))

    def step():
        batches = [(torch.randint(0, 256, (2, 32), generator=gen),
                    torch.randint(0, 256, (2, 32), generator=gen)) for _ in range(2)]
        return train_step(model, opt, batches, cfg.train, precision, groups)
    return model, step


def two_rank_moe_allocations(rank: int, world: int, *args, **kwargs) -> tuple:
    """:func:`two_rank_trainer`'s model trained 5 steps, then the MoE path's allocations in the
    next two steps, summed, as (count, where) of
    :func:`moeplug.testing.allocations.moe_path_allocations` (with the arenas off the counter
    must see the exchanges' buffers)."""
    from moeplug.testing.allocations import moe_path_allocations
    model, step = two_rank_trainer(rank, world, *args, **kwargs)
    for _ in range(5):  # EP2 spreads the rows per expert wider: the scratch classes warm later
        step()
    reports = [moe_path_allocations(model, step) for _ in range(2)]
    return sum(r.count for r in reports), {k: n for r in reports for k, n in r.where.items()}


def two_rank_trajectory(rank: int, world: int, *args, steps: int = 4, **kwargs) -> tuple:
    """:func:`two_rank_trainer`'s losses and grad norms over ``steps`` steps and its final
    parameters: what two variants of a layout must agree on bitwise."""
    model, step = two_rank_trainer(rank, world, *args, **kwargs)
    logged = [(s.losses(), s.grad_norm) for s in (step() for _ in range(steps))]
    return logged, {n: p.detach().clone() for n, p in model.named_parameters()}
