"""The workloads an old-vs-new benchmark runs, the same code in both worker processes.

Imported by ``benchmarks/_baseline_worker.py`` after it has put one tree's moeplug on the path,
so everything here reaches moeplug only through what both trees have: ``config_from_dict``,
``build_model`` (moeplug.build; the baseline's moeplug.modules), ``PluginHost.load``,
the trainer's ``train_step``,
``build_rank_optimizer``, ``seed_everything``, ``step_batches``, and the MoE layer found in the
built model by its class name (it moved from ``moeplug.modules.moe`` to ``moeplug.moe``).

A workload is built from JSON-ready parameters and has ``run()`` (one timed unit of work) and
``digest()`` (what the unit computed, to compare the two trees bit for bit: sha256 of the
output and every gradient of the first call, or every step's loss).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def _sha(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


def _build(model: dict, train: dict | None = None, runtime: dict | None = None,
           vocab: int = 256):
    from moeplug.config import config_from_dict
    try:  # this checkout: the builder left moeplug.modules (#44 item 4); the baseline's: there
        from moeplug.build import build_model
    except ImportError:
        from moeplug.modules import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import seed_everything
    cfg = config_from_dict({"model": model, **({"train": train} if train else {}),
                            "runtime": runtime or {}})
    host = PluginHost.load()
    seed_everything(0)
    return cfg, host, build_model(cfg, host, vocab)


class MoELayerStep:
    """One MoE layer's forward + backward on fixed input (as benchmarks/test_bench_moe_layer.py
    and test_bench_sync_free.py time it): the layer of a 1-layer model built from the config,
    its gate redrawn at std 0.02 so routing is near-balanced, as in trained models."""

    def __init__(self, T: int, D: int, F: int, E: int, K: int, dtype: str = "fp32",
                 runtime: dict | None = None) -> None:
        _, _, model = _build({"hidden_size": D, "num_layers": 1, "num_heads": 4,
                              "num_kv_heads": 2, "first_k_dense": 0,
                              "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": F}},
                             runtime=runtime)
        self.layer = next(m for m in model.modules() if type(m).__name__ == "MoELayer")
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.layer.router.weight.copy_(
                torch.randn(self.layer.router.weight.shape, generator=g) * 0.02)
        self.x_TD = torch.randn(T, D, generator=g)
        self.w_TD = torch.randn(T, D, generator=g)
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
        self.first: str | None = None

    def run(self) -> None:
        x = self.x_TD.clone().requires_grad_(True)
        self.layer.zero_grad(set_to_none=True)
        with self.autocast:
            out = self.layer(x)
            y_TD, aux = out[0], out[1]
            loss = (y_TD.float() * self.w_TD).sum() + aux
        loss.backward()
        if self.first is None:
            grads = [p.grad for _, p in sorted(self.layer.named_parameters())
                     if p.grad is not None]
            self.first = _sha([y_TD, x.grad, *grads])

    def digest(self) -> dict:
        return {"output_and_grads_sha": self.first}


class TrainStep:
    """The real ``train_step`` (forward, backward, clip, AdamW) of a model built from the
    config, one step a unit; every step's loss and grad norm are kept (both trees step in
    lockstep, so step i of one is step i of the other)."""

    def __init__(self, model: dict, train: dict, runtime: dict | None = None,
                 precision: str = "fp32", vocab: int = 256) -> None:
        from moeplug.training.trainer import build_rank_optimizer
        self.cfg, host, self.model = _build(model, train, runtime, vocab)
        self.opt = build_rank_optimizer(self.model, self.cfg)
        self.ids = np.random.default_rng(0).integers(0, vocab, 200_000).astype(np.int64)
        self.precision = host.create("precision", precision, {})
        self.losses: list[list[float]] = []
        self.reruns = 0

    def run(self) -> None:
        from moeplug.training.trainer import step_batches, train_step
        # a new batch every step, as training draws them (step i: the same in both trees)
        batches = step_batches(self.ids, self.cfg.train, len(self.losses))
        stats = train_step(self.model, self.opt, batches, self.cfg.train, self.precision)
        self.losses.append([stats.loss, stats.grad_norm])
        if stats.sync_free is not None:
            self.reruns += int(stats.sync_free["reruns"])

    def digest(self) -> dict:
        return {"loss_grad_norm_per_step": [[float.hex(a), float.hex(b)]
                                            for a, b in self.losses],
                "sync_free_reruns": self.reruns}


WORKLOADS = {"moe_layer": MoELayerStep, "train_step": TrainStep}


def make(kind: str, params: dict) -> Any:
    return WORKLOADS[kind](**params)
