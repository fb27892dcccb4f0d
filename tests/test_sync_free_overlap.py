"""Sync-free MoE pipelined over chunks (runtime.sync_free with model.moe.overlap_chunks > 1,
moeplug.moe.overlap): the static region per chunk of tokens, each chunk's EP
exchange in flight while another chunk's experts run.

Proofs:
  * one rank: outputs and gradients equal the dynamic layer's, chunked and unchunked, and the
    unchunked static region's (fp32, the same tolerance as tests/test_sync_free.py), with the
    stash, shared experts and apply_probs_on_input too; no host sync in forward or backward;
    under bf16 autocast within tests/test_sync_free.py's bf16 tolerance;
  * a step over the chunks' budget reruns on the dynamic path: bitwise the run without
    sync_free, naming a budget under which every chunk fits;
  * EP2 and ETP2 on real gloo ranks: the whole model's losses and gradients equal the dynamic
    path's, with no host sync;
  * what the chunked region does not run (capture, a quantization recipe, a GPU) is refused
    before any process group, naming overlap_chunks.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.config import ConfigError, config_from_dict
from moeplug.build import build_model
from moeplug.moe import MoELayer
from moeplug.plugin_host import PluginHost
from moeplug.testing.hostsync import HostSyncCounter
from moeplug.testing.steps import backward_micro_batches, runtime_cfg

VOCAB = 64
TOL = 1e-5  # fp32: the same products, summed in another order


def _cfg(chunks: int, moe: dict | None = None, parallel: dict | None = None, **runtime):
    d = runtime_cfg(**runtime).to_dict()
    d["model"]["moe"].update({"overlap_chunks": chunks, **(moe or {})})
    d["parallel"].update(parallel or {})
    return config_from_dict(d)


def _layer(chunks: int, moe: dict | None = None, **runtime) -> MoELayer:
    torch.manual_seed(0)
    model = build_model(_cfg(chunks, moe, **runtime), PluginHost.load(), VOCAB)
    return next(m for m in model.modules() if isinstance(m, MoELayer))


def _fwd_bwd(layer: MoELayer, x: torch.Tensor, w: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y, aux, counts = layer(x)
    ((y * w).sum() + aux).backward()
    return {"y": y.detach(), "x.grad": x.grad, "counts": counts.clone(),
            **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def _err(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys()
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in a}


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("variant", [{}, {"stash": True}, {"shared": True}, {"top1_probs": True}],
                         ids=["plain", "stash", "shared_experts", "probs_on_input"])
def test_chunked_static_equals_dynamic_with_no_host_sync(chunks, variant):
    moe = {}
    if variant.get("shared"):
        moe["shared_expert_ffn_hidden_size"] = 16
    if variant.get("top1_probs"):
        moe.update(top_k=1, apply_probs_on_input=True)
    layer = _layer(chunks, moe, sync_free=True, stash=variant.get("stash", False))
    state = layer.runtime.runtime.sync_free
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 15, 32, generator=g), torch.randn(2, 15, 32, generator=g)
    with HostSyncCounter() as c:
        static = _fwd_bwd(layer, x, w)
    assert c.count == 0, c.calls
    assert not bool(state.take_overflow())
    if variant.get("stash"):
        assert layer.runtime.runtime.pool.stats()["high_water"] > 0  # the chunks were stashed
    with state.disabled():
        dynamic = _fwd_bwd(layer, x, w)  # the dynamic layer, chunked alike
        layer.overlap_chunks = 1
        unchunked = _fwd_bwd(layer, x, w)
    static_whole = _fwd_bwd(layer, x, w)  # the static region, unchunked
    for name, other in (("dynamic", dynamic), ("dynamic unchunked", unchunked),
                        ("static unchunked", static_whole)):
        errs = _err(static, other)
        assert errs.pop("counts") == 0, name
        assert max(errs.values()) <= TOL, (name, errs)


def test_chunked_static_equals_dynamic_under_bf16_autocast():
    # the chunked GEMMs take the autocast dtype as the unchunked region's do: 2e-2 of each
    # tensor's largest value, as tests/test_sync_free.py allows (measured: at most 6.4e-3)
    layer = _layer(2, sync_free=True)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 15, 32, generator=g), torch.randn(2, 15, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        static = _fwd_bwd(layer, x, w)
        assert not bool(layer.runtime.runtime.sync_free.take_overflow())
        with layer.runtime.runtime.sync_free.disabled():
            dynamic = _fwd_bwd(layer, x, w)
    for k, want in dynamic.items():
        err = float((static[k].float() - want.float()).abs().max())
        assert err <= 2e-2 * float(want.float().abs().max()), (k, err)


def test_the_chunks_are_really_static_and_chunked(monkeypatch):
    # Each chunk takes its own budget (C_c from its T_c tokens) and its exchange is started
    # before the previous chunk's experts run, through the static region's exchange.
    from moeplug.moe.budgeted.exchange import BudgetExchange
    calls = []
    real_start = BudgetExchange.packed_start

    def start(self, x_ECD, counts_WL):
        calls.append(x_ECD.shape[0])
        return real_start(self, x_ECD, counts_WL)

    monkeypatch.setattr(BudgetExchange, "packed_start", start)
    layer = _layer(3, sync_free=True)
    x = torch.randn(2, 15, 32)
    _fwd_bwd(layer, x, torch.ones_like(x))
    # 30 tokens in chunks of 10: C = ceil(10*2/4 * 2.0) = 10 rows per expert, E*C slots
    assert calls == [4 * 10] * 3, calls


def _train(chunks: int, steps: int = 2, **runtime) -> tuple:
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, train_step
    cfg = _cfg(chunks, **runtime)
    seed_everything(0)
    model = build_model(cfg, PluginHost.load(), VOCAB)
    opt = build_rank_optimizer(model, cfg)
    precision = PluginHost.load().create("precision", "fp32", {})
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        batches = [(torch.randint(0, VOCAB, (4, 16), generator=gen),
                    torch.randint(0, VOCAB, (4, 16), generator=gen)) for _ in range(2)]
        out.append(train_step(model, opt, batches, cfg.train, precision))
    return out, model


def test_over_the_chunks_budget_the_step_reruns_bitwise():
    over, over_model = _train(2, sync_free=True, token_budget=0.4)
    off, off_model = _train(2)
    assert [s.sync_free["reruns"] for s in over] == [1, 1]
    # the budget named fits every chunk: a run at it keeps the static path
    need = max(s.sync_free["budget_needed"] for s in over)
    assert 0.4 < need <= 2.0
    fits, _ = _train(2, sync_free=True, token_budget=need)
    assert [s.sync_free["reruns"] for s in fits] == [0, 0], need
    for a, b in zip(over, off):
        assert a.losses() == b.losses()
    for (n, p), q in zip(over_model.named_parameters(), off_model.parameters()):
        assert torch.equal(p, q), n


def _world2_rank(rank: int, world: int, parallel: dict) -> dict:
    from moeplug.parallel import ParallelGroups
    from moeplug.training.distributed import build_rank_model
    cfg = _cfg(2, parallel=parallel, sync_free=True)
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    torch.manual_seed(0)
    model = build_rank_model(cfg, PluginHost.load(), VOCAB, groups)
    state = model.runtime.sync_free
    with HostSyncCounter() as c:
        static = backward_micro_batches(model, VOCAB, 2)
    over = bool(state.take_overflow())
    model.zero_grad(set_to_none=True)
    with state.disabled():
        dynamic = backward_micro_batches(model, VOCAB, 2)
    return {"syncs": c.count, "overflow": over,
            "loss": max(abs(float(a - b)) for a, b in zip(static[0], dynamic[0])),
            "grads": {n: float((static[1][n] - g).abs().max()) for n, g in dynamic[1].items()}}


@pytest.mark.parametrize("parallel", [{"ep": 2}, {"etp": 2}], ids=["ep2", "etp2"])
def test_chunked_static_at_two_ranks_equals_dynamic(parallel):
    from moeplug.testing.distributed import run_distributed
    for rank, r in enumerate(run_distributed(_world2_rank, 2, parallel, timeout=300)):
        assert r["syncs"] == 0 and not r["overflow"], (rank, r)
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)


@pytest.mark.parametrize("over, words", [
    ({"runtime": {"capture": True}}, ("runtime.capture compiles the region whole",)),
    ({"plugins": {"precision": "mxfp8"}}, ("plugins.precision = 'mxfp8'",)),
    ({"train": {"device": "cuda"}}, ("train.device = 'cuda'",)),
])
def test_what_the_chunked_region_does_not_run_is_refused(over, words):
    d = {"model": {"moe": {"overlap_chunks": 2}},
         "runtime": {"sync_free": True, **over.get("runtime", {})}}
    for key in ("plugins", "train"):
        if key in over:
            d[key] = over[key]
    with pytest.raises(ConfigError) as err:
        config_from_dict(d)
    text = str(err.value)
    for w in ("overlap_chunks = 2", "Fix: set model.moe.overlap_chunks: 1", *words):
        assert w in text, (w, text)
    config_from_dict({"model": {"moe": {"overlap_chunks": 2}},
                      "runtime": {"sync_free": True}})  # on the CPU in fp32: accepted


def test_a_gpu_resolved_from_auto_refuses_the_chunked_region():
    # train.device auto resolves to a GPU only at launch (RootConfig cannot see it): the same
    # rules run there, before any work.
    from moeplug.config.modes import check_modes
    cfg = config_from_dict({"model": {"moe": {"overlap_chunks": 2}},
                            "runtime": {"sync_free": True}})
    with pytest.raises(ConfigError, match=r"overlap_chunks = 2 pipelines the CPU's sync-free "
                                          r"region only.*Fix"):
        check_modes(cfg, device="cuda")  # resolve_device's call
    check_modes(config_from_dict({"runtime": {"sync_free": True}}), device="cuda")


def test_a_layer_built_without_the_config_refuses_a_chunked_region_it_cannot_run():
    # RootConfig refuses capture with chunks; a layer built without it says so, not silently
    # unchunked or a crash in the CPU kernels
    layer = _layer(2, sync_free=True)
    layer.runtime.runtime.sync_free.capture = True
    with pytest.raises(ValueError, match=r"overlap_chunks > 1 runs eagerly on the CPU in fp32 or "
                                         r"bf16 only.*Fix: overlap_chunks 1"):
        layer(torch.randn(2, 15, 32))
