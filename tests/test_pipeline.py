"""Pipeline parallelism: layer partition, schedule order, and pipelined steps equal to one process.

Proof standard for every layout (PP2 1F1B, PP2 x 2 virtual stages, PP2 uneven 1+2 layers, PP4,
DP2 x PP2): each rank builds its model chunks from a *different* seed, loads its shard of the
single-process model's state_dict (load_pipeline_shard), runs one pipelined step over M
micro-batches and returns its losses, gradients and parameters by name. The parent runs one
process doing gradient accumulation (loss / M per micro-batch) over the same micro-batches (all
DP x M of them with data parallelism) and checks: every parameter lives on exactly one rank of
each DP replica, and the loss (lm + aux; aux is nonzero so every stage's aux loss must be in the
objective) and every gradient match within fp32 tolerance (TOL below). The PP2 1F1B layout also
runs 3 AdamW steps with sync_gradients + the global-norm clip (which must sum the stages'
squared norms) and compares the loss sequence, the norms and the final parameters.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.config import ConfigError, ParallelConfig
from moeplug.testing.distributed import run_distributed

V, MB, SEQ = 64, 2, 8
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: same ops, only gradient summation order may differ
MAX_NORM = 0.05                   # below the tiny model's grad norm: the clip always acts


def _cfg(num_layers: int = 4, aux: float = 0.05, tie: bool = False):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 16, "num_layers": num_layers, "num_heads": 2, "num_kv_heads": 1,
                  "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "init_std": 0.1, "tie_embeddings": tie,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8,
                          "aux_loss_coeff": aux}},
        "train": {"seq_len": SEQ},
    })


def _microbatches(num: int, step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, V, (num, MB, SEQ + 1), generator=g)
    return [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(num)]


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny reference runs ~10x faster on one thread than on two busy shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(cfg, microbatches):
    """One process, gradient accumulation: backward of (loss_m / M) for each micro-batch."""
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost

    torch.manual_seed(0)
    ref = build_model(cfg, PluginHost.load(), V)
    total = 0.0
    for tokens, targets in microbatches:
        out = ref(tokens, targets)
        (out.loss / len(microbatches)).backward()
        total += out.loss.item() / len(microbatches)
    return ref, total


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


# --------------------------------------------------------------------------------------------
# Schedule order: pure functions, checked against hand-written cases and a dependency simulator
# --------------------------------------------------------------------------------------------

def _ops(ops) -> str:
    return " ".join(str(o) for o in ops)


def test_1f1b_order_hand_written():
    from moeplug.parallel.schedules import one_f_one_b
    # PP2, M=3: rank 0 warms up with 1 forward, rank 1 (last) alternates from the start.
    assert _ops(one_f_one_b(2, 0, 3)) == "F0 F1 B0 F2 B1 B2"
    assert _ops(one_f_one_b(2, 1, 3)) == "F0 B0 F1 B1 F2 B2"
    # PP4, M=2: warm-up is capped at M (rank 0 would want 3).
    assert _ops(one_f_one_b(4, 0, 2)) == "F0 F1 B0 B1"
    assert _ops(one_f_one_b(4, 2, 2)) == "F0 F1 B0 B1"
    assert _ops(one_f_one_b(4, 3, 2)) == "F0 B0 F1 B1"
    # PP4, M=5, rank 1: 2 warm-up forwards, 3 steady pairs, 2 cool-down backwards.
    assert _ops(one_f_one_b(4, 1, 5)) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"


def test_interleaved_order_hand_written():
    from moeplug.parallel.schedules import interleaved_1f1b
    # PP2, VPP2, M=4. Forward iteration k: chunk (k mod 4) // 2, micro-batch (k // 4)*2 + k mod 2;
    # backwards reverse the chunks. Warm-up: rank 0 2*(2-0-1) + (2-1)*2 = 4, rank 1 2.
    assert _ops(interleaved_1f1b(2, 0, 4, 2)) == (
        "F0 F1 F0c1 F1c1 "                            # warm-up
        "F2 B0c1 F3 B1c1 F2c1 B0 F3c1 B1 "            # steady 1F1B
        "B2c1 B3c1 B2 B3")                            # cool-down
    assert _ops(interleaved_1f1b(2, 1, 4, 2)) == (
        "F0 F1 "
        "F0c1 B0c1 F1c1 B1c1 F2 B0 F3 B1 F2c1 B2c1 F3c1 B3c1 "
        "B2 B3")
    # M == PP: all forwards, then all backwards.
    assert _ops(interleaved_1f1b(2, 1, 2, 2)) == "F0 F1 F0c1 F1c1 B0c1 B1c1 B0 B1"


def _simulate(pp: int, vpp: int, num_mb: int) -> dict[int, int]:
    """Run every rank's op list against the data dependencies (forward of virtual stage v needs
    v-1's forward, backward of v needs v+1's backward and its own forward), one op per rank per
    tick when ready. Fails on a deadlock; returns each rank's peak number of live activations."""
    from moeplug.parallel.schedules import pipeline_schedule

    ops = {r: pipeline_schedule(pp, r, num_mb, vpp) for r in range(pp)}
    pos, done, live, peak = {r: 0 for r in range(pp)}, set(), {r: 0 for r in range(pp)}, {}
    last = pp * vpp - 1
    while any(pos[r] < len(ops[r]) for r in range(pp)):
        ready = []
        for r in range(pp):
            if pos[r] == len(ops[r]):
                continue
            op = ops[r][pos[r]]
            v = op.chunk * pp + r
            need = ([("F", v - 1, op.microbatch)] if op.kind == "F" and v > 0 else []) + (
                [("F", v, op.microbatch)] + ([("B", v + 1, op.microbatch)] if v < last else [])
                if op.kind == "B" else [])
            if all(n in done for n in need):
                ready.append((r, (op.kind, v, op.microbatch)))
        assert ready, f"deadlock at positions {pos} (pp={pp}, vpp={vpp}, M={num_mb})"
        for r, key in ready:
            assert key not in done
            done.add(key)
            pos[r] += 1
            live[r] += 1 if key[0] == "F" else -1
            peak[r] = max(peak.get(r, 0), live[r])
    assert len(done) == 2 * pp * vpp * num_mb  # every forward and backward exactly once
    return peak


@pytest.mark.parametrize("pp,vpp,num_mb", [(2, 1, 1), (2, 1, 5), (4, 1, 3), (4, 1, 8),
                                           (2, 2, 2), (2, 2, 6), (4, 2, 8), (3, 3, 9)])
def test_schedules_respect_dependencies_and_bound_memory(pp, vpp, num_mb):
    peak = _simulate(pp, vpp, num_mb)
    if vpp == 1:  # 1F1B's point: rank r holds at most P - r micro-batches' activations
        assert all(peak[r] <= min(pp - r, num_mb) for r in range(pp)), peak


def test_forward_only_schedule_is_the_forward_order():
    from moeplug.parallel.schedules import pipeline_schedule
    assert _ops(pipeline_schedule(2, 0, 4, 2, forward_only=True)) == "F0 F1 F0c1 F1c1 F2 F3 F2c1 F3c1"
    assert _ops(pipeline_schedule(1, 0, 3)) == "F0 B0 F1 B1 F2 B2"  # no pipeline: accumulation


def test_schedule_errors_name_the_value_and_fix():
    from moeplug.config import ConfigError
    from moeplug.parallel.schedules import pipeline_schedule
    with pytest.raises(ConfigError, match=r"num_microbatches = 3 \(train.grad_accum_steps\) is "
                       r"not a multiple of PP = 2.*Fix: set train.grad_accum_steps to a multiple of 2"):
        pipeline_schedule(2, 0, 3, vpp=2)
    with pytest.raises(ConfigError, match=r"vpp = 2 model chunks need pp > 1.*Fix"):
        pipeline_schedule(1, 0, 2, vpp=2)
    with pytest.raises(ConfigError, match=r"rank = 2 is outside \[0, 2\).*Fix"):
        pipeline_schedule(2, 2, 2)
    with pytest.raises(ConfigError, match=r"num_microbatches = 0 must be a positive.*Fix"):
        pipeline_schedule(2, 0, 0)


# --------------------------------------------------------------------------------------------
# Partition
# --------------------------------------------------------------------------------------------

def test_partition_even_interleaved_and_uneven():
    from moeplug.config import ParallelConfig as P

    def layers(pipe, n, pp):
        return [[list(r) for r in ranks] for ranks in pipe.chunk_layers(n, pp)]

    assert layers(P(), 4, 2) == [[[0, 1]], [[2, 3]]]
    assert layers(P(), 5, 1) == [[[0, 1, 2, 3, 4]]]
    # chunk c of rank r holds layer block c*PP + r
    assert layers(P(vpp=2), 8, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert layers(P(num_layers_in_first_stage=1), 3, 2) == [[[0]], [[1, 2]]]
    assert layers(P(num_layers_in_last_stage=1), 7, 4) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6]]]
    assert layers(P(num_layers_in_first_stage=0, num_layers_in_last_stage=2), 6, 3) == [
        [[]], [[0, 1, 2, 3]], [[4, 5]]]
    # Megatron's uneven + interleaved offsets: first 2, last 2, middle 4 per rank, VPP 2.
    # Per-rank counts 2, 8, 2 -> chunk sizes 1, 4, 1 -> v0 [0], v1 [1..4], v2 [5], v3 [6], ...
    # (rank 1, chunk 1 starts at 1*6 + 1 = 7, Megatron's get_transformer_layer_offset).
    got = layers(P(vpp=2, num_layers_in_first_stage=2, num_layers_in_last_stage=2), 12, 3)
    assert got == [[[0], [6]], [[1, 2, 3, 4], [7, 8, 9, 10]], [[5], [11]]]


@pytest.mark.parametrize("pipe_kwargs,num_layers,pp,match", [
    ({"vpp": 2}, 6, 2, r"ParallelConfig.vpp = 2: num_layers 6 is not divisible by PP·VPP = "
                       r"2·2 = 4. Fix: choose pp and vpp"),
    ({}, 3, 2, r"num_layers 3 is not divisible by PP·VPP = 2·1 = 2.*num_layers_in_first_stage"),
    ({"num_layers_in_first_stage": 1}, 4, 3, r"num_layers_in_first_stage = 1: .*other 2 stage\(s\) "
                                             r"get 3 of num_layers 4.*Fix: choose first/last"),
    ({"num_layers_in_first_stage": 1, "num_layers_in_last_stage": 1}, 3, 2,
     r"Fix: make num_layers_in_first_stage \+ num_layers_in_last_stage = 3"),
    ({"num_layers_in_first_stage": 5}, 4, 2, r"num_layers_in_first_stage = 5: .*get -1"),
    ({"vpp": 2, "num_layers_in_first_stage": 1}, 5, 2,
     r"ParallelConfig.vpp = 2: pipeline rank 0 holds 1 layers .*Fix: choose stage layer counts"),
    ({"vpp": 2}, 4, 1, r"ParallelConfig.vpp = 2: virtual stages need pipeline parallelism.*Fix"),
    ({"num_layers_in_last_stage": 1}, 4, 1,
     r"ParallelConfig.num_layers_in_last_stage = 1: uneven stages need pp > 1. Fix: unset"),
])
def test_partition_errors_name_field_value_and_fix(pipe_kwargs, num_layers, pp, match):
    from moeplug.config import ConfigError, ParallelConfig
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**pipe_kwargs).chunk_layers(num_layers, pp)


@pytest.mark.parametrize("kwargs,match", [
    ({"vpp": 0}, r"ParallelConfig.vpp = 0: must be a positive integer. Fix"),
    ({"num_layers_in_first_stage": -1},
     r"ParallelConfig.num_layers_in_first_stage = -1: must be null or an integer >= 0. Fix"),
    ({"num_layers_in_last_stage": 1.5}, r"num_layers_in_last_stage = 1.5: .*Fix"),
])
def test_pipeline_config_field_errors(kwargs, match):
    from moeplug.config import ConfigError, ParallelConfig
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# Single process: chunks are the model under its own names; the executor is grad accumulation
# --------------------------------------------------------------------------------------------

def _single_process_chunks(cfg, pipe, pp, rank):
    from moeplug.build import build_model
    from moeplug.parallelize.pipeline import split_model
    from moeplug.plugin_host import PluginHost
    torch.manual_seed(0)
    return split_model(build_model(cfg, PluginHost.load(), V), pipe, pp, rank)


def test_chunk_state_dicts_partition_the_full_model():
    from moeplug.parallelize.pipeline import pipeline_state_dict
    cfg = _cfg(num_layers=4)
    ref, _ = _reference(cfg, [])
    full = ref.state_dict()
    pipe = ParallelConfig(vpp=2)
    shards = [pipeline_state_dict(_single_process_chunks(cfg, pipe, 2, r)) for r in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(full)
    assert "embed.weight" in shards[0] and "head.weight" in shards[1]
    assert any(k.startswith("blocks.2.") for k in shards[0])  # chunk 1 of rank 0 = layer 2
    for shard in shards:
        for k, t in shard.items():
            assert torch.equal(t, full[k]), k


def test_single_process_pipeline_step_is_gradient_accumulation():
    from moeplug.parallel import ParallelGroups
    from moeplug.parallel.schedules import forward_backward_pipeline

    cfg = _cfg(num_layers=2)
    mbs = _microbatches(3)
    ref, ref_loss = _reference(cfg, mbs)
    groups = ParallelGroups.build(ParallelConfig(), 1, 0)
    chunks = _single_process_chunks(cfg, ParallelConfig(), 1, 0)
    result = forward_backward_pipeline(chunks, mbs, groups)
    assert result.aux_loss > 0
    torch.testing.assert_close(result.loss.item(), ref_loss, **TOL)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    for chunk in chunks:
        for k, p in chunk.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[k], **TOL, msg=k)
    # forward_only: same loss, no gradients touched
    before = {k: p.grad.clone() for c in chunks for k, p in c.named_parameters()}
    evaluated = forward_backward_pipeline(chunks, mbs, groups, forward_only=True)
    torch.testing.assert_close(evaluated.loss, result.loss, **TOL)
    assert all(torch.equal(p.grad, before[k]) for c in chunks for k, p in c.named_parameters())


def test_load_pipeline_shard_errors():
    from moeplug.parallelize.pipeline import load_pipeline_shard
    cfg = _cfg(num_layers=2)
    chunks = _single_process_chunks(cfg, ParallelConfig(), 2, 1)
    full = _reference(cfg, [])[0].state_dict()
    load_pipeline_shard(chunks, full)
    del full["head.weight"]
    with pytest.raises(KeyError, match=r"lacks 1 key\(s\).*head.weight.*Fix: pass the full"):
        load_pipeline_shard(chunks, full)
    full["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"head.weight has shape \(3, 3\) in the state_dict but "
                       r"\(64, 16\) in the chunk. Fix"):
        load_pipeline_shard(chunks, full)


# --------------------------------------------------------------------------------------------
# Real pipelines on gloo ranks
# --------------------------------------------------------------------------------------------

def _pipeline_rank(rank: int, world: int, pp: int, pipe_kwargs: dict, num_layers: int,
                   num_mb: int, adam_steps: int) -> dict:
    from torch import nn

    from moeplug.build import build_model
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.grad_sync import clip_grad_norm, sync_gradients
    from moeplug.build import build_stage_modules
    from moeplug.parallelize.pipeline import load_pipeline_shard
    from moeplug.parallel.schedules import forward_backward_pipeline
    from moeplug.plugin_host import PluginHost

    cfg, host = _cfg(num_layers), PluginHost.load()
    groups = ParallelGroups.build(ParallelConfig(pp=pp), world, rank)
    torch.manual_seed(0)
    full = build_model(cfg, host, V).state_dict()
    torch.manual_seed(1 + rank)  # different weights, so the shard loader has to do the work
    chunks = build_stage_modules(cfg, host, V, groups, ParallelConfig(**pipe_kwargs))
    load_pipeline_shard(chunks, full)
    model = nn.ModuleList(chunks)
    out: dict = {"losses": [], "norms": []}
    out["dp_rank"] = dp_rank = groups.rank_in("dp")
    if adam_steps == 0:
        # Data parallel: DP rank d runs micro-batches [d*M, (d+1)*M) of one list of DP*M.
        mbs = _microbatches(num_mb * groups.size("dp"))[dp_rank * num_mb:(dp_rank + 1) * num_mb]
        res = forward_backward_pipeline(chunks, mbs, groups)
        sync_gradients(model, groups)  # averages over DP; a no-op without it
        out["losses"].append((res.loss.item(), res.aux_loss.item()))
        out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()
                        if p.grad is not None}
    else:
        opt = _adamw(model.parameters())
        for step in range(adam_steps):
            res = forward_backward_pipeline(chunks, _microbatches(num_mb, step), groups)
            sync_gradients(model, groups)
            out["norms"].append(clip_grad_norm(model, groups, MAX_NORM).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["losses"].append((res.loss.item(), res.aux_loss.item()))
    # Names as in the full model: ModuleList prefixes "<chunk>." which we strip.
    strip = lambda k: k.split(".", 1)[1]  # noqa: E731
    out["grads"] = {strip(k): v for k, v in out.get("grads", {}).items()}
    out["params"] = {strip(k): p.detach().clone() for k, p in model.named_parameters()}
    out["counts"] = [c.sum().item() for c in res.expert_counts]
    return out


def _check_against_reference(results: list[dict], num_layers: int, num_mb: int) -> None:
    """One process accumulates over all DP x M micro-batches; the pipeline's loss is the mean
    of its DP replicas' losses, and every replica's grads (after sync) equal the reference."""
    cfg = _cfg(num_layers)
    dp = 1 + max(res["dp_rank"] for res in results)
    ref, ref_loss = _reference(cfg, _microbatches(num_mb * dp))
    ref_params = dict(ref.named_parameters())
    owners: dict[str, int] = {}
    for r, res in enumerate(results):
        if res["dp_rank"]:
            continue
        for k in res["params"]:
            assert k not in owners, f"{k} is on ranks {owners[k]} and {r}"
            owners[k] = r
    assert set(owners) == set(ref_params), set(owners) ^ set(ref_params)
    for r, res in enumerate(results):
        assert res["losses"][0][1] > 0, "aux loss must be in the objective for the test to cover it"
        replicas = [x["losses"][0][0] for x in results if x["params"].keys() == res["params"].keys()]
        assert len(replicas) == dp
        torch.testing.assert_close(sum(replicas) / dp, ref_loss, **TOL, msg=f"rank {r} loss")
        for k, g in res["grads"].items():
            torch.testing.assert_close(g, ref_params[k].grad, **TOL, msg=f"rank {r}: grad {k}")
        assert set(res["grads"]) == set(res["params"])  # every local parameter got a gradient
        # each MoE layer routed every token of every micro-batch K times
        assert all(c == num_mb * MB * SEQ * 2 for c in res["counts"])


@pytest.mark.parametrize("name,world,pp,pipe_kwargs,num_layers,num_mb", [
    ("pp2_vpp2", 2, 2, {"vpp": 2}, 4, 4),
    ("pp2_uneven_1_2", 2, 2, {"num_layers_in_first_stage": 1}, 3, 3),
    ("pp4", 4, 4, {}, 4, 5),
    ("dp2_pp2", 4, 2, {}, 4, 2),  # composes with sync_gradients over the DP group
])
def test_pipeline_step_equals_gradient_accumulation(name, world, pp, pipe_kwargs, num_layers, num_mb):
    results = run_distributed(_pipeline_rank, world, pp, pipe_kwargs, num_layers, num_mb, 0,
                              timeout=120)
    _check_against_reference(results, num_layers, num_mb)


def test_pp2_1f1b_three_adamw_steps_match_one_process():
    num_layers, num_mb, steps = 4, 3, 3
    results = run_distributed(_pipeline_rank, 2, 2, {}, num_layers, num_mb, steps, timeout=120)
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost

    torch.manual_seed(0)
    ref = build_model(_cfg(num_layers), PluginHost.load(), V)
    opt = _adamw(ref.parameters())
    for step in range(steps):
        mbs = _microbatches(num_mb, step)
        loss = 0.0
        for tokens, targets in mbs:
            out = ref(tokens, targets)
            (out.loss / num_mb).backward()
            loss += out.loss.item() / num_mb
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        assert norm > 2 * MAX_NORM  # the clip acts, so a wrong (per-stage) norm would show
        opt.step()
        opt.zero_grad(set_to_none=True)
        for r, res in enumerate(results):
            torch.testing.assert_close(res["losses"][step][0], loss, **TOL, msg=f"rank {r} step {step}")
            torch.testing.assert_close(res["norms"][step], norm, **TOL, msg=f"rank {r} step {step}")
    ref_params = dict(ref.named_parameters())
    assert set(results[0]["params"]) | set(results[1]["params"]) == set(ref_params)
    for r, res in enumerate(results):
        for k, p in res["params"].items():
            torch.testing.assert_close(p, ref_params[k].detach(), **TOL, msg=f"rank {r}: {k}")


def test_forward_only_interleaved_takes_any_number_of_micro_batches():
    from moeplug.parallel.schedules import pipeline_schedule
    # an evaluation's micro-batches (the last one shorter runs alone): each in turn through
    # the rank's chunks, so no multiple of PP is needed; training still refuses it
    assert _ops(pipeline_schedule(2, 1, 3, 2, forward_only=True)) == "F0 F0c1 F1 F1c1 F2 F2c1"
    with pytest.raises(ConfigError, match="not a multiple of PP = 2"):
        pipeline_schedule(2, 1, 3, 2)
