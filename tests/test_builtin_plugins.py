"""Built-in plugins: public contract checks, pairwise parity, and the router's math.

Legend: T tokens, D hidden, E experts, K top-k, L local experts, S rows, F ffn hidden.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from moeplug.interfaces import Dispatcher, Precision, Router, RouterOutput
from moeplug.plugin_host import PluginHost
from moeplug.testing import (ContractError, check_component, check_dispatcher, check_experts,
                             check_precision, check_router, tiny_model_config)


@pytest.fixture(scope="module")
def host():
    return PluginHost.load(autoload=False)


def _builtins():
    return [(i.kind, i.name) for i in PluginHost.load(autoload=False).infos()
            if i.dist == "moeplug" and i.available]


@pytest.mark.parametrize("kind, name", _builtins())
def test_builtin_meets_the_public_contract(host, kind, name):
    check_component(host, kind, name)


def test_contract_runs_on_every_kind():
    assert {kind for kind, _ in _builtins()} == {"router", "dispatcher", "experts", "precision",
                                                 "dataset"}


# ---- topk router vs a hand-written reference ------------------------------------------------

def _reference_topk(x_TD, w_ED, k, coeff, renormalize):
    """Token by token, in float64, with Python sorting."""
    T, E = x_TD.shape[0], w_ED.shape[0]
    probs, ids, counts = [], [], [0] * E
    P = [0.0] * E
    for t in range(T):
        logits = [sum(float(x_TD[t, d]) * float(w_ED[e, d]) for d in range(x_TD.shape[1]))
                  for e in range(E)]
        z = sum(math.exp(v - max(logits)) for v in logits)
        scores = [math.exp(v - max(logits)) / z for v in logits]
        chosen = sorted(range(E), key=lambda e: -scores[e])[:k]
        total = sum(scores[e] for e in chosen) if renormalize else 1.0
        probs.append([scores[e] / total for e in chosen])
        ids.append(chosen)
        for e in chosen:
            counts[e] += 1
        for e in range(E):
            P[e] += scores[e] / T
    aux = coeff * E * sum(counts[e] / (T * k) * P[e] for e in range(E))
    return torch.tensor(probs, dtype=torch.float64), torch.tensor(ids), aux


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_router_matches_reference(host, renormalize):
    cfg = tiny_model_config(num_experts=6, top_k=2, aux_loss_coeff=0.05)
    torch.manual_seed(1)
    router = host.create("router", "topk", {"renormalize": renormalize}, cfg)
    assert router.weight.shape == (6, cfg.hidden_size) and router.weight.dtype == torch.float32
    x_TD = torch.randn(9, cfg.hidden_size)
    out = router(x_TD)
    probs, ids, aux = _reference_topk(x_TD, router.weight.detach(), 2, 0.05, renormalize)
    assert torch.equal(out.ids_TK, ids)
    torch.testing.assert_close(out.probs_TK.double(), probs, rtol=1e-5, atol=1e-6)
    assert out.aux_loss.item() == pytest.approx(aux, rel=1e-5)
    torch.testing.assert_close(out.logits_TE, x_TD @ router.weight.detach().t())
    sums = out.probs_TK.sum(-1)
    assert torch.allclose(sums, torch.ones(9)) == renormalize


def test_topk_gate_init_uses_model_init_std(host):
    cfg = tiny_model_config(num_experts=64, hidden_size=64)  # 4096 samples: std within ~2%
    torch.manual_seed(0)
    w = host.create("router", "topk", {}, cfg).weight
    assert w.std().item() == pytest.approx(cfg.init_std, rel=0.06)


@pytest.mark.parametrize("E, K", [(4, 1), (8, 2), (6, 3)])
def test_uniform_router_aux_loss_is_exactly_its_coefficient(host, E, K):
    cfg = tiny_model_config(num_experts=E, top_k=K, aux_loss_coeff=0.01)
    router = host.create("router", "topk", {}, cfg)
    with torch.no_grad():
        router.weight.zero_()
    out = router(torch.randn(37, cfg.hidden_size))
    assert abs(out.aux_loss.item() / 0.01 - 1.0) < 1e-6
    # K = 1 defaults to pre-softmax (a renormalised top-1 weight is constant 1.0: no gradient).
    torch.testing.assert_close(out.probs_TK, torch.full((37, K), 1.0 / K if K > 1 else 1.0 / E))


def test_topk_aux_loss_is_zero_when_coefficient_is_zero(host):
    router = host.create("router", "topk", {}, tiny_model_config(aux_loss_coeff=0.0))
    assert router(torch.randn(5, 16)).aux_loss.item() == 0.0


# ---- experts: sequential vs grouped ---------------------------------------------------------

@pytest.mark.parametrize("counts", [[5, 0, 3, 7], [0, 0, 9, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
def test_sequential_and_grouped_experts_agree(host, counts):
    cfg = tiny_model_config(hidden_size=32, ffn_hidden_size=24)
    seq = host.create("experts", "sequential", {}, cfg, 4)
    grp = host.create("experts", "grouped", {}, cfg, 4)
    grp.load_state_dict(seq.state_dict())  # same checkpoint layout: loads with no key changes
    counts_L = torch.tensor(counts)
    S = sum(counts)
    gen = torch.Generator().manual_seed(3)
    x_SD, p_S = torch.randn(S, 32, generator=gen), torch.rand(S, generator=gen)
    w_SD = torch.randn(S, 32, generator=gen)
    results = []
    for experts in (seq, grp):
        x, p = x_SD.clone().requires_grad_(), p_S.clone().requires_grad_()
        y = experts(x, p, counts_L)
        (y * w_SD).sum().backward()
        results.append((y, x.grad, p.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for what, a, b in zip(("y", "dx", "dp", "d gate_up", "d down"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"sequential vs grouped: {what}")


def test_sequential_and_grouped_experts_agree_under_bf16(host):
    cfg = tiny_model_config(hidden_size=32, ffn_hidden_size=24)
    seq = host.create("experts", "sequential", {}, cfg, 3)
    grp = host.create("experts", "grouped", {}, cfg, 3)
    grp.load_state_dict(seq.state_dict())
    counts_L = torch.tensor([4, 0, 6])
    x_SD, p_S = torch.randn(10, 32), torch.rand(10)
    with host.create("precision", "bf16", {}).autocast("cpu"):
        a, b = seq(x_SD, p_S, counts_L), grp(x_SD, p_S, counts_L)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item())


# ---- dispatchers: allgather vs alltoall -----------------------------------------------------

def test_allgather_and_alltoall_agree_at_one_rank(host):
    cfg = tiny_model_config(num_experts=6, top_k=2)
    router = host.create("router", "topk", {}, cfg)
    experts = host.create("experts", "sequential", {}, cfg, 6)
    x_TD = torch.randn(19, cfg.hidden_size)
    outputs = []
    for name in ("alltoall", "allgather"):
        disp = host.create("dispatcher", name, {}, cfg, None)
        assert (disp.num_experts, disp.num_local_experts) == (6, 6)
        x = x_TD.clone().requires_grad_()
        routing = router(x)
        d = disp.dispatch(x, routing)
        y_TD = disp.combine(experts(d.x_SD, d.probs_S, d.counts_L), d.meta)
        y_TD.square().sum().backward()
        outputs.append((d.x_SD, d.probs_S, d.counts_L, y_TD, x.grad, router.weight.grad.clone(),
                        experts.down_proj.grad.clone()))
        router.zero_grad()
        experts.zero_grad()
    for what, a, b in zip(("x_SD", "probs_S", "counts_L", "y_TD", "dx", "d gate", "d down"), *outputs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"alltoall vs allgather: {what}")


def test_moe_pipeline_matches_a_dense_reference(host):
    """route -> dispatch -> experts -> combine == per token sum_k p * expert_k(x)."""
    cfg = tiny_model_config(num_experts=4, top_k=2)
    router = host.create("router", "topk", {}, cfg)
    experts = host.create("experts", "grouped", {}, cfg, 4)
    disp = host.create("dispatcher", "alltoall", {}, cfg, None)
    x_TD = torch.randn(7, cfg.hidden_size)
    r = router(x_TD)
    d = disp.dispatch(x_TD, r)
    y_TD = disp.combine(experts(d.x_SD, d.probs_S, d.counts_L), d.meta)
    Fh = cfg.moe.ffn_hidden_size
    want = torch.zeros_like(x_TD)
    for t in range(7):
        for k in range(2):
            e = int(r.ids_TK[t, k])
            h = experts.gate_up_proj[e] @ x_TD[t]
            want[t] += r.probs_TK[t, k] * (experts.down_proj[e] @ (F.silu(h[:Fh]) * h[Fh:]))
    torch.testing.assert_close(y_TD, want.detach(), rtol=1e-5, atol=1e-6)


# ---- precision ------------------------------------------------------------------------------

def test_bf16_autocast_computes_bf16_and_keeps_routing_fp32(host):
    cfg = tiny_model_config()
    router = host.create("router", "topk", {}, cfg)
    with host.create("precision", "bf16", {}).autocast("cpu"):
        y = torch.nn.functional.linear(torch.randn(3, 16), torch.randn(4, 16))
        out = router(torch.randn(3, 16))
    assert y.dtype == torch.bfloat16 and out.probs_TK.dtype == torch.float32
    assert host.create("precision", "fp32", {}).compute_dtype == torch.float32


def test_te_fp8_imports_transformer_engine_only_when_created():
    import moeplug_plugins.precision as precision  # importing the plugin module needs no TE
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        precision.make_te_fp8(None)


# ---- the contract checks themselves catch broken plugins ------------------------------------

class _DuplicateIdsRouter(Router):
    def __init__(self, model, options):
        super().__init__()
        self.num_experts, self.top_k = model.moe.num_experts, model.moe.top_k

    def forward(self, x_TD):
        T = x_TD.shape[0]
        return RouterOutput(torch.full((T, self.top_k), 0.5), torch.zeros(T, self.top_k, dtype=torch.int64),
                            torch.zeros(()))


class _StatefulDispatcher(Dispatcher):
    """Keeps the last row map on self: a second dispatch in flight breaks the first combine."""

    def __init__(self, model, options, group):
        self.num_experts = self.num_local_experts = model.moe.num_experts

    def dispatch(self, x_TD, routing):
        from moeplug.interfaces import Dispatched
        from moeplug.ops import permute
        x_SD, self.row_map_TK, counts = permute(x_TD, routing.ids_TK, self.num_experts)
        probs_S = routing.probs_TK.new_zeros(x_SD.shape[0]).index_put(
            (self.row_map_TK.reshape(-1),), routing.probs_TK.reshape(-1))
        return Dispatched(x_SD, probs_S, counts, None)

    def combine(self, y_SD, meta):
        from moeplug.ops import unpermute
        return unpermute(y_SD, self.row_map_TK)


def _permuted(x_TD, routing, E):
    """(x_SD, probs_S, counts_L, row_map_TK): the rows grouped by expert, no padding."""
    from moeplug.ops import permute
    x_SD, row_map_TK, counts = permute(x_TD, routing.ids_TK, E)
    p_S = routing.probs_TK.new_zeros(x_SD.shape[0]).index_put(
        (row_map_TK.reshape(-1),), routing.probs_TK.reshape(-1))
    return x_SD, p_S, counts, row_map_TK


class _PaddingIgnoredDispatcher(Dispatcher):
    """Right rows and weights, but no padding for routing.pad_multiple / capacity."""

    def __init__(self, model, options, group):
        self.num_experts = self.num_local_experts = model.moe.num_experts

    def dispatch(self, x_TD, routing):
        from moeplug.interfaces import Dispatched
        return Dispatched(*_permuted(x_TD, routing, self.num_experts))

    def combine(self, y_SD, meta):
        from moeplug.ops import unpermute
        return unpermute(y_SD, meta)


class _WeightedCopiesDispatcher(_PaddingIgnoredDispatcher):
    """Sends p * x with prob 1 (the interfaces forbid weighted copies): the same model under
    linear experts, another one under any real expert. A sweep found the contract passed it."""

    def dispatch(self, x_TD, routing):
        from moeplug.interfaces import Dispatched
        x_SD, p_S, counts, row_map_TK = _permuted(x_TD, routing, self.num_experts)
        return Dispatched(x_SD * p_S.unsqueeze(-1), torch.ones_like(p_S), counts, row_map_TK)


def _detached_experts(model, options, L):
    from moeplug_plugins.experts.sequential import SequentialExperts

    class Detached(SequentialExperts):
        def forward(self, x_SD, probs_S, counts_L):
            return super().forward(x_SD, probs_S, counts_L).detach()
    return Detached(model, L)


def _probs_ignoring_experts(model, options, L):
    from moeplug_plugins.experts.sequential import SequentialExperts

    class ProbsIgnored(SequentialExperts):
        def forward(self, x_SD, probs_S, counts_L):
            return super().forward(x_SD, torch.ones_like(probs_S), counts_L)
    return ProbsIgnored(model, L)


class _LeakyPrecision(Precision):
    name, compute_dtype = "leaky", torch.bfloat16

    def autocast(self, device_type):
        torch.set_autocast_enabled(device_type, True)  # never turned off again
        torch.set_autocast_dtype(device_type, torch.bfloat16)
        return contextlib.nullcontext()


class _PickledStatePrecision(Precision):
    name, compute_dtype = "pickled", torch.float32

    def state_dict(self, model, groups=None):
        return {"histories": torch.zeros(2)}  # a tensor: meta.json could not hold it


class _OldSignaturePrecision(Precision):
    name, compute_dtype = "old", torch.float32

    def state_dict(self, model):  # before the trainer passed the run's groups
        return None


@pytest.mark.parametrize("check, factory, rule", [
    (check_router, _DuplicateIdsRouter, "same expert twice"),
    (check_dispatcher, _StatefulDispatcher, "dispatch changed attributes on self (row_map_TK)"),
    (check_dispatcher, _WeightedCopiesDispatcher, "differs from the reference"),
    (check_dispatcher, _PaddingIgnoredDispatcher, "with pad_multiple = 4, counts_L ="),
    (check_experts, _probs_ignoring_experts, "output differs from the reference"),
    # a bare RuntimeError from autograd once, not a ContractError naming the rule
    (check_experts, _detached_experts, "the output carries no gradient"),
    (check_precision, lambda options: _LeakyPrecision(), "did not restore the previous autocast state"),
    (check_precision, lambda options: _PickledStatePrecision(), "state_dict() must be JSON-ready"),
    (check_precision, lambda options: _OldSignaturePrecision(), "state_dict(model, groups) must accept"),
])
def test_contract_checks_reject_broken_plugins(check, factory, rule):
    try:
        with pytest.raises(ContractError) as err:
            check(factory, "broken")
        assert rule in str(err.value) and "'broken'" in str(err.value)
    finally:
        torch.set_autocast_enabled("cpu", False)
