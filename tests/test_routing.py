"""moeplug.routing's pure functions against slow, obviously correct references (Python loops,
per-sequence / per-expert re-computation) and the analytic facts of the reference section 2.

Legend: T tokens, E experts, K top-k, G groups, B sequences, S tokens per sequence, D hidden.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from moeplug import routing as R
from moeplug.testing.distributed import run_distributed


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---- scores and top-k ------------------------------------------------------------------------

def _brute_group_topk(scores_TE, k, G, kg, members=None):
    """Per token: score every group by the sum of its top ``members`` scores (default k//kg),
    keep the kg best groups, then take the k best experts among the kept groups (Python
    sorting, no torch.topk)."""
    T, E = scores_TE.shape
    n = E // G
    members = members or max(k // kg, 1)
    out = []
    for t in range(T):
        row = scores_TE[t].tolist()
        group_score = [sum(sorted(row[g * n:(g + 1) * n], reverse=True)[:members])
                       for g in range(G)]
        kept = sorted(range(G), key=lambda g: -group_score[g])[:kg]
        allowed = [e for g in kept for e in range(g * n, (g + 1) * n)]
        out.append(sorted(sorted(allowed, key=lambda e: -row[e])[:k]))
    return torch.tensor(out)


@pytest.mark.parametrize("T, E, k, G, kg", [(37, 8, 2, 4, 2), (29, 16, 4, 4, 2), (11, 256, 8, 8, 4),
                                             (13, 6, 3, 3, 3), (7, 12, 2, 6, 1)])
def test_group_limited_topk_matches_brute_force(T, E, k, G, kg):
    scores_TE = torch.randn(T, E, generator=_gen(T + E))
    top_TK, ids_TK = R.group_limited_topk(scores_TE, k, G, kg)
    assert torch.equal(ids_TK.sort(dim=1).values, _brute_group_topk(scores_TE, k, G, kg))
    torch.testing.assert_close(top_TK, scores_TE.gather(1, ids_TK))


# (T, E, k, G, kg): k // kg = 3, 1, 4, 2 (where top2_sum equals topk_share) and 8 (256 experts).
@pytest.mark.parametrize("T, E, k, G, kg", [(41, 16, 6, 4, 2), (23, 12, 2, 6, 2), (19, 32, 8, 8, 2),
                                             (17, 16, 4, 4, 2), (11, 256, 8, 8, 1)])
def test_top2_sum_group_score_matches_brute_force(T, E, k, G, kg):
    scores_TE = torch.randn(T, E, generator=_gen(T * E))
    top_TK, ids_TK = R.group_limited_topk(scores_TE, k, G, kg, "top2_sum")
    assert torch.equal(ids_TK.sort(dim=1).values, _brute_group_topk(scores_TE, k, G, kg, 2))
    torch.testing.assert_close(top_TK, scores_TE.gather(1, ids_TK))


def test_group_score_rules_differ_unless_the_share_is_two():
    # 16 experts in 4 groups of 4, 2 groups kept, top-6: topk_share sums each group's top 3.
    # Group 0 has two strong experts (top-2 sum 1.9, top-3 sum 1.9), group 1 three good ones
    # (1.6, 2.4), group 2 two fairly strong ones (1.8, 1.8), group 3 nothing.
    scores_TE = torch.tensor([[1.0, 0.9, 0.0, 0.0, 0.8, 0.8, 0.8, 0.0,
                               0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    groups = lambda ids: sorted(set((ids[0] // 4).tolist()))  # noqa: E731
    assert groups(R.group_limited_topk(scores_TE, 6, 4, 2, "top2_sum")[1]) == [0, 2]
    assert groups(R.group_limited_topk(scores_TE, 6, 4, 2, "topk_share")[1]) == [0, 1]
    # At k // kg == 2 both rules are the same computation.
    scores_TE = torch.randn(53, 16, generator=_gen(5))
    for k, kg in [(4, 2), (2, 1), (8, 4)]:
        a = R.group_limited_topk(scores_TE, k, 4, kg, "top2_sum")
        b = R.group_limited_topk(scores_TE, k, 4, kg, "topk_share")
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_group_score_reaches_topk_routing_with_bias():
    # Sigmoid scores + bias, share 3: topk_routing must select with the biased scores under the
    # chosen group rule and weight with the unbiased ones (HF DeepseekV3TopkRouter's order).
    logits_TE = torch.randn(31, 16, generator=_gen(6), dtype=torch.float64)
    bias_E = 0.3 * torch.randn(16, generator=_gen(7), dtype=torch.float64)
    probs, ids = R.topk_routing(logits_TE, 6, score_function="sigmoid", expert_bias_E=bias_E,
                                num_groups=4, group_topk=2, group_score="top2_sum")
    s_TE = torch.sigmoid(logits_TE)
    ref_ids = _brute_group_topk(s_TE + bias_E, 6, 4, 2, 2)
    assert torch.equal(ids.sort(dim=1).values, ref_ids)
    chosen = s_TE.gather(1, ids)
    torch.testing.assert_close(probs, chosen / (chosen.sum(-1, keepdim=True) + 1e-20))
    default = R.topk_routing(logits_TE, 6, score_function="sigmoid", expert_bias_E=bias_E,
                             num_groups=4, group_topk=2)[1]
    assert not torch.equal(default.sort(dim=1).values, ref_ids)  # the rule matters here
    with pytest.raises(ValueError, match=r"group_score = 'top3': unknown. Fix: use one of "
                                         r"topk_share, top2_sum"):
        R.topk_routing(logits_TE, 6, num_groups=4, group_topk=2, group_score="top3")


def test_group_limits_change_the_choice_versus_plain_topk():
    # Expert 0 is the best single expert but sits in a weak group: plain top-2 takes it,
    # group-limited (1 of 2 groups) does not.
    scores_TE = torch.tensor([[0.9, 0.0, 0.6, 0.5]])
    assert set(R.select_topk(scores_TE, 2)[1][0].tolist()) == {0, 2}
    assert set(R.select_topk(scores_TE, 2, 2, 1)[1][0].tolist()) == {2, 3}


def test_softmax_post_equals_mixtral_and_pre_is_unnormalised():
    logits_TE = torch.randn(19, 8, generator=_gen(1), dtype=torch.float64)
    full_TE = torch.softmax(logits_TE, -1)
    top_TK, ref_ids = full_TE.topk(3, dim=-1)
    probs, ids = R.topk_routing(logits_TE, 3, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, top_TK / top_TK.sum(-1, keepdim=True))
    probs, ids = R.topk_routing(logits_TE, 3, renormalize=False, scaling_factor=2.5)
    torch.testing.assert_close(probs, 2.5 * top_TK)


@pytest.mark.parametrize("fn", ["sigmoid", "sqrtsoftplus"])
def test_bias_steers_selection_but_not_weights(fn):
    logits_TE = torch.randn(23, 8, generator=_gen(2), dtype=torch.float64)
    bias_E = torch.zeros(8, dtype=torch.float64)
    bias_E[5] = 100.0  # every token must pick expert 5 ...
    s_TE = torch.sigmoid(logits_TE) if fn == "sigmoid" else torch.nn.functional.softplus(logits_TE).sqrt()
    probs, ids = R.topk_routing(logits_TE, 2, score_function=fn, expert_bias_E=bias_E)
    assert (ids == 5).any(dim=1).all()
    chosen = s_TE.gather(1, ids)  # ... but weights come from the unbiased scores
    torch.testing.assert_close(probs, chosen / (chosen.sum(-1, keepdim=True) + 1e-20))
    # Without the bias, selection is the plain top-k of the scores.
    _, ids0 = R.topk_routing(logits_TE, 2, score_function=fn)
    assert torch.equal(ids0, s_TE.topk(2, dim=-1)[1])
    # K = 1: no renormalisation (the weight would be the constant 1).
    p1, i1 = R.topk_routing(logits_TE, 1, score_function=fn)
    torch.testing.assert_close(p1, s_TE.gather(1, i1))


def test_aux_scores_normalise_sigmoid_with_tiny_epsilon():
    # sigmoid(-30) ~ 1e-13: a normaliser epsilon like 1e-6 would shrink these scores to ~4e-7
    # (the loss could be gamed by shrinking scores, Megatron #1545); 1e-20 keeps them summing to 1.
    logits_TE = torch.full((2, 4), -30.0, dtype=torch.float64)
    s = R.aux_scores(logits_TE, "sigmoid")
    torch.testing.assert_close(s.sum(-1), torch.ones(2, dtype=torch.float64))


# ---- losses ---------------------------------------------------------------------------------

def _loop_aux(scores_TE, ids_TK):
    T, E = scores_TE.shape
    K = ids_TK.shape[1]
    total = 0.0
    for i in range(E):
        n_i = int((ids_TK == i).sum())
        total = total + (n_i / (T * K)) * scores_TE[:, i].mean()
    return E * total


def test_switch_aux_loss_matches_loop_and_uniform_is_one():
    scores_TE = torch.softmax(torch.randn(31, 6, generator=_gen(3)), -1)
    ids_TK = scores_TE.topk(2, -1)[1]
    got = R.switch_aux_loss(scores_TE, R.expert_counts(ids_TK, 6), 31, 2)
    torch.testing.assert_close(got, _loop_aux(scores_TE, ids_TK))
    # Uniform: equal scores, every expert chosen equally often.
    T, E, K = 12, 6, 2
    ids_TK = torch.arange(T * K).view(T, K) % E
    uni = R.switch_aux_loss(torch.full((T, E), 1 / E), R.expert_counts(ids_TK, E), T, K)
    assert uni.item() == pytest.approx(1.0, abs=1e-6)


def test_seq_aux_loss_equals_aux_at_one_sequence_and_mean_of_sequences_otherwise():
    B, S, E, K = 3, 10, 8, 2
    logits = torch.randn(B * S, E, generator=_gen(4), requires_grad=True)
    scores_TE = torch.softmax(logits, -1)
    ids_TK = scores_TE.detach().topk(K, -1)[1]
    one = R.seq_aux_loss(scores_TE[:S], ids_TK[:S], 1)
    assert torch.equal(one, R.switch_aux_loss(scores_TE[:S], R.expert_counts(ids_TK[:S], E), S, K))
    # Megatron's B=2 relation, generalised: value = mean of the per-sequence aux losses, and
    # B * grad(seq) = sum of the per-sequence grads.
    seq = R.seq_aux_loss(scores_TE, ids_TK, B)
    per = [_loop_aux(scores_TE[b * S:(b + 1) * S], ids_TK[b * S:(b + 1) * S]) for b in range(B)]
    torch.testing.assert_close(seq, sum(per) / B)
    g_seq, = torch.autograd.grad(seq, logits, retain_graph=True)
    g_sum, = torch.autograd.grad(sum(per), logits)
    torch.testing.assert_close(B * g_seq, g_sum)
    with pytest.raises(ValueError, match=r"30 tokens do not split into num_sequences = 4.*Fix: pass"):
        R.seq_aux_loss(scores_TE, ids_TK, 4)


def test_global_aux_loss_uses_running_counts_over_running_tokens():
    E, K = 4, 2
    s1 = torch.softmax(torch.randn(10, E, generator=_gen(5)), -1)
    s2 = torch.softmax(torch.randn(6, E, generator=_gen(6)), -1)  # micro-batches of unequal size
    n1, n2 = R.expert_counts(s1.topk(K)[1], E), R.expert_counts(s2.topk(K)[1], E)
    first = R.global_aux_loss(s1, n1, 10, K)
    torch.testing.assert_close(first, R.switch_aux_loss(s1, n1, 10, K))
    second = R.global_aux_loss(s2, n1 + n2, 16, K)
    f_E = (n1 + n2).float() / (K * 16)
    torch.testing.assert_close(second, E * (f_E * s2.mean(0)).sum())


def test_z_loss_matches_definition():
    logits_TE = torch.randn(9, 5, generator=_gen(7))
    ref = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits_TE.tolist()) / 9
    assert R.z_loss(logits_TE).item() == pytest.approx(ref, rel=1e-5)


def test_plain_topk_counts_ignore_routed_choice():
    s_TE = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    routed_TK = torch.tensor([[2], [2]])
    assert R.counts_for_aux(s_TE, routed_TK, "plain_topk").view(-1).tolist() == [0, 1]
    assert R.counts_for_aux(s_TE, routed_TK, "routed") is routed_TK
    with pytest.raises(ValueError, match=r"aux_loss_counts = 'x'.*Fix: use one of plain_topk, routed"):
        R.counts_for_aux(s_TE, routed_TK, "x")


# ---- capacity and dropping -------------------------------------------------------------------

def test_capacity_formula():
    assert R.expert_capacity(100, 2, 8, 1.0) == 25
    assert R.expert_capacity(100, 2, 8, 1.1) == math.ceil(27.5)
    assert R.expert_capacity(7, 3, 4, 0.5) == math.ceil(7 * 3 / 4 * 0.5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_drop_keeps_at_most_capacity_and_the_right_choices(policy):
    T, E, K, C = 40, 4, 2, 7
    probs_TK, ids_TK = R.topk_routing(torch.randn(T, E, generator=_gen(8)), K)
    kept_probs, dropped_TK = R.drop_over_capacity(probs_TK, ids_TK, E, C, policy)
    assert torch.equal(kept_probs, probs_TK.masked_fill(dropped_TK, 0.0))
    for e in range(E):
        # Reference: list expert e's choices (t, k) and keep the first C in the policy's order.
        choices = [(t, k) for t in range(T) for k in range(K) if ids_TK[t, k] == e]
        if policy == "probs":
            choices.sort(key=lambda c: (-probs_TK[c].item(), c[0]))
        keep = set(choices[:C])
        for c in choices:
            assert bool(dropped_TK[c]) == (c not in keep)
        assert len(keep) <= C


def test_drop_policies_differ_as_documented():
    # One expert, capacity 1: "probs" keeps the strongest token, "position" the first one.
    ids_TK = torch.zeros(3, 1, dtype=torch.long)
    probs_TK = torch.tensor([[0.2], [0.9], [0.5]])
    _, by_probs = R.drop_over_capacity(probs_TK, ids_TK, 1, 1, "probs")
    _, by_pos = R.drop_over_capacity(probs_TK, ids_TK, 1, 1, "position")
    assert by_probs.view(-1).tolist() == [True, False, True]
    assert by_pos.view(-1).tolist() == [False, True, True]
    with pytest.raises(ValueError, match=r"token_drop_policy = 'last'.*Fix"):
        R.drop_over_capacity(probs_TK, ids_TK, 1, 1, "last")


def test_capacity_at_least_tokens_drops_nothing():
    probs_TK, ids_TK = R.topk_routing(torch.randn(5, 4, generator=_gen(9)), 2)
    _, dropped = R.drop_over_capacity(probs_TK, ids_TK, 4, 5, "probs")
    assert not dropped.any()


# ---- padding rows ----------------------------------------------------------------------------

def test_pad_rows_round_trip_and_counts():
    counts_L = torch.tensor([3, 0, 17, 16])
    x_SD = torch.randn(int(counts_L.sum()), 5, generator=_gen(10), requires_grad=True)
    probs_S = torch.rand(x_SD.shape[0], generator=_gen(11))
    target_L = R.padded_counts(counts_L, None, 16)
    assert target_L.tolist() == [16, 0, 32, 16]
    x_PD, probs_P, index_S = R.pad_rows(x_SD, probs_S, counts_L, target_L)
    assert x_PD.shape[0] == 64 and (probs_P != 0).sum() == (probs_S != 0).sum()
    # Each expert's real rows come first in its block, in order; the rest are zeros.
    start = 0
    src = 0
    for c, t in zip(counts_L.tolist(), target_L.tolist()):
        torch.testing.assert_close(x_PD[start:start + c], x_SD[src:src + c])
        assert (x_PD[start + c:start + t] == 0).all() and (probs_P[start + c:start + t] == 0).all()
        start, src = start + t, src + c
    back = R.unpad_rows(x_PD * 2, index_S)
    torch.testing.assert_close(back, x_SD * 2)
    back.sum().backward()
    torch.testing.assert_close(x_SD.grad, torch.full_like(x_SD, 2.0))
    assert R.padded_counts(counts_L, 20, 1, ep_size=2).tolist() == [40] * 4
    with pytest.raises(ValueError, match=r"received 17 rows but capacity \* ep_size = 8 \* 2 = 16.*Fix"):
        R.padded_counts(counts_L, 8, 1, ep_size=2)
    assert R.pad_rows(x_SD, probs_S, counts_L, counts_L)[2] is None


# ---- gate ------------------------------------------------------------------------------------

def test_router_logits_dtype_and_gradients():
    x_TD = torch.randn(6, 8, generator=_gen(12), requires_grad=True)
    w_ED = torch.randn(4, 8, generator=_gen(13), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z32 = R.router_logits(x_TD.bfloat16(), w_ED)
        z64 = R.router_logits(x_TD, w_ED, torch.float64)
    assert z32.dtype == torch.float32 and z64.dtype == torch.float64
    torch.testing.assert_close(z64, x_TD.double() @ w_ED.double().t())
    z64.sum().backward()
    assert w_ED.grad.dtype == torch.float32 and x_TD.grad.dtype == torch.float32


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arena", [True, False])
def test_input_dtype_gate_is_torchs_bf16_gemm_with_fp32_logits_bitwise(x_dtype, arena):
    """dtype None (router_options.dtype: input, Megatron's moe_router_dtype unset): under bf16
    autocast the gate GEMM runs in bf16 and the logits come back in fp32; values and both
    gradients bitwise torch's composition, in the arena and without one."""
    from moeplug.runtime import workspace
    g = _gen(21)
    x0 = torch.randn(37, 24, generator=g).to(x_dtype)
    w0 = torch.randn(6, 24, generator=g)
    grad = torch.randn(37, 6, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    scope = workspace.arena_scope(workspace.Arena() if arena else None)
    with scope, torch.autocast("cpu", dtype=torch.bfloat16):
        z = R.router_logits(x, w, R.ROUTER_DTYPES["input"])
        z.backward(grad)
    with torch.autocast("cpu", enabled=False):
        zr = (xr.bfloat16() @ wr.bfloat16().t()).float()
        zr.backward(grad)
    assert z.dtype == torch.float32 and torch.equal(z, zr)
    assert x.grad.dtype == x_dtype and torch.equal(x.grad, xr.grad)
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, wr.grad)
    # The bf16 GEMM is not the fp32 one: the logits differ (else the option did nothing).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(z, R.router_logits(x0.float(), w0))


def test_input_dtype_gate_without_autocast_is_the_fp32_gate():
    x = torch.randn(9, 16, generator=_gen(22))
    w = torch.randn(4, 16, generator=_gen(23))
    assert torch.equal(R.router_logits(x, w, None), R.router_logits(x, w, torch.float32))


def test_force_balanced_logits_repeatable_balanced_and_straight_through():
    logits_TE = torch.zeros(4096, 8, requires_grad=True)
    a = R.force_balanced_logits(logits_TE, seed=3)
    assert torch.equal(a, R.force_balanced_logits(logits_TE, seed=3))
    counts_E = R.expert_counts(a.topk(2)[1], 8)
    assert (counts_E - 4096 * 2 / 8).abs().max() < 0.1 * 4096 * 2 / 8
    (a * 3).sum().backward()
    torch.testing.assert_close(logits_TE.grad, torch.full_like(logits_TE, 3.0))


def test_input_jitter_bounds():
    x_TD = torch.ones(1000, 4)
    y = R.input_jitter(x_TD, 0.1)
    assert (y >= 0.9).all() and (y <= 1.1).all() and not torch.equal(y, x_TD)
    assert R.input_jitter(x_TD, 0.0) is x_TD


# ---- expert bias -----------------------------------------------------------------------------

def test_expert_bias_update_direction():
    bias_E = torch.tensor([0.0, 0.5, -0.5, 0.0])
    counts_E = torch.tensor([10, 2, 4, 4])  # mean 5
    new = R.updated_expert_bias(bias_E, counts_E, 0.1)
    torch.testing.assert_close(new, torch.tensor([-0.1, 0.6, -0.4, 0.1]))
    assert new.dtype == torch.float32


def _bias_on_rank(rank, world_size):
    counts_E = torch.tensor([[6, 0, 1, 1], [0, 0, 4, 4]])[rank]  # summed: [6, 0, 5, 5], mean 4
    return R.updated_expert_bias(torch.zeros(4), counts_E, 1.0, dist.group.WORLD).tolist()


def test_expert_bias_counts_are_all_reduced_over_the_group():
    results = run_distributed(_bias_on_rank, 2, timeout=90)
    assert results[0] == results[1] == [-1.0, 1.0, -1.0, -1.0]


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_fp32_gate_keeps_its_inputs_as_they_came_and_matches_the_composition(x_dtype, w_dtype):
    """The fp32 gate over bf16 inputs keeps x and w in their own dtypes for backward (as
    Megatron's RouterGatingLinearFunction), not autograd's fp32 copy of x (T*D floats a layer),
    with the composition's logits and gradients bit for bit."""
    from moeplug.routing.gating import router_logits
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).to(x_dtype).requires_grad_()
    w = torch.randn(8, 64, generator=g).to(w_dtype).requires_grad_()
    dy = torch.randn(37, 8, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = router_logits(x.view(37, 64), w, torch.float32)
    assert sorted(str(t.dtype) for t in saved) == sorted([str(x_dtype), str(w_dtype)])
    ref = x.float() @ w.float().t()
    assert torch.equal(y, ref)
    for a, b in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        assert a.dtype == b.dtype and torch.equal(a, b)
