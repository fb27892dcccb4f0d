"""Tensor parallel (TP), sequence parallel (SP) and expert tensor parallel (ETP) equal one process.

Every rank builds the single-process reference from the same seed, copies its shard of the
weights (moeplug.parallel.sharding.load_parallel_shard), runs forward + backward on its
data-parallel shard of the batch, then sync_gradients. Compared with the reference run on each
DP shard (losses averaged over DP, as data parallelism computes them):
  * the loss (identical on every TP rank, averaged over DP),
  * every local gradient against the same shard of the reference gradient (shard_state_dict
    applied to the reference grads: a wrong shard map would also break the loss check),
  * the global gradient norm (TP-sharded squares summed over TP, replicated ones counted once).
Aux losses are on (Switch + per-sequence + z-loss), so the TP count reduction is tested too:
under TP the MoE layer routes only its chunk of each sequence, and the loss still equals the
unsplit one. fp32 throughout; TOL covers summation-order differences of the collectives.

Layout legend: tpN tensor parallel, sp sequence parallel, etpN expert tensor parallel, epN
expert parallel (folded: ep may span the TP ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeplug.testing.distributed import run_distributed

V, B_PER_DP, SEQ = 64, 2, 8
TOL = 2e-5

# name -> (ParallelConfig kwargs, dispatcher, model overrides)
MLA = {"attention": "mla", "mla": {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                   "qk_rope_head_dim": 4, "v_head_dim": 4}}
LAYOUTS_2 = {
    "tp2": (dict(tp=2), "alltoall", {}),
    "tp2_sp": (dict(tp=2, sequence_parallel=True), "alltoall", {"qk_norm": True}),
    "tp2_sp_tied": (dict(tp=2, sequence_parallel=True), "allgather", {"tie_embeddings": True}),
    "etp2_ep1": (dict(etp=2), "allgather", {}),
    # MLA split over TP by heads (Megatron's): the down projections whole on every rank (under
    # SP on its sequence chunk, their grads then summed), the latents gathered
    "tp2_mla": (dict(tp=2), "alltoall", MLA),
    "tp2_sp_mla": (dict(tp=2, sequence_parallel=True), "alltoall", MLA),
}
LAYOUTS_4 = {
    "etp2_ep2": (dict(etp=2, ep=2), "alltoall", {}),
    "tp2_ep4_sp": (dict(tp=2, ep=4, sequence_parallel=True), "alltoall", {}),
    "tp2_etp2_ep2_sp": (dict(tp=2, etp=2, ep=2, sequence_parallel=True), "alltoall", {}),
    "tp2_ep2_sp_mla": (dict(tp=2, ep=2, sequence_parallel=True), "alltoall", MLA),
}


def _cfg(dispatcher: str, overrides: dict):
    from moeplug.config import config_from_dict
    model = {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
             "init_std": 0.1,
             "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8, "aux_loss_coeff": 0.05}}
    model.update(overrides)
    return config_from_dict({
        "model": model,
        "plugins": {"dispatcher": dispatcher,
                    "router_options": {"load_balancing_type": ["aux_loss", "seq_aux_loss"],
                                       "z_loss_coeff": 1e-2}},
        "train": {"seq_len": SEQ},
    })


def _compare_layout(rank: int, world: int, pcfg_kwargs: dict, dispatcher: str,
                    overrides: dict) -> dict[str, float]:
    import torch.distributed as dist

    from moeplug.build import build_model
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.grad_sync import global_grad_norm, sync_gradients
    from moeplug.parallel.sharding import load_parallel_shard, shard_state_dict
    from moeplug.plugin_host import PluginHost

    host = PluginHost.load()
    cfg = _cfg(dispatcher, overrides)
    groups = ParallelGroups.build(ParallelConfig(**pcfg_kwargs), world, rank)
    dp_rank, dp_size = groups.rank_in("dp"), groups.size("dp")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (dp_size * B_PER_DP, SEQ + 1), generator=g)
    tokens, targets = ids[:, :-1], ids[:, 1:]

    torch.manual_seed(0)
    ref = build_model(cfg, host, V)
    model = build_model(cfg, host, V, groups=groups)
    load_parallel_shard(model, ref.state_dict(), groups)

    # reference: one process, each DP shard's loss, averaged (what data parallelism computes)
    ref_loss = sum(ref(t, y).loss for t, y in zip(tokens.chunk(dp_size),
                                                  targets.chunk(dp_size))) / dp_size
    ref_loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    ref_grads = shard_state_dict(model, {n: p.grad for n, p in ref.named_parameters()}, groups)

    rows = slice(dp_rank * B_PER_DP, (dp_rank + 1) * B_PER_DP)
    out = model(tokens[rows], targets[rows])
    out.loss.backward()
    sync_gradients(model, groups)
    norm = global_grad_norm(model, groups)
    loss = out.loss.detach().clone()
    if groups.dp is not None:
        dist.all_reduce(loss, group=groups.dp)
    loss /= dp_size

    errs = {"loss": abs(loss.item() - ref_loss.item()),
            "grad_norm": abs(norm.item() - ref_norm.item()),
            "aux_is_active": float(out.aux_loss.item() > 0)}
    for name, p in model.named_parameters():
        errs[f"grad/{name}"] = (p.grad - ref_grads[name]).abs().max().item()
    errs["num_sharded"] = float(sum(tuple(p.shape) != tuple(dict(ref.named_parameters())[n].shape)
                                    for n, p in model.named_parameters()))
    return errs


def _vocab_ce_and_errors(rank: int, world: int) -> dict:
    """vocab_parallel_cross_entropy vs F.cross_entropy (loss and grad), and error messages that
    need a real TP group."""
    from moeplug.config import config_from_dict
    from moeplug.modules.attention import Attention
    from moeplug.modules.rope import RotaryEmbedding
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
    from moeplug.parallelize.tp import parallelize_attention

    groups = ParallelGroups.build(ParallelConfig(tp=2), world, rank)
    g = torch.Generator().manual_seed(3)
    logits_NV = torch.randn(12, V, generator=g, dtype=torch.float64).float() * 3
    targets_N = torch.randint(0, V, (12,), generator=g)
    w_N = torch.rand(12, generator=g)  # a non-uniform upstream grad
    full = logits_NV.clone().requires_grad_(True)
    ref = F.cross_entropy(full, targets_N, reduction="none")
    (ref * w_N).sum().backward()
    mine = logits_NV.chunk(world, dim=1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, targets_N, groups.tp)
    (loss * w_N).sum().backward()
    out = {"ce_loss": (loss - ref).abs().max().item(),
           "ce_grad": (mine.grad - full.grad.chunk(world, dim=1)[rank]).abs().max().item()}
    try:
        VocabParallelEmbedding(63, 4, groups.tp)
    except ValueError as e:
        out["vocab_error"] = str(e)
    cfg = config_from_dict({"model": {"hidden_size": 16, "num_heads": 4, "num_kv_heads": 1,
                                      "max_seq_len": 16}, "train": {"seq_len": SEQ}}).model
    try:
        parallelize_attention(Attention(cfg, RotaryEmbedding(cfg.head_dim, 16, 1e4)), cfg,
                              groups.tp, False)
    except ValueError as e:
        out["kv_error"] = str(e)
    return out


def _world2(rank: int, world: int) -> dict:
    report = {name: _compare_layout(rank, world, *spec) for name, spec in LAYOUTS_2.items()}
    report["_ce"] = _vocab_ce_and_errors(rank, world)
    return report


def _world4(rank: int, world: int) -> dict:
    return {name: _compare_layout(rank, world, *spec) for name, spec in LAYOUTS_4.items()}


@pytest.fixture(scope="module")
def reports2():
    return run_distributed(_world2, 2, timeout=180)


@pytest.fixture(scope="module")
def reports4():
    return run_distributed(_world4, 4, timeout=240)


def _check(reports, layout):
    for rank, report in enumerate(reports):
        errs = report[layout]
        assert errs.pop("aux_is_active") == 1.0, "the aux losses must be on for the test to count"
        assert errs.pop("num_sharded") > 0, f"{layout}: nothing was sharded"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{layout}, rank {rank}: differs from one process by more than {TOL}: {bad}"


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_world2_layouts_match_single_process(reports2, layout):
    _check(reports2, layout)


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_world4_layouts_match_single_process(reports4, layout):
    _check(reports4, layout)


def test_vocab_parallel_cross_entropy_matches_torch(reports2):
    for report in reports2:
        ce = report["_ce"]
        assert ce["ce_loss"] < 1e-5 and ce["ce_grad"] < 1e-6, ce


def test_tp_errors_name_field_value_and_fix(reports2):
    ce = reports2[0]["_ce"]
    assert "vocab_size = 63" in ce["vocab_error"] and "Fix:" in ce["vocab_error"]
    assert "num_kv_heads = 1" in ce["kv_error"] and "whole KV heads" in ce["kv_error"]


def test_vocab_ce_single_process_and_shape_error():
    from moeplug.parallel.tensor_parallel import vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=g)
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets, None),
                               F.cross_entropy(logits, targets, reduction="none"))
    with pytest.raises(ValueError, match=r"logits \(1, 5, 7\).*Fix: flatten"):
        vocab_parallel_cross_entropy(logits.unsqueeze(0), targets, None)


def test_etp_config_and_slice_errors():
    from moeplug.config import config_from_dict
    from moeplug.parallel.expert_tp import etp_slice, expert_model_config

    m = config_from_dict({"model": {"moe": {"ffn_hidden_size": 8}}}).model
    assert expert_model_config(m, 2).moe.ffn_hidden_size == 4
    assert expert_model_config(m, 1) is m
    with pytest.raises(ValueError, match=r"ffn_hidden_size = 8 .* size 3\. Fix: choose etp"):
        expert_model_config(m, 3)
    with pytest.raises(ValueError, match=r"'l.experts.bias' .*Fix:"):
        etp_slice("l.experts.bias", torch.zeros(2, 8), {}, 0, 2)


def test_etp_slice_keeps_gate_and_up_halves_together():
    # gated FC1 [L, 2F, D]: rank r's rows are gate[rFl:(r+1)Fl] then up[rFl:(r+1)Fl]
    from moeplug.parallel.expert_tp import etp_slice
    L, F_, D = 2, 4, 3
    gate_up = torch.arange(L * 2 * F_ * D, dtype=torch.float32).view(L, 2 * F_, D)
    full = {"x.down_proj": torch.zeros(L, D, F_), "x.gate_up_proj": gate_up}
    got = etp_slice("x.gate_up_proj", gate_up, full, 1, 2)
    torch.testing.assert_close(got, torch.cat([gate_up[:, 2:4], gate_up[:, 6:8]], dim=1))
    down = torch.arange(L * D * F_, dtype=torch.float32).view(L, D, F_)
    torch.testing.assert_close(etp_slice("x.down_proj", down, full, 0, 2), down[:, :, :2])


def test_shard_state_dict_errors_name_the_parameter():
    from moeplug.build import build_model
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.sharding import shard_state_dict
    from moeplug.plugin_host import PluginHost

    model = build_model(_cfg("alltoall", {}), PluginHost.load(), V)
    groups = ParallelGroups.build(ParallelConfig(), 1, 0)
    state = model.state_dict()
    missing = {k: v for k, v in state.items() if k != "norm.weight"}
    with pytest.raises(KeyError, match=r"'norm.weight' is missing.*Fix"):
        shard_state_dict(model, missing, groups)
    wrong = dict(state, **{"norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(16,\).*\(3,\).*Fix"):
        shard_state_dict(model, wrong, groups)
