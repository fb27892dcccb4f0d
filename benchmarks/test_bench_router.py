"""The ``topk`` router alone (forward + backward) at a DeepSeek-V3-like shape, timed interleaved
with an unfused plain-torch implementation of the same math written out below.

Shape legend: T tokens, D hidden, E experts, K top-k, G expert groups.
Shape: T=4096, D=1024, E=256, K=8, G=8 groups with 4 kept, sigmoid scores + expert bias,
scaling 2.5, Switch aux loss with plain-top-k counts (Megatron's default).

Two figures:
    whole router   gate GEMM + routing + aux loss: the topk router (fused kernel, and with
                   fused: false) vs ``unfused_router``. The [T, D] x [D, E] gate GEMM and its two
                   backward GEMMs are the same torch calls in all three and bound the ratio.
    routing math   what the fused kernel replaces, from the same logits: scores, group-limited
                   top-k with the expert bias, weights, aux statistics and loss, fwd + bwd:
                   ``fused_topk_routing`` vs ``unfused_routing`` (issue 7 target: >= 3x).

Run: pytest -q benchmarks/test_bench_router.py -s   (about 1 minute on 2 cores)
"""

from __future__ import annotations

import torch

from benchmarks.conftest import interleave
from moeplug import routing as R
from moeplug.plugin_host import PluginHost
from moeplug.testing import tiny_model_config

T, D, E, K, G, KG = 4096, 1024, 256, 8, 8, 4
COEFF, SCALE = 1e-2, 2.5
OPTIONS = {"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": G,
           "group_topk": KG, "topk_scaling_factor": SCALE, "aux_loss_coeff": COEFF}


def unfused_router(x_TD, w_ED, bias_E):
    return unfused_routing(x_TD @ w_ED.t(), bias_E)


def unfused_routing(logits_TE, bias_E):
    """Same math, written the straightforward way: dense [T, E] routing maps and masks, a loop
    over groups, one-hot counts (how Megatron's unfused path materialises the routing map)."""
    s_TE = torch.sigmoid(logits_TE)
    sel_TE = s_TE + bias_E
    n = E // G
    group_scores = [sel_TE[:, g * n:(g + 1) * n].topk(K // KG, dim=-1).values.sum(-1) for g in range(G)]
    group_TG = torch.stack(group_scores, dim=1)
    kept_TG = torch.zeros_like(group_TG).scatter(1, group_TG.topk(KG, dim=-1).indices, 1.0)
    mask_TE = torch.cat([kept_TG[:, g:g + 1].expand(-1, n) for g in range(G)], dim=1)
    masked_TE = torch.where(mask_TE > 0, sel_TE, torch.full_like(sel_TE, float("-inf")))
    ids_TK = masked_TE.topk(K, dim=-1).indices
    map_TE = torch.zeros_like(s_TE).scatter(1, ids_TK, 1.0)
    chosen_TE = s_TE * map_TE
    probs_TK = (chosen_TE / (chosen_TE.sum(-1, keepdim=True) + 1e-20)).gather(1, ids_TK) * SCALE
    aux_TE = s_TE / (s_TE.sum(-1, keepdim=True) + 1e-20)
    plain_map_TE = torch.zeros_like(aux_TE).scatter(1, aux_TE.detach().topk(K, dim=-1).indices, 1.0)
    counts_E = plain_map_TE.sum(0)
    aux = COEFF * E * torch.sum(counts_E / (T * K) * aux_TE.mean(0))
    return probs_TK, ids_TK, aux


def _check_same_routing(probs, ids, aux, ref_probs, ref_ids, ref_aux):
    """The fused kernel's sigmoid is a ~1-ulp polynomial, torch's is Sleef's: over T*E = 1M
    scores a few near-ties (scores within an ulp) may resolve the other way. Allowed: at most
    0.1 % of tokens routed differently; every other token's weights equal."""
    same_T = (ids == ref_ids).all(dim=1)
    assert (~same_T).sum() <= T // 1000, f"{int((~same_T).sum())} of {T} tokens routed differently"
    torch.testing.assert_close(probs[same_T], ref_probs[same_T])
    torch.testing.assert_close(aux, ref_aux)


def test_router_deepseek_v3_shape(benchmark, report):
    gen = torch.Generator().manual_seed(0)
    cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=D)
    router = PluginHost.load().create("router", "topk", OPTIONS, cfg)
    router.expert_bias.copy_(torch.randn(E, generator=gen) * 1e-2)
    router.eval()  # no per-step counting: each timed call does the same work
    w_ED = router.weight.detach().clone().requires_grad_()
    x_TD = torch.randn(T, D, generator=gen, requires_grad=True)
    g_TK = torch.randn(T, K, generator=gen)

    def ours():
        out = router(x_TD)
        ((out.probs_TK * g_TK).sum() + out.aux_loss).backward()
        return out

    def unfused():
        probs, ids, aux = unfused_router(x_TD, w_ED, router.expert_bias)
        ((probs * g_TK).sum() + aux).backward()
        return probs, ids, aux

    # Same math first (otherwise the ratio means nothing).
    out, (probs, ids, aux) = ours(), unfused()
    _check_same_routing(out.probs_TK, out.ids_TK, out.aux_loss, probs, ids, aux)
    router.weight.grad = w_ED.grad = x_TD.grad = None

    torch_router = PluginHost.load().create("router", "topk", {**OPTIONS, "fused": False}, cfg)
    torch_router.load_state_dict(router.state_dict())
    torch_router.eval()

    def ours_torch_path():
        out = torch_router(x_TD)
        ((out.probs_TK * g_TK).sum() + out.aux_loss).backward()

    # The routing math alone, from the same logits (leaf tensors: no gate GEMM in either).
    logits_TE = (x_TD @ w_ED.t()).detach()
    z_fused, z_plain = (logits_TE.clone().requires_grad_() for _ in range(2))

    def fused_math():
        r = R.fused_topk_routing(z_fused, K, score_function="sigmoid", renormalize=True,
                                 expert_bias_E=router.expert_bias, num_groups=G, group_topk=KG,
                                 scaling_factor=SCALE, aux_counts="plain_topk")
        aux = COEFF * R.switch_aux_loss_from_mean(r.stats.mean_E, r.stats.counts_E, T, K)
        ((r.probs_TK * g_TK).sum() + aux).backward()
        z_fused.grad = None
        return r.probs_TK, r.ids_TK, aux

    def plain_math():
        probs, ids, aux = unfused_routing(z_plain, router.expert_bias)
        ((probs * g_TK).sum() + aux).backward()
        z_plain.grad = None
        return probs, ids, aux

    _check_same_routing(*fused_math(), *plain_math())

    times = interleave({"ours": ours, "ours_torch_path": ours_torch_path, "unfused": unfused,
                        "fused_math": fused_math, "plain_math": plain_math}, repeats=7)
    ms = {k: v * 1e3 for k, v in times.items()}
    name = "router fwd+bwd T4096 E256 K8 groups8/4 sigmoid+bias"
    report.row(name, "whole router: fused vs unfused", times["unfused"] / times["ours"],
               note=f"ours {ms['ours']:.1f} ms, unfused {ms['unfused']:.1f} ms (gate GEMM in both)")
    report.row(name, "whole router: fused vs fused=false", times["ours_torch_path"] / times["ours"],
               note=f"fused=false {ms['ours_torch_path']:.1f} ms")
    report.row(name, "routing math: fused kernel vs plain torch",
               times["plain_math"] / times["fused_math"], target=3.0,
               note=f"kernel {ms['fused_math']:.2f} ms, torch {ms['plain_math']:.2f} ms (no GEMM)")
    print(f"\nrouter fwd+bwd: ours {ms['ours']:.1f} ms, fused=false {ms['ours_torch_path']:.1f} ms, "
          f"unfused {ms['unfused']:.1f} ms; routing math: kernel {ms['fused_math']:.2f} ms, "
          f"plain torch {ms['plain_math']:.2f} ms")
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(ours, rounds=2, iterations=1)
