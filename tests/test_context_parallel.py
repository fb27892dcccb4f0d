"""Context parallelism equals one process on the unsharded sequence.

* layout: the load-balanced chunk assignment, its round trip and its equal attention work;
* attention alone (world 4: CP4 and CP2 x DP2, both K/V exchanges): output and dq/dk/dv of every
  rank's shard equal the matching rows of torch SDPA (is_causal) on the full sequence;
* the LM loss alone at TP2 x CP2 (same spawn): every rank's value is the whole sequences' mean
  cross-entropy, and its logits' grad is CP times its share of that mean's; multi-token
  prediction's ids k ahead (cp_ahead) are each rank's shard of the whole sequence's shift;
* the whole model (CP2 at world 2 with both exchanges, CP2 x EP2 at world 4): loss, every
  gradient after sync_gradients, and 3 AdamW steps with the global-norm clip equal one process
  running the unsharded batch.

Tolerances are fp32: 1e-5 absolute on losses, gradients and parameters (the CP sums run over the
same terms in a different order; observed differences are ~1e-7).

The model tests keep the router's aux loss on: its expert counts are summed over TP x CP, so a
CP rank's aux loss is the whole sequences'; with DP2 the reference averages the per-DP-shard
losses (the aux loss is a product of per-batch means, and that is what data parallelism computes).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeplug.config import ConfigError
from moeplug.parallel.context_parallel import (ContextParallelAttention, cp_ahead, cp_attention,
                                               cp_chunk_ids, cp_cross_entropy, cp_positions,
                                               shard_sequence, unshard_sequence)
from moeplug.testing.distributed import run_distributed

TOL = 1e-5
V, SEQ, MAX_NORM = 64, 16, 0.05


# --- layout ------------------------------------------------------------------------------------

def test_positions_follow_the_load_balanced_chunks():
    # 8 tokens, CP2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_chunk_ids(4, 1) == (1, 6)
    assert cp_positions(5, 1, 0).tolist() == list(range(5))
    for W in (2, 3, 4):
        N = 2 * W * 3
        pos = [cp_positions(N, W, r) for r in range(W)]
        assert sorted(torch.cat(pos).tolist()) == list(range(N))  # every token exactly once
        # causal work of a rank = number of (query, visible key) pairs = sum(pos + 1): equal
        assert len({int((p + 1).sum()) for p in pos}) == 1


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_shard_unshard_round_trip(W):
    g = torch.Generator().manual_seed(W)
    tokens_BS = torch.randint(0, 100, (3, 4 * W), generator=g)
    x_BSD = torch.randn(3, 4 * W, 5, generator=g)
    for x, dim in ((tokens_BS, 1), (x_BSD, 1), (x_BSD.transpose(0, 1), 0)):
        shards = [shard_sequence(x, W, r, dim=dim) for r in range(W)]
        assert all(s.shape[dim] == x.shape[dim] // W for s in shards)
        assert torch.equal(unshard_sequence(shards, dim=dim), x)
    # rank r's tokens are those at its global positions
    last = cp_positions(4 * W, W, W - 1)
    assert torch.equal(shard_sequence(tokens_BS, W, W - 1), tokens_BS[:, last])


def test_rope_at_global_positions_equals_rows_of_the_full_sequence():
    from moeplug.modules.rope import RotaryEmbedding
    rope = RotaryEmbedding(8, 32, 10000.0)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    q_full, k_full = rope(q, k)
    pos = cp_positions(16, 2, 1)
    q_cp, k_cp = rope(q[:, :, pos], k[:, :, pos], positions_S=pos)
    assert torch.equal(q_cp, q_full[:, :, pos]) and torch.equal(k_cp, k_full[:, :, pos])
    with pytest.raises(ValueError) as err:
        rope(q[:, :, :2], k[:, :, :2], positions_S=torch.tensor([3, 40]))
    assert "41 exceeds ModelConfig.max_seq_len = 32" in str(err.value)
    assert "Fix: raise model.max_seq_len to at least 41" in str(err.value)


def test_single_process_cp_pieces_are_the_plain_ones():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for comm in ("allgather", "ring"):
        assert torch.equal(cp_attention(q, k, v, None, comm), want)
    logits, targets = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    targets[0, 0] = -100  # ignored tokens leave the mean, as in F.cross_entropy
    torch.testing.assert_close(cp_cross_entropy(logits, targets, None),
                               F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1)))


def test_errors_name_the_field_the_value_and_the_fix():
    from moeplug.parallel import ParallelConfig
    cases = [
        (lambda: cp_positions(12, 4, 0), ValueError,
         ["seq_len = 12", "2·CP = 8", "Fix: choose train.seq_len a multiple of 8"]),
        (lambda: cp_positions(8, 2, 2), ValueError,
         ["cp_rank = 2", "CP group of size 2", "Fix: pass groups.rank_in('cp')"]),
        (lambda: cp_positions(8, 0, 0), ValueError, ["cp_size = 0", "Fix: pass groups.size('cp')"]),
        (lambda: ParallelConfig(cp=2, cp_comm="p2p"), ConfigError,
         ["ParallelConfig.cp_comm = 'p2p'", "Fix: use 'allgather' or 'ring'"]),
        (lambda: ContextParallelAttention(None, "a2a"), ValueError,
         ["ParallelConfig.cp_comm = 'a2a'", "Fix: use one of 'allgather', 'ring'"]),
        (lambda: cp_attention(*[torch.zeros(1, 1, 2, 2)] * 3, None, "ringg"), ValueError,
         ["cp_comm = 'ringg'", "Fix: use one of 'allgather', 'ring'"]),
    ]
    for fn, exc, parts in cases:
        with pytest.raises(exc) as err:
            fn()
        for part in parts:
            assert part in str(err.value), (part, str(err.value))


# --- attention alone, on real ranks -----------------------------------------------------------

def _pieces_vs_one_process(rank: int, world: int) -> dict[str, float]:
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.testing.cp_attention import cp_attention_errors

    B, H, G, N, Dh = 2, 4, 2, 16, 8
    g = torch.Generator().manual_seed(7)  # same full tensors on every rank
    q, k, v, dout = (torch.randn(B, h, N, Dh, generator=g) for h in (H, G, G, H))
    errs = cp_attention_errors(
        rank, world, q, k, v, dout,
        reference=lambda *qkv: F.scaled_dot_product_attention(*qkv, is_causal=True,
                                                              enable_gqa=True))
    # The LM loss at TP2 x CP2: vocab-parallel logits of this rank's tokens, one ignored token.
    logits_full = torch.randn(B, N, 12, generator=g).requires_grad_()
    targets = torch.randint(0, 12, (B, N), generator=g)
    targets[0, 1] = targets[1, N - 1] = -100  # one on each CP rank (chunks 0 and 3 of 4)
    ref = F.cross_entropy(logits_full.reshape(-1, 12), targets.reshape(-1))
    ref.backward()
    groups = ParallelGroups.build(ParallelConfig(tp=2, cp=2), world, rank)
    W, r, t = groups.size("cp"), groups.rank_in("cp"), groups.rank_in("tp")
    cols = slice(6 * t, 6 * (t + 1))
    local = shard_sequence(logits_full.detach(), W, r)[..., cols].requires_grad_()
    loss = cp_cross_entropy(local, shard_sequence(targets, W, r), groups.cp, tp_group=groups.tp)
    loss.backward()
    errs["ce/loss"] = abs(loss.item() - ref.item())
    # Each rank's grad is W times its share of the global mean's (sync_gradients averages).
    want_grad = W * shard_sequence(logits_full.grad, W, r)[..., cols]
    errs["ce/grad"] = (local.grad - want_grad).abs().max().item()
    # Multi-token prediction's ids k ahead: this rank's shard of the whole sequence shifted by k
    # (fill past its end), although the shard's two chunks are not contiguous.
    ids = torch.randint(0, 1000, (B, N), generator=g)
    for k in (1, 3, 5, N):
        whole = F.pad(ids[:, k:], (0, k), value=-7)
        got = cp_ahead(shard_sequence(ids, W, r), k, -7, groups.cp)
        errs[f"ahead/{k}"] = float(not torch.equal(got, shard_sequence(whole, W, r)))
    return errs


@pytest.fixture(scope="module")
def pieces_world4():
    return run_distributed(_pieces_vs_one_process, 4, timeout=120)


def test_attention_equals_sdpa_on_the_full_sequence_forward_and_backward(pieces_world4):
    for rank, errs in enumerate(pieces_world4):
        errs = {k: v for k, v in errs.items() if k.startswith("cp")}
        assert len(errs) == 16
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: CP attention differs from SDPA by more than {TOL}: {bad}"


def test_tp_cp_loss_is_the_whole_groups_token_mean(pieces_world4):
    # Under TP x CP each rank's loss is the mean over every token of the CP group (what the
    # trainer logs), not of its own chunk; ignored tokens leave the mean as in F.cross_entropy.
    for rank, errs in enumerate(pieces_world4):
        assert errs["ce/loss"] <= TOL and errs["ce/grad"] <= TOL, (rank, errs)


def test_cp_ahead_is_the_whole_sequences_shift(pieces_world4):
    for rank, errs in enumerate(pieces_world4):
        ahead = {k: v for k, v in errs.items() if k.startswith("ahead/")}
        assert len(ahead) == 4 and not any(ahead.values()), (rank, ahead)
    ids = torch.arange(12).reshape(2, 6)
    assert torch.equal(cp_ahead(ids, 2, 0, None), F.pad(ids[:, 2:], (0, 2)))  # one process


# --- the whole model, on real ranks -------------------------------------------------------------

def _cfg(dispatcher: str = "alltoall"):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": SEQ, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "init_std": 0.1,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8,
                          "aux_loss_coeff": 0.05}},
        "plugins": {"dispatcher": dispatcher},
        "train": {"seq_len": SEQ},
    })


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (rows, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _model_vs_single_process(rank: int, world: int, layouts: list) -> dict[str, dict[str, float]]:
    """Per layout (name, ParallelConfig kwargs): max |difference| of loss, grads (step 0, after
    sync_gradients), grad norm and final params after 3 AdamW steps, against one process."""
    from moeplug.build import build_model
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.experts import expert_param_names, local_expert_ids
    from moeplug.parallel.sharding import load_expert_shard
    from moeplug.parallel.grad_sync import clip_grad_norm, sync_gradients
    from moeplug.plugin_host import PluginHost

    host = PluginHost.load()
    cfg = _cfg()
    report: dict[str, dict[str, float]] = {}
    for name, pkw in layouts:
        groups = ParallelGroups.build(ParallelConfig(**pkw), world, rank)
        cp, cp_rank = groups.size("cp"), groups.rank_in("cp")
        dp, dp_rank = groups.size("dp"), groups.rank_in("dp")
        ep, ep_rank = groups.size("ep"), groups.rank_in("ep")
        torch.manual_seed(0)
        ref = build_model(cfg, host, V)
        model = build_model(cfg, host, V, groups=groups)
        load_expert_shard(model, ref.state_dict(), ep_rank, ep)
        expert_names = expert_param_names(model)
        mine = local_expert_ids(cfg.model.moe.num_experts, ep, ep_rank)

        def want(pname, t):  # the reference tensor this rank's parameter corresponds to
            return t[mine.start:mine.stop] if pname in expert_names else t

        opt_ref, opt = _adamw(ref.parameters()), _adamw(model.parameters())
        errs = {"loss": 0.0, "grad_norm": 0.0, "min_ref_norm": float("inf"), "grads": 0.0}
        for step in range(3):
            tokens, targets = _batch(step, 2 * dp)
            ref_loss = sum(ref(t, y).loss for t, y in zip(tokens.chunk(dp), targets.chunk(dp))) / dp
            ref_loss.backward()
            rows = slice(2 * dp_rank, 2 * dp_rank + 2)  # this rank's DP rows, then its CP tokens
            out = model(shard_sequence(tokens[rows], cp, cp_rank),
                        shard_sequence(targets[rows], cp, cp_rank))
            out.loss.backward()
            sync_gradients(model, groups)
            if step == 0:
                ref_grads = {n: p.grad for n, p in ref.named_parameters()}
                errs["grads"] = max((p.grad - want(n, ref_grads[n])).abs().max().item()
                                    for n, p in model.named_parameters())
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            norm = clip_grad_norm(model, groups, MAX_NORM)
            opt_ref.step(), opt.step()
            opt_ref.zero_grad(set_to_none=True), opt.zero_grad(set_to_none=True)
            # The loss is already the CP group's token mean; DP ranks hold different rows.
            loss = out.loss.detach().clone()
            if groups.dp is not None:
                torch.distributed.all_reduce(loss, group=groups.dp)
            errs["loss"] = max(errs["loss"], abs(loss.item() / dp - ref_loss.item()))
            errs["grad_norm"] = max(errs["grad_norm"], abs(norm.item() - ref_norm.item()))
            errs["min_ref_norm"] = min(errs["min_ref_norm"], ref_norm.item())
        ref_params = dict(ref.named_parameters())
        errs["params"] = max((p.detach() - want(n, ref_params[n].detach())).abs().max().item()
                             for n, p in model.named_parameters())
        errs["cp_attention_modules"] = float(sum(b.attn.wiring.cp_attention is not None
                                                 for b in model.blocks))
        report[name] = errs
    return report


def _check(reports, layouts, num_blocks=2):
    for rank, report in enumerate(reports):
        for name, _ in layouts:
            errs = report[name]
            assert errs["cp_attention_modules"] == num_blocks, "every attention must run CP"
            assert errs["min_ref_norm"] > 2 * MAX_NORM, "clipping must act for the norm to count"
            bad = {k: v for k, v in errs.items()
                   if k not in ("min_ref_norm", "cp_attention_modules") and not v <= TOL}
            assert not bad, f"{name}, rank {rank}: differs from one process by > {TOL}: {bad}"


CP2_LAYOUTS = [("cp2_allgather", dict(cp=2, cp_comm="allgather")),
               ("cp2_ring", dict(cp=2, cp_comm="ring"))]


def test_cp2_model_equals_single_process_both_exchanges():
    _check(run_distributed(_model_vs_single_process, 2, CP2_LAYOUTS, timeout=120), CP2_LAYOUTS)


CP2_EP2_LAYOUTS = [("cp2_ep2_ring", dict(cp=2, ep=2, cp_comm="ring"))]


def test_cp2_ep2_dp2_model_equals_single_process():
    # World 4: attention CP2 x DP2, experts EP2 x EDP2 (the EP groups are the CP groups).
    _check(run_distributed(_model_vs_single_process, 4, CP2_EP2_LAYOUTS, timeout=150),
           CP2_EP2_LAYOUTS)
