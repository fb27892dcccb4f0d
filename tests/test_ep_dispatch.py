"""Expert parallelism on real gloo ranks: the MoE layer (and its dispatch) at EP2 and EP4 equals a
single-process layer with the same weights run on the concatenation of every rank's tokens.

Every rank builds the single-process reference itself (same seed, tiny shapes: cheaper than
shipping tensors around) and compares its own slice: outputs, input grads, router grads (summed
over ranks: the router is replicated, each rank sees only its tokens) and its expert weight grads
against the matching slice of the reference grads. The loss is sum(y * w) with a fixed random w,
so every output element's grad differs. One spawn per world size runs every case; the children
return max-abs errors and the parent asserts, so a failure names the case and the check.

Legend: T tokens (all ranks), D hidden, E experts, L local experts, K top-k, W EP ranks.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.testing.distributed import run_distributed

E, K, D, F = 8, 2, 16, 8
DISPATCHERS = ("alltoall", "allgather", "direct_write")
TOL = 1e-5  # fp32; in practice the errors are 0 (same kernels, same row order)


def _tokens_per_rank(world: int) -> list[int]:
    # Uneven, and one rank with no tokens at all (it sends nothing, still receives rows).
    return [5, 0, 7, 3][:world]


def _make_layer(host, cfg, group, dispatcher: str):
    from moeplug.moe import MoELayer
    d = host.create("dispatcher", dispatcher, {}, cfg, group)
    return MoELayer(host.create("router", "topk", {}, cfg), d,
                    host.create("experts", "grouped", {}, cfg, d.num_local_experts))


def _routing_cases(T: int, L: int, world: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """ids_TK for every token of every rank, per named case."""
    def draw(allowed: list[int]) -> torch.Tensor:
        return torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=gen)[:K]]
                            for _ in range(T)])
    return {
        "random": draw(list(range(E))),
        # every token goes to the last rank's experts: the other ranks' experts get 0 rows
        "skewed_to_last_rank": draw(list(range(E - L, E))),
        # experts 1, 2, 4, 6, 7 never chosen; at EP4 rank 0 (experts 0, 1) holds one used expert
        "zero_token_experts": draw([0, 3, 5]),
    }


def _local_only_ids(sizes: list[int], L: int, gen: torch.Generator) -> torch.Tensor:
    """Each rank's tokens choose only that rank's experts: the all-to-all sends nothing across."""
    parts = [torch.stack([r * L + torch.randperm(L, generator=gen)[:K] for _ in range(n)])
             if n else torch.empty(0, K, dtype=torch.int64) for r, n in enumerate(sizes)]
    return torch.cat(parts)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    from moeplug.testing.dispatcher_parallel import max_abs_err
    return max_abs_err(a, b)


def _ep_checks(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from moeplug.interfaces import RouterOutput
    from moeplug.testing.dispatcher_parallel import expert_grad_errors, run_with_experts
    from moeplug.parallel.experts import local_expert_ids
    from moeplug.parallel.sharding import load_expert_shard
    from moeplug.plugin_host import PluginHost
    from moeplug.testing._common import tiny_model_config

    host = PluginHost.load()
    cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=D, ffn_hidden_size=F)
    L = E // world
    mine = local_expert_ids(E, world, rank)
    sizes = _tokens_per_rank(world)
    T, lo = sum(sizes), sum(sizes[:rank])
    hi = lo + sizes[rank]
    gen = torch.Generator().manual_seed(1234)
    x_TD, w_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    errors: dict[str, float] = {}

    # --- 1. whole MoE layer with the real router ---------------------------------------------
    torch.manual_seed(0)
    ref = _make_layer(host, cfg, None, "alltoall")
    xr = x_TD.clone().requires_grad_()
    y_ref, _, _ = ref(xr)
    (y_ref * w_TD).sum().backward()
    outputs = {}
    for name in DISPATCHERS:
        layer = _make_layer(host, cfg, dist.group.WORLD, name)
        load_expert_shard(layer, ref.state_dict(), rank, world)
        x = x_TD[lo:hi].clone().requires_grad_()
        y, _, counts_E = layer(x)
        (y * w_TD[lo:hi]).sum().backward()
        outputs[name] = y.detach()
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)
        errors[f"layer/{name}/output"] = _err(y, y_ref[lo:hi])
        errors[f"layer/{name}/input_grad"] = _err(x.grad, xr.grad[lo:hi])
        errors[f"layer/{name}/router_grad"] = _err(router_grad, ref.router.weight.grad)
        for pname in ("gate_up_proj", "down_proj"):
            full = getattr(ref.experts, pname).grad
            errors[f"layer/{name}/expert_grad/{pname}"] = _err(
                getattr(layer.experts, pname).grad, full[mine.start:mine.stop])
        errors[f"layer/{name}/local_experts"] = float(layer.experts.num_local_experts != L)
    errors["layer/alltoall_vs_allgather"] = _err(outputs["alltoall"], outputs["allgather"])

    # --- 2. dispatch + experts + combine with forced routings ----------------------------------
    torch.manual_seed(0)
    experts_ref = host.create("experts", "grouped", {}, cfg, E)
    ref_disp = host.create("dispatcher", "alltoall", {}, cfg, None)
    cases = _routing_cases(T, L, world, gen)
    cases["local_only"] = _local_only_ids(sizes, L, gen)
    for case, ids_TK in cases.items():
        probs_TK = torch.rand(T, K, generator=gen)
        pr, xr = probs_TK.clone().requires_grad_(), x_TD.clone().requires_grad_()
        d_ref = ref_disp.dispatch(xr, RouterOutput(pr, ids_TK, torch.zeros(())))
        y_ref = ref_disp.combine(experts_ref(d_ref.x_SD, d_ref.probs_S, d_ref.counts_L), d_ref.meta)
        (y_ref * w_TD).sum().backward()
        # rows of my experts in the reference layout (expert-major, token order inside)
        start = int(d_ref.counts_L[:mine.start].sum())
        stop = start + int(d_ref.counts_L[mine.start:mine.stop].sum())
        for name in DISPATCHERS:
            disp = host.create("dispatcher", name, {}, cfg, dist.group.WORLD)
            experts = host.create("experts", "grouped", {}, cfg, L)
            load_expert_shard(experts, experts_ref.state_dict(), rank, world)
            d, y, x_grad, p_grad = run_with_experts(disp, experts, x_TD[lo:hi], probs_TK[lo:hi],
                                                    ids_TK[lo:hi], w_TD[lo:hi])
            key = f"{case}/{name}"
            errors[f"{key}/counts_L"] = float(not torch.equal(
                d.counts_L, d_ref.counts_L[mine.start:mine.stop]))
            errors[f"{key}/dispatched_rows"] = _err(d.x_SD, d_ref.x_SD[start:stop])
            errors[f"{key}/dispatched_probs"] = _err(d.probs_S, d_ref.probs_S[start:stop])
            errors[f"{key}/output"] = _err(y, y_ref[lo:hi])
            errors[f"{key}/input_grad"] = _err(x_grad, xr.grad[lo:hi])
            errors[f"{key}/probs_grad"] = _err(p_grad, pr.grad[lo:hi])
            errors.update(expert_grad_errors(experts, experts_ref, mine, key))
        experts_ref.zero_grad(set_to_none=True)

    # --- 3. error path: expert counts that the EP group cannot split ---------------------------
    from moeplug_plugins.dispatchers._ep_comm import exchange_counts
    try:
        exchange_counts(torch.zeros(world + 1, dtype=torch.int64), dist.group.WORLD)
        errors["error/exchange_counts_raised"] = 1.0
    except ValueError as e:
        msg = str(e)
        errors["error/exchange_counts_message"] = float(not (
            f"counts_E has {world + 1} experts" in msg and f"EP size {world}" in msg
            and "Fix: choose num_experts a multiple" in msg))
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_and_dispatch_match_single_process(world):
    results = run_distributed(_ep_checks, world, timeout=180)
    bad = {f"rank {r}: {k}": v for r, errs in enumerate(results) for k, v in errs.items()
           if not v <= TOL}
    assert not bad, f"EP{world} differs from one process (max abs error > {TOL}): {bad}"
    # the cases really ran on every rank, for both dispatchers
    assert all(len(errs) == len(results[0]) > 60 for errs in results)


def test_skewed_case_really_starves_the_other_ranks():
    # Guard the test data: "skewed" must leave every rank but the last without rows, and
    # "zero_token_experts" must leave experts unused, or those cases test nothing special.
    gen = torch.Generator().manual_seed(0)
    for world in (2, 4):
        L = E // world
        cases = _routing_cases(12, L, world, gen)
        used = torch.bincount(cases["skewed_to_last_rank"].reshape(-1), minlength=E)
        assert used[: E - L].sum() == 0 and used[E - L:].sum() == 12 * K
        assert (torch.bincount(cases["zero_token_experts"].reshape(-1), minlength=E) == 0).sum() == 5
        local = _local_only_ids(_tokens_per_rank(world), L, gen)
        owner = local // L
        rank_of_token = torch.repeat_interleave(torch.arange(world),
                                                torch.tensor(_tokens_per_rank(world)))
        assert torch.equal(owner, rank_of_token.unsqueeze(1).expand_as(owner))


# --- single process: chunk sorting against a plain loop, and the shard helper's errors ---------

def test_chunk_sort_orders_arrival_chunks_expert_major_and_unsort_inverts_it():
    from moeplug_plugins.dispatchers._ep_comm import (A2APlan, _MoveChunks, gather_index,
                                                      sort_by_local_expert,
                                                      unsort_by_local_expert)
    gen = torch.Generator().manual_seed(3)
    for W, L in ((1, 3), (2, 2), (4, 3)):
        counts_WL = torch.randint(0, 4, (W, L), generator=gen)
        counts_WL[0] = 0  # a source rank that sent nothing
        # rows tagged (w, l, i) in arrival order: (w, l)-major
        tags = [(w, l, i) for w in range(W) for l in range(L) for i in range(int(counts_WL[w, l]))]
        want = sorted(tags, key=lambda t: (t[1], t[0], t[2]))  # expert-major, then source rank
        rows = torch.tensor([[w, l, i] for w, l, i in tags], dtype=torch.float32).reshape(-1, 3)
        rows.requires_grad_(True)
        plan = A2APlan(send_W=[], recv_W=[], counts_WL=counts_WL)
        sorted_rows = sort_by_local_expert(rows, plan)
        assert [tuple(int(v) for v in r) for r in sorted_rows.tolist()] == want
        assert torch.equal(unsort_by_local_expert(sorted_rows, plan), rows)
        # backward is the inverse move: the gradient of row i lands where row i came from
        g = torch.randn(len(tags), 3, generator=gen)
        sorted_rows.backward(g)
        assert torch.equal(rows.grad, unsort_by_local_expert(g, plan))
        assert torch.equal(plan.counts_L, counts_WL.sum(0))
        # the GPU's path: one index_select with the index the same kernel gives
        assert [tags[i] for i in gather_index(counts_WL, True).tolist()] == want
        for forward in (True, False):
            assert torch.equal(rows.detach().index_select(0, gather_index(counts_WL, forward)),
                               _MoveChunks.apply(rows.detach(), counts_WL, forward))


def test_local_expert_ids_and_its_errors():
    from moeplug.parallel.experts import local_expert_ids
    assert list(local_expert_ids(8, 4, 2)) == [4, 5]
    with pytest.raises(ValueError, match=r"num_experts = 6 is not divisible by the EP size 4.*"
                                         r"Fix: choose num_experts a multiple of 4"):
        local_expert_ids(6, 4, 0)
    with pytest.raises(ValueError, match=r"ep_rank = 2 is outside the EP group of size 2.*Fix"):
        local_expert_ids(8, 2, 2)


def test_load_expert_shard_copies_slices_and_names_every_mismatch():
    from moeplug.parallel.experts import expert_param_names
    from moeplug.parallel.sharding import load_expert_shard
    from moeplug.plugin_host import PluginHost
    from moeplug.testing._common import tiny_model_config

    host = PluginHost.load()
    cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=D, ffn_hidden_size=F)
    full = _make_layer(host, cfg, None, "alltoall")
    shard = _make_layer(host, cfg, None, "alltoall")
    # a 2-expert shard: what EP rank 3 of 4 holds (experts 6, 7)
    shard.experts = host.create("experts", "grouped", {}, cfg, 2)
    assert expert_param_names(shard) == {"experts.gate_up_proj", "experts.down_proj"}
    load_expert_shard(shard, full.state_dict(), ep_rank=3, ep_size=4)
    assert torch.equal(shard.experts.down_proj, full.experts.down_proj[6:8])
    assert torch.equal(shard.router.weight, full.router.weight)

    with pytest.raises(ValueError, match=r"'experts.gate_up_proj' holds 2 local experts here but "
                                         r"the source has 8 experts / EP 2 = 4.*Fix: build"):
        load_expert_shard(shard, full.state_dict(), ep_rank=0, ep_size=2)
    state = dict(full.state_dict())
    state["router.weight"] = state["router.weight"][:, :3]
    with pytest.raises(ValueError, match=r"'router.weight' has shape \(8, 16\) here but \(8, 3\) "
                                         r"in the source.*Fix: build both models"):
        load_expert_shard(shard, state, ep_rank=3, ep_size=4)
    del state["router.weight"]
    with pytest.raises(KeyError, match=r"parameter 'router.weight' is missing.*Fix: pass"):
        load_expert_shard(shard, state, ep_rank=3, ep_size=4)
