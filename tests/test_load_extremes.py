"""Load extremes in every dispatcher at EP1, EP2 and EP4: every token to one expert, experts that
never receive a token, 256 experts (tiny D), and an MoE layer of 256 experts with the real router.

Reference: :func:`reference_moe` below, one process, no dispatcher: each (token, choice) row
goes through its expert via moeplug.testing.reference's dense expert MLP and the rows are summed
back per token. Every EP rank computes it on all ranks' tokens and compares its own slice:
outputs, grads of its tokens and probs, grads of its experts' weights. Tokens per rank are
uneven and one rank has none.

Legend: T tokens (all ranks), D hidden, F expert ffn hidden, E experts, K top-k, L local experts.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.testing.distributed import run_distributed

DISPATCHERS = ("alltoall", "allgather", "direct_write")
D, F = 8, 4
TOL = 1e-5
SIZES = [6, 0, 9, 4]  # tokens per rank (first W of them)

# name -> (E, K, ids_TK builder from (T, E, K, generator))
CASES = {
    # every token to the last expert: at EP>1 only the last rank receives rows
    "all_to_last_expert": (8, 1, lambda T, E, K, g: torch.full((T, 1), E - 1)),
    # every token to expert 0 and expert 3: six experts never receive a token
    "two_hot_experts": (8, 2, lambda T, E, K, g: torch.tensor([[0, 3]] * T)),
    "e256_random": (256, 2, lambda T, E, K, g: torch.stack(
        [torch.randperm(E, generator=g)[:K] for _ in range(T)])),
    "e256_one_expert": (256, 1, lambda T, E, K, g: torch.full((T, 1), 17)),
}


def _cfg(E: int, K: int):
    from moeplug.testing._common import tiny_model_config
    return tiny_model_config(num_experts=E, top_k=K, hidden_size=D, ffn_hidden_size=F)


def reference_moe(x_TD, probs_TK, ids_TK, experts) -> torch.Tensor:
    """y_t = sum_k expert_{ids[t,k]}(x_t) * probs[t,k], through the dense reference MLP."""
    from moeplug.testing.reference import reference_expert_mlp
    T, K = ids_TK.shape
    E = experts.gate_up_proj.shape[0]
    order_S = torch.argsort(ids_TK.reshape(-1), stable=True)  # expert-major rows
    token_S = torch.arange(T).repeat_interleave(K)[order_S]
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    y_S = reference_expert_mlp(x_TD[token_S], probs_TK.reshape(-1)[order_S], counts_E,
                               experts.gate_up_proj, experts.down_proj)
    return torch.zeros_like(x_TD).index_add(0, token_S, y_S)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    from moeplug.testing.dispatcher_parallel import max_abs_err
    return max_abs_err(a, b)


def _extreme_checks(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from moeplug.testing.dispatcher_parallel import expert_grad_errors, run_with_experts
    from moeplug.moe import MoELayer
    from moeplug.parallel.experts import local_expert_ids
    from moeplug.parallel.sharding import load_expert_shard
    from moeplug.plugin_host import PluginHost

    group = dist.group.WORLD if world > 1 else None  # EP1: the one-process path
    host = PluginHost.load()
    sizes = SIZES[:world]
    T, lo = sum(sizes), sum(sizes[:rank])
    hi = lo + sizes[rank]
    errors: dict[str, float] = {}
    for case, (E, K, make_ids) in CASES.items():
        cfg = _cfg(E, K)
        gen = torch.Generator().manual_seed(7)
        mine = local_expert_ids(E, world, rank)
        x_TD, w_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        ids_TK, probs_TK = make_ids(T, E, K, gen), torch.rand(T, K, generator=gen)
        torch.manual_seed(0)
        experts_ref = host.create("experts", "grouped", {}, cfg, E)
        xr, pr = x_TD.clone().requires_grad_(), probs_TK.clone().requires_grad_()
        y_ref = reference_moe(xr, pr, ids_TK, experts_ref)
        (y_ref * w_TD).sum().backward()
        for name in DISPATCHERS:
            disp = host.create("dispatcher", name, {}, cfg, group)
            experts = host.create("experts", "grouped", {}, cfg, disp.num_local_experts)
            load_expert_shard(experts, experts_ref.state_dict(), rank, world)
            d, y, x_grad, p_grad = run_with_experts(disp, experts, x_TD[lo:hi], probs_TK[lo:hi],
                                                    ids_TK[lo:hi], w_TD[lo:hi])
            key = f"{case}/{name}"
            want_counts = torch.bincount(ids_TK.reshape(-1), minlength=E)[mine.start:mine.stop]
            errors[f"{key}/counts_L"] = float(not torch.equal(d.counts_L, want_counts))
            errors[f"{key}/output"] = _err(y, y_ref[lo:hi])
            errors[f"{key}/input_grad"] = _err(x_grad, xr.grad[lo:hi])
            errors[f"{key}/probs_grad"] = _err(p_grad, pr.grad[lo:hi])
            errors.update(expert_grad_errors(experts, experts_ref, mine, key))

    # A whole MoE layer of 256 experts with the real top-k router, against the same layer in one
    # process on every rank's tokens (most experts get no token, a few get several).
    cfg = _cfg(256, 2)
    gen = torch.Generator().manual_seed(8)
    x_TD, w_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)

    def layer(name: str, g):
        disp = host.create("dispatcher", name, {}, cfg, g)
        return MoELayer(host.create("router", "topk", {}, cfg), disp,
                        host.create("experts", "grouped", {}, cfg, disp.num_local_experts))
    torch.manual_seed(0)
    ref = layer("alltoall", None)
    xr = x_TD.clone().requires_grad_()
    y_ref, _, _ = ref(xr)
    (y_ref * w_TD).sum().backward()
    for name in DISPATCHERS:
        moe = layer(name, group)
        load_expert_shard(moe, ref.state_dict(), rank, world)
        x = x_TD[lo:hi].clone().requires_grad_()
        y, _, _ = moe(x)
        (y * w_TD[lo:hi]).sum().backward()
        router_grad = moe.router.weight.grad.clone()
        if group is not None:
            dist.all_reduce(router_grad)
        errors[f"layer256/{name}/output"] = _err(y, y_ref[lo:hi])
        errors[f"layer256/{name}/input_grad"] = _err(x.grad, xr.grad[lo:hi])
        errors[f"layer256/{name}/router_grad"] = _err(router_grad, ref.router.weight.grad)
    return errors


@pytest.mark.parametrize("world", [1, 2, 4])
def test_load_extremes_match_the_one_process_reference(world):
    results = run_distributed(_extreme_checks, world, timeout=300)
    bad = {f"rank {r}: {k}": v for r, errs in enumerate(results) for k, v in errs.items()
           if not v <= TOL}
    assert not bad, f"EP{world} load extremes differ from the reference (> {TOL}): {bad}"
    # every case ran for every dispatcher on every rank
    assert all(len(errs) == len(CASES) * len(DISPATCHERS) * 6 + 3 * len(DISPATCHERS)
               for errs in results)


def test_extreme_cases_are_extreme():
    # Guard the data: the cases must starve experts (and, at EP4, whole ranks) as they claim.
    gen = torch.Generator().manual_seed(0)
    T = sum(SIZES)
    used = {c: torch.bincount(make(T, E, K, gen).reshape(-1), minlength=E)
            for c, (E, K, make) in CASES.items()}
    assert used["all_to_last_expert"].tolist() == [0] * 7 + [T]
    assert (used["two_hot_experts"] == 0).sum() == 6
    assert (used["e256_one_expert"] > 0).sum() == 1 and len(used["e256_random"]) == 256
    assert (used["e256_random"] == 0).sum() > 200  # 38 choices over 256 experts
