"""The fused router kernel (moeplug.routing.fused, runtime_cpp/src/route.cpp) against the
plain-torch routing math it replaces: same ids, probs and aux statistics, and the same logit
gradients, for every option it covers; then the ``topk`` router fused vs unfused end to end.

Legend: T tokens, E experts, K top-k, G groups, B sequences, S tokens per sequence, D hidden.
Tolerances: fp32 assert_close defaults (rtol 1.3e-6, atol 1e-5) for forward values; gradients
rtol 1e-5 / atol 1e-6 (the kernel's exp is a ~1-ulp polynomial, torch's is Sleef's).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import moeplug.runtime as rt
from moeplug import routing as R
from moeplug.routing.fused import FusedRouting
from moeplug.plugin_host import PluginHost
from moeplug.testing import tiny_model_config

GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
# The router's cases on the CPU kernel, and on the CUDA route kernels where a GPU and the CUDA
# extension are (marked cuda: `pytest -m cuda`; they skip with the reason elsewhere).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device_or_skip(device: str) -> torch.device:
    if device == "cuda":
        try:
            rt.get_cuda_runtime()
        except rt.RuntimeMissingError as exc:
            pytest.skip(str(exc))
    return torch.device(device)


def _reference(logits_TE, k, aux_counts, B, **route):
    """topk_routing plus the aux statistics the router computes from the [T, E] aux scores."""
    probs_TK, ids_TK = R.topk_routing(logits_TE, k, **route)
    if aux_counts is None:
        return probs_TK, ids_TK, None, None
    T, E = logits_TE.shape
    s_TE = R.aux_scores(logits_TE, route["score_function"])
    count_ids_TK = R.counts_for_aux(s_TE, ids_TK, aux_counts)
    counts_BE = torch.stack([R.expert_counts(c, E) for c in count_ids_TK.view(B, -1, k)])
    return probs_TK, ids_TK, s_TE.view(B, T // B, E).mean(dim=1), counts_BE


def _by_id(ids_TK, probs_TK):
    """ids and probs with each token's K slots sorted by expert id (autograd flows through)."""
    ids_sorted, order = ids_TK.sort(dim=1)
    return ids_sorted, probs_TK.gather(1, order)


ROUTES = [dict(score_function=fn, renormalize=renorm, bias=bias, groups=groups, scale=scale)
          for fn, renorm, bias, groups, scale in itertools.product(
              ["softmax", "sigmoid", "sqrtsoftplus"], [True, False], [False, True],
              [None, (4, 2, "topk_share"), (4, 2, "top2_sum"), (8, 3, "topk_share")],
              [1.0, 2.5])
          if not (fn == "softmax" and bias)]


def _ids(r):
    g = r["groups"]
    return (f"{r['score_function']}-{'renorm' if r['renormalize'] else 'raw'}"
            f"{'-bias' if r['bias'] else ''}-{'nogroups' if g is None else '%d.%d.%s' % g}"
            f"-x{r['scale']}")


AUX_CASES = [(None, 1), ("plain_topk", 1), ("routed", 2), ("plain_topk", 3)]
# On a GPU, one route per score function and group rule (the CUDA kernels' math is covered
# route by route in tests/test_cuda_kernels.py; this proves fused_topk_routing's use of them).
CUDA_ROUTES = [r for r in ROUTES if _ids(r) in (
    "softmax-renorm-nogroups-x1.0", "softmax-raw-4.2.topk_share-x2.5",
    "sigmoid-renorm-bias-8.3.topk_share-x2.5", "sqrtsoftplus-renorm-bias-4.2.top2_sum-x1.0",
    "sigmoid-raw-nogroups-x1.0")]


@pytest.mark.parametrize("aux_counts,B", AUX_CASES)
@pytest.mark.parametrize("r", ROUTES, ids=_ids)
def test_fused_equals_torch_forward_and_backward(r, aux_counts, B):
    _fused_equals_torch(r, aux_counts, B, torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("aux_counts,B", AUX_CASES)
@pytest.mark.parametrize("r", CUDA_ROUTES, ids=_ids)
def test_fused_on_cuda_equals_torch_forward_and_backward(r, aux_counts, B):
    _fused_equals_torch(r, aux_counts, B, _device_or_skip("cuda"))


def _fused_equals_torch(r, aux_counts, B, dev):
    """fused_topk_routing on ``dev`` against the torch routing math on the CPU."""
    T, E, K = 48, 32, 6
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, so a failing draw must reproduce.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{_ids(r)}/{aux_counts}/{B}".encode()))
    logits_TE = torch.randn(T, E, generator=gen) * 2
    route = dict(score_function=r["score_function"], renormalize=r["renormalize"],
                 expert_bias_E=torch.randn(E, generator=gen) * 0.1 if r["bias"] else None,
                 scaling_factor=r["scale"])
    if r["groups"]:
        route.update(num_groups=r["groups"][0], group_topk=r["groups"][1],
                     group_score=r["groups"][2])
    g_TE, h_BE = torch.randn(T, E, generator=gen), torch.randn(B, E, generator=gen)

    z_ref = logits_TE.clone().requires_grad_()
    probs, ids, mean_BE, counts_BE = _reference(z_ref, K, aux_counts, B, **route)
    z_fused = logits_TE.to(dev).requires_grad_()
    route_dev = dict(route, expert_bias_E=None if route["expert_bias_E"] is None else
                     route["expert_bias_E"].to(dev))
    out = R.fused_topk_routing(z_fused, K, **route_dev, aux_counts=aux_counts, num_sequences=B)
    out = FusedRouting(out.probs_TK.cpu(), out.ids_TK.cpu(), None if out.stats is None else
                         R.AuxStats(out.stats.mean_BE.cpu(), out.stats.counts_BE.cpu()))

    # Same experts with the same probabilities, compared in expert-id order: torch.topk leaves
    # the order of exactly equal scores unspecified (bias-shifted fp32 scores tie about once in
    # 10^4 draws here) while the kernel puts the lower id first (test_ties_go_to_...).
    (ids, probs), (ids_fused, probs_fused) = (_by_id(i, p) for i, p in ((ids, probs),
                                                                        (out.ids_TK, out.probs_TK)))
    assert torch.equal(ids_fused, ids)
    torch.testing.assert_close(probs_fused, probs)
    # The upstream gradient belongs to (token, expert), so it is the same whatever the slot order.
    loss_ref = (probs * g_TE.gather(1, ids)).sum()
    loss_fused = (probs_fused * g_TE.gather(1, ids_fused)).sum()
    if aux_counts is not None:
        assert torch.equal(out.stats.counts_BE, counts_BE)
        torch.testing.assert_close(out.stats.mean_BE, mean_BE)
        loss_ref = loss_ref + (mean_BE * h_BE).sum()
        loss_fused = loss_fused + (out.stats.mean_BE * h_BE).sum()
    else:
        assert out.stats is None
    loss_ref.backward()
    loss_fused.backward()
    torch.testing.assert_close(z_fused.grad.cpu(), z_ref.grad, **GRAD_TOL)


def test_fused_deepseek_v3_shape_and_aux_only_gradient():
    """E=256, 8 groups / 4 kept, sigmoid + bias, scaling 2.5; the aux path alone (probs unused)
    still sends its gradient, and the probs path alone likewise."""
    T, E, K = 64, 256, 8
    gen = torch.Generator().manual_seed(7)
    logits_TE = torch.randn(T, E, generator=gen)
    route = dict(score_function="sigmoid", renormalize=True, expert_bias_E=torch.randn(E) * 1e-2,
                 num_groups=8, group_topk=4, scaling_factor=2.5)
    for use_probs, use_aux in ((True, False), (False, True), (True, True)):
        z_ref, z_fused = (logits_TE.clone().requires_grad_() for _ in range(2))
        probs, ids, mean_BE, _ = _reference(z_ref, K, "plain_topk", 1, **route)
        out = R.fused_topk_routing(z_fused, K, **route, aux_counts="plain_topk")
        assert torch.equal(out.ids_TK, ids)
        loss_ref = probs.sum() * use_probs + (mean_BE * torch.arange(E)).sum() * use_aux
        loss_fused = out.probs_TK.sum() * use_probs + (out.stats.mean_BE * torch.arange(E)).sum() * use_aux
        loss_ref.backward()
        loss_fused.backward()
        torch.testing.assert_close(z_fused.grad, z_ref.grad, **GRAD_TOL)


def test_ties_go_to_the_lower_expert_id():
    logits_TE = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    out = R.fused_topk_routing(logits_TE, 3, score_function="sigmoid", renormalize=False)
    assert out.ids_TK.tolist() == [[1, 2, 3]]


def test_ties_at_the_deepseek_v3_shape_go_to_the_lower_id():
    """E=256 takes the kernel's vectorised top-k (16+ scores per row); logits of -100, 0 and 100
    give sigmoid scores of exactly 0, 0.5 and 1 in torch and in the kernel, so nearly every
    choice is a tie. Reference: stable descending sorts (equal scores keep the lower id first)
    for the groups, the experts and the plain top-k counts."""
    T, E, K, G, KG = 64, 256, 8, 8, 4
    gen = torch.Generator().manual_seed(11)
    logits_TE = (torch.randint(-1, 2, (T, E), generator=gen) * 100).float()
    bias_E = torch.randint(-2, 3, (E,), generator=gen).float() * 0.25  # exact sums with s
    out = R.fused_topk_routing(logits_TE, K, score_function="sigmoid", renormalize=True,
                               expert_bias_E=bias_E, num_groups=G, group_topk=KG,
                               aux_counts="plain_topk")
    s_TE = torch.sigmoid(logits_TE)
    sel_TGN = (s_TE + bias_E).view(T, G, E // G)
    group_TG = sel_TGN.sort(dim=-1, descending=True).values[..., :K // KG].sum(-1)
    kept_TG = group_TG.sort(dim=-1, descending=True, stable=True).indices[:, :KG]
    masked_TGN = sel_TGN.clone()
    masked_TGN[~torch.zeros(T, G, dtype=torch.bool).scatter(1, kept_TG, True)] = float("-inf")
    ids_TK = masked_TGN.view(T, E).sort(dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(out.ids_TK, ids_TK)
    a_TE = s_TE / (s_TE.sum(-1, keepdim=True) + 1e-20)
    plain_TK = a_TE.sort(dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(out.stats.counts_E, torch.bincount(plain_TK.reshape(-1), minlength=E))


def test_fused_refuses_what_it_does_not_cover():
    assert not R.fused_routing_applies(torch.zeros(4, 8, dtype=torch.float64))
    assert not R.fused_routing_applies(torch.zeros(0, 8))
    assert not R.fused_routing_applies(torch.zeros(4, 8, device="meta"), cuda=True)
    with pytest.raises(ValueError, match="needs fp32 logits"):
        R.fused_topk_routing(torch.zeros(4, 8, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="num_sequences=3 does not split num_tokens=4"):
        R.fused_topk_routing(torch.zeros(4, 8), 2, aux_counts="routed", num_sequences=3)


# ---- the topk router, fused vs unfused --------------------------------------------------------

ROUTER_CASES = {
    "mixtral": {},
    "pre_softmax_seq_global_z": {"renormalize": False, "load_balancing_type":
                                 ["aux_loss", "seq_aux_loss", "global_aux_loss"],
                                 "aux_loss_coeff": [1e-2, 1e-3, 1e-2], "z_loss_coeff": 1e-3},
    "deepseek_v3": {"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": 4,
                    "group_topk": 2, "topk_scaling_factor": 2.5, "group_score": "top2_sum",
                    "load_balancing_type": "seq_aux_loss"},
    "sqrtsoftplus_routed_capacity": {"score_function": "sqrtsoftplus", "aux_loss_counts": "routed",
                                     "capacity_factor": 1.0},
    "no_aux": {"load_balancing_type": "none", "score_function": "sigmoid"},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_fused_equals_unfused(case, device):
    """On a GPU with ``fused_cuda``: the CUDA route kernels in the router against its torch
    path on the same GPU."""
    dev = _device_or_skip(device)
    E, K, D, B, S = 16, 4, 32, 2, 12
    cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=D)
    host = PluginHost.load()
    routers = {f: host.create("router", "topk", {**ROUTER_CASES[case], "fused": f,
                                                 "fused_cuda": device == "cuda"}, cfg).to(dev)
               for f in (True, False)}
    routers[False].load_state_dict(routers[True].state_dict())
    if routers[True].expert_bias is not None:
        for r in routers.values():
            r.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    assert routers[True]._fused_applies(torch.zeros(B * S, E, device=dev), B)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B * S, D, generator=gen).to(dev)
    g_TK = torch.randn(B * S, K, generator=gen).to(dev)
    outs, grads = {}, {}
    for fused, router in routers.items():
        x_TD = x.clone().requires_grad_()
        out = router(x_TD, num_sequences=B)
        ((out.probs_TK * g_TK).sum() + out.aux_loss).backward()
        outs[fused], grads[fused] = out, (x_TD.grad, router.weight.grad)
    a, b = outs[True], outs[False]
    assert torch.equal(a.ids_TK, b.ids_TK)
    torch.testing.assert_close(a.probs_TK, b.probs_TK)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)
    assert a.losses.keys() == b.losses.keys()
    for name in a.losses:
        torch.testing.assert_close(a.losses[name], b.losses[name])
    if b.dropped_TK is not None:
        assert torch.equal(a.dropped_TK, b.dropped_TK)
    for ga, gb in zip(grads[True], grads[False]):
        torch.testing.assert_close(ga, gb, **GRAD_TOL)
    if routers[True].step_counts_E is not None:
        assert torch.equal(routers[True].step_counts_E, routers[False].step_counts_E)


def test_router_fp64_keeps_the_torch_path():
    cfg = tiny_model_config(num_experts=8, top_k=2, hidden_size=16)
    router = PluginHost.load().create("router", "topk", {"dtype": "fp64"}, cfg)
    logits = torch.zeros(4, 8, dtype=torch.float64)
    assert not router._fused_applies(logits, 1)
    out = router(torch.randn(4, 16))
    assert out.ids_TK.shape == (4, 2)
