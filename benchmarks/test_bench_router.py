"""The ``topk`` router alone (forward + backward) at a DeepSeek-V3-like shape, timed interleaved
with an unfused plain-torch implementation of the same math written out below.

Shape legend: T tokens, D hidden, E experts, K top-k, G expert groups.
Shape: T=4096, D=1024, E=256, K=8, G=8 groups with 4 kept, sigmoid scores + expert bias,
scaling 2.5, Switch aux loss with plain-top-k counts (Megatron's default).

Run: pytest -q benchmarks/test_bench_router.py -s   (about 30 s on 2 cores)
"""

from __future__ import annotations

import torch

from benchmarks.conftest import interleave
from moeplug.plugin_host import PluginHost
from moeplug.testing import tiny_model_config

T, D, E, K, G, KG = 4096, 1024, 256, 8, 8, 4
COEFF, SCALE = 1e-2, 2.5
OPTIONS = {"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": G,
           "group_topk": KG, "topk_scaling_factor": SCALE, "aux_loss_coeff": COEFF}


def unfused_router(x_TD, w_ED, bias_E):
    """Same math, written the straightforward way: dense [T, E] routing maps and masks, a loop
    over groups, one-hot counts (how Megatron's unfused path materialises the routing map)."""
    logits_TE = x_TD @ w_ED.t()
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
    assert torch.equal(out.ids_TK, ids)
    torch.testing.assert_close(out.probs_TK, probs)
    torch.testing.assert_close(out.aux_loss, aux)
    router.weight.grad = w_ED.grad = x_TD.grad = None

    times = interleave({"ours": ours, "unfused": unfused}, repeats=5)
    report.row("router fwd+bwd T4096 E256 K8 groups8/4 sigmoid+bias", "speedup vs unfused",
               times["unfused"] / times["ours"],
               note=f"ours {times['ours'] * 1e3:.1f} ms, unfused {times['unfused'] * 1e3:.1f} ms")
    print(f"\nrouter fwd+bwd: ours {times['ours'] * 1e3:.1f} ms, unfused "
          f"{times['unfused'] * 1e3:.1f} ms, ratio {times['unfused'] / times['ours']:.2f}x")
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(ours, rounds=2, iterations=1)
