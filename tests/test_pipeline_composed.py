"""Pipeline parallelism composed with TP (+SP), EP, CP, MTP and tied embeddings equals one process.

Proof standard (as tests/test_pipeline.py and tests/test_tensor_parallel.py): every rank builds
the single-process model from seed 0, builds its own pipeline chunks from a *different* seed
(build_stage_modules with the layout's ParallelGroups), loads its shard of the single-process
weights (load_parallel_shard: TP / EP slices by name; the last stage's embedding copy gets the
same weights), runs one pipelined step over M micro-batches (its DP share of DP x M; CP ranks
shard the sequences inside the schedule), then sync_gradients. The same rank also runs the
single-process reference: gradient accumulation of loss / (DP x M) over all micro-batches. It
compares, in fp32 within TOL (summation order of the collectives differs, nothing else):
  * the loss (lm + aux (+ MTP), averaged over DP) and, with MTP, the MTP loss;
  * every local gradient against the same shard (shard_state_dict) of the reference gradient;
  * the global grad norm (the last stage's embedding copy must be counted once).
The parent checks that the ranks' parameters cover every reference parameter, that aux losses
are active (so every stage's aux loss must reach the objective) and that expert counts cover
every routed token. Aux loss: Switch + per-sequence + z-loss, so TP/CP token-group reductions
are exercised too.

Layout names: ppN pipeline (vppN: N chunks per rank), tpN tensor parallel, sp sequence parallel,
epN expert parallel (folded: it may span TP or DP ranks), cpN context parallel.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.config import ParallelConfig
from moeplug.testing.distributed import run_distributed

V, MB, SEQ, NUM_MB = 64, 2, 8, 2
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32: same ops, only the collectives' summation order differs

# name -> (world size, ParallelConfig kwargs, model overrides[, ParallelConfig kwargs])
LAYOUTS = {
    "pp2_tp2": (4, dict(pp=2, tp=2), {}),
    "pp2_tp2_sp_tied": (4, dict(pp=2, tp=2, sequence_parallel=True),
                        {"tie_embeddings": True, "qk_norm": True}),
    "pp2_ep2_tp2_sp": (8, dict(pp=2, tp=2, ep=2, sequence_parallel=True), {}),
    "pp2_cp2": (4, dict(pp=2, cp=2), {}),
    # interleaved 1F1B: SP-sharded activations cross 3 stage boundaries per micro-batch
    "pp2_vpp2_tp2_sp": (4, dict(pp=2, tp=2, sequence_parallel=True), {}, {"vpp": 2}),
    "pp2_mtp2": (2, dict(pp=2), {"mtp_num_layers": 2}),
    "pp2_tied": (2, dict(pp=2), {"tie_embeddings": True}),
    # pp > 2: the embedding group {first, last} is a new process group, a middle stage between
    "pp4_tied_mtp": (4, dict(pp=4), {"tie_embeddings": True, "mtp_num_layers": 1}),
}


def _cfg(overrides: dict):
    from moeplug.config import config_from_dict
    model = {"hidden_size": 16, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
             "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
             "init_std": 0.1,
             "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8, "aux_loss_coeff": 0.05}}
    model.update(overrides)
    return config_from_dict({
        "model": model,
        "plugins": {"router_options": {"load_balancing_type": ["aux_loss", "seq_aux_loss"],
                                       "z_loss_coeff": 1e-2}},
        "train": {"seq_len": SEQ},
    })


def _microbatches(num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, V, (num, MB, SEQ + 1), generator=g)
    return [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(num)]


def _reference(cfg, host, microbatches):
    """One process, gradient accumulation over every DP x M micro-batch."""
    from moeplug.build import build_model
    torch.manual_seed(0)
    ref = build_model(cfg, host, V)
    loss = mtp = 0.0
    for tokens, targets in microbatches:
        out = ref(tokens, targets)
        (out.loss / len(microbatches)).backward()
        loss += out.loss.item() / len(microbatches)
        if out.mtp_loss is not None:
            mtp += out.mtp_loss.item() / len(microbatches)
    return ref, loss, mtp


def _rank(rank: int, world: int, name: str) -> dict:
    import torch.distributed as dist
    from torch import nn

    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.grad_sync import global_grad_norm, sync_gradients
    from moeplug.build import build_stage_modules
    from moeplug.parallel.schedules import forward_backward_pipeline
    from moeplug.parallel.sharding import load_parallel_shard, shard_state_dict
    from moeplug.plugin_host import PluginHost

    _, pkw, overrides, *pipe_kw = LAYOUTS[name]
    cfg, host = _cfg(overrides), PluginHost.load()
    groups = ParallelGroups.build(ParallelConfig(**pkw), world, rank)
    dp, dp_rank = groups.size("dp"), groups.rank_in("dp")
    mbs = _microbatches(dp * NUM_MB)
    ref, ref_loss, ref_mtp = _reference(cfg, host, mbs)
    ref_params = dict(ref.named_parameters())

    torch.manual_seed(1 + rank)  # other weights than the reference: the loader must do the work
    chunks = build_stage_modules(cfg, host, V, groups, ParallelConfig(**(pipe_kw or [{}])[0]))
    for chunk in chunks:
        load_parallel_shard(chunk, ref.state_dict(), groups)
    res = forward_backward_pipeline(chunks, mbs[dp_rank * NUM_MB:(dp_rank + 1) * NUM_MB], groups)
    model = nn.ModuleList(chunks)
    sync_gradients(model, groups)
    norm = global_grad_norm(model, groups).item()

    losses = torch.tensor([res.loss.item(), res.mtp_loss.item() if res.mtp_loss is not None
                           else 0.0], dtype=torch.float64)
    if groups.dp is not None:
        dist.all_reduce(losses, group=groups.dp)
    losses /= dp
    out = {"loss": (losses[0].item(), ref_loss), "mtp": (losses[1].item(), ref_mtp),
           "norm": (norm, torch.nn.utils.get_total_norm(
               [p.grad for p in ref.parameters()]).item()),
           "aux": res.aux_loss.item(), "grads": {}, "params": set(),
           "counts": [c.sum().item() for c in res.expert_counts]}
    for chunk in chunks:
        ref_grads = shard_state_dict(chunk, {k: p.grad for k, p in ref_params.items()}, groups)
        for k, p in chunk.named_parameters():
            out["params"].add(k)
            out["grads"][k] = (p.grad, ref_grads[k])
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composed_pipeline_equals_one_process(name):
    world, pkw, overrides, *_ = LAYOUTS[name]
    results = run_distributed(_rank, world, name, timeout=150)
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    expected = {k for k, _ in build_model(_cfg(overrides), PluginHost.load(), V).named_parameters()}
    assert set().union(*(r["params"] for r in results)) == expected
    for r, res in enumerate(results):
        assert res["aux"] > 0, "aux loss must be active so every stage's share is checked"
        for key in ("loss", "mtp", "norm"):
            got, want = res[key]
            torch.testing.assert_close(got, want, **TOL, msg=f"rank {r}: {key}")
        for k, (got, want) in res["grads"].items():
            assert got is not None, f"rank {r}: {k} got no gradient"
            torch.testing.assert_close(got, want, **TOL, msg=f"rank {r}: grad {k}")
    if overrides.get("mtp_num_layers"):
        assert results[0]["mtp"][1] > 0  # the MTP loss is really in the objective
    if overrides.get("tie_embeddings") or overrides.get("mtp_num_layers"):
        holders = [r for r, res in enumerate(results) if "embed.weight" in res["params"]]
        pp = pkw["pp"]
        assert len(holders) == 2 * world // pp  # first + last stage of every pipeline


def test_last_stage_embedding_copy_is_flagged_and_loaded():
    """Single process, chunks split by hand: the last stage holds the embedding (tied head /
    MTP) as a flagged copy, the first stage the original; an untied model without MTP shares
    nothing (the plain partition of tests/test_pipeline.py)."""
    from moeplug.build import build_model
    from moeplug.parallelize.pipeline import split_model
    from moeplug.plugin_host import PluginHost
    for overrides, shared in (({"tie_embeddings": True}, True), ({"mtp_num_layers": 1}, True),
                              ({}, False)):
        cfg = _cfg(overrides)
        torch.manual_seed(0)
        first = split_model(build_model(cfg, PluginHost.load(), V), ParallelConfig(), 2, 0)[0]
        torch.manual_seed(0)
        last = split_model(build_model(cfg, PluginHost.load(), V), ParallelConfig(), 2, 1)[0]
        assert hasattr(last, "embed") == shared
        assert not getattr(first.embed.weight, "pipeline_copy", False)
        if shared:
            assert last.embed.weight.pipeline_copy is True
            torch.testing.assert_close(last.embed.weight, first.embed.weight, rtol=0, atol=0)
        assert hasattr(last, "mtp") and not hasattr(first, "mtp")


def test_mtp_last_stage_needs_tokens():
    from moeplug.build import build_model
    from moeplug.parallelize.pipeline import split_model
    from moeplug.plugin_host import PluginHost
    cfg = _cfg({"mtp_num_layers": 1})
    last = split_model(build_model(cfg, PluginHost.load(), V), ParallelConfig(), 2, 1)[0]
    tokens, targets = _microbatches(1)[0]
    x_BSD = torch.zeros(MB, SEQ, 16)
    with pytest.raises(ValueError, match=r"mtp_num_layers = 1 needs the input tokens.*tokens_BS "
                       r"is None. Fix: pass the micro-batch's tokens"):
        last(x_BSD, targets)
    assert last(x_BSD, targets, tokens).mtp_loss is not None
