"""Router plugin ``topk`` with every Megatron-Core feature, built through the real plugin host:
options validation, loss invariants, capacity/padding through both dispatchers and whole MoE
layers, expert bias, per-step state, contract checks.

Legend: T tokens, D hidden, E experts, K top-k, B sequences, S tokens per sequence, L local experts.
"""

from __future__ import annotations

import pytest
import torch

from moeplug import routing as R
from moeplug.config import ConfigError
from moeplug.moe import MoELayer
from moeplug.plugin_host import PluginError, PluginHost
from moeplug.testing import check_router, tiny_model_config

AUX_TYPES = ["aux_loss", "seq_aux_loss", "global_aux_loss"]


@pytest.fixture(scope="module")
def host():
    return PluginHost.load()


def _router(host, options=None, **cfg):
    return host.create("router", "topk", dict(options or {}), tiny_model_config(**cfg))


# ---- options validation ----------------------------------------------------------------------

@pytest.mark.parametrize("options, cfg, pattern", [
    ({"renormalize": True}, {"top_k": 1}, r"TopKOptions.renormalize = True: with top_k = 1.*Fix: set renormalize: false"),
    ({"enable_expert_bias": True}, {}, r"enable_expert_bias = True: the expert bias needs score_function.*Fix: set score_function: sigmoid"),
    ({"num_groups": 3, "group_topk": 1}, {}, r"num_groups = 3: does not divide num_experts \(4\).*Fix: choose a divisor"),
    ({"num_groups": 2, "group_topk": 3}, {}, r"group_topk = 3: exceeds num_groups \(2\). Fix: set group_topk <= 2"),
    ({"num_groups": 4, "group_topk": 1}, {"num_experts": 8, "top_k": 4}, r"group_topk = 1: the 1 kept groups hold 2 experts, fewer than top_k \(4\).*Fix"),
    ({"num_groups": 4, "group_topk": 3}, {"num_experts": 8, "top_k": 2}, r"group_topk = 3: exceeds top_k \(2\), so group_score topk_share would score each group by its top 2 // 3 = 0 experts. Fix: set group_topk <= 2, or group_score: top2_sum"),
    ({"num_groups": 4}, {}, r"group_topk = None: num_groups and group_topk go together. Fix: set both"),
    ({"num_groups": 4, "group_topk": 2, "group_score": "top2_sum"}, {}, r"TopKOptions.group_score = 'top2_sum': sums each group's best 2 scores but a group holds 1 experts.*Fix: lower num_groups, or use group_score: topk_share"),
    ({"load_balancing_type": "sinkhorn"}, {}, r"load_balancing_type = 'sinkhorn': unknown type.*Fix: use 'none' or any of aux_loss"),
    ({"load_balancing_type": ["aux_loss", "seq_aux_loss"], "aux_loss_coeff": [0.1]}, {}, r"aux_loss_coeff = \[0.1\]: has 1 entries but load_balancing_type has 2.*Fix: give one"),
    ({"aux_loss_coeff": -1.0}, {}, r"aux_loss_coeff = -1.0: coefficients must be numbers >= 0. Fix"),
    ({"pad_to_capacity": True}, {}, r"pad_to_capacity = True: needs a capacity. Fix: set capacity_factor"),
    ({"capacity_factor": 0.0}, {}, r"capacity_factor = 0.0: must be > 0. Fix"),
    ({"padding_for_quantization": 0}, {}, r"padding_for_quantization = 0: must be between 1 and 256. Fix: use 1 \(off\), 16"),
    # accepted once, it padded every expert to a million rows: the OOM killer took the run
    ({"padding_for_quantization": 1000000}, {}, r"padding_for_quantization = 1000000: must be between 1 and 256. Fix"),
    ({"input_jitter_eps": 1.5}, {}, r"input_jitter_eps = 1.5: must be < 1.*Fix"),
    ({"z_loss_coeff": -0.1}, {}, r"z_loss_coeff = -0.1: must be >= 0. Fix"),
    ({"topk_scaling_factor": 0.0}, {}, r"topk_scaling_factor = 0.0: must be > 0. Fix"),
])
def test_options_validation_names_field_value_and_fix(host, options, cfg, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _router(host, options, **cfg)


def test_option_type_errors_come_from_the_host(host):
    with pytest.raises(PluginError, match=r"score_function = 'relu'.*must be one of 'softmax', 'sigmoid', 'sqrtsoftplus'"):
        _router(host, {"score_function": "relu"})
    with pytest.raises(PluginError, match=r"plugins.router_options.group_score = 'top3' \(str\) must "
                                          r"be one of 'topk_share', 'top2_sum'. Fix: set group_score"):
        _router(host, {"num_groups": 2, "group_topk": 1, "group_score": "top3"})
    with pytest.raises(PluginError, match=r"plugins.router_options.dtype = 'bf16' \(str\) must be "
                                          r"one of 'fp32', 'fp64', 'input'. Fix: set dtype"):
        _router(host, {"dtype": "bf16"})


@pytest.mark.parametrize("options", [{"topk_scaling_factor": float("inf")},
                                     {"z_loss_coeff": float("inf")},
                                     {"aux_loss_coeff": float("nan")},
                                     {"aux_loss_coeff": [0.01, float("nan")],
                                      "load_balancing_type": ["aux_loss", "seq_aux_loss"]},
                                     {"bias_update_rate": float("nan"), "enable_expert_bias": True,
                                      "score_function": "sigmoid"}])
def test_non_finite_options_are_refused_by_the_host(host, options):
    # nan passes every range check written as a comparison (nan < 0 is False), and inf trained
    # to a NaN loss blamed on the learning rate, or (bias_update_rate) silently
    name = next(k for k, v in options.items() if v != v or v == float("inf")
                or isinstance(v, list))
    with pytest.raises(PluginError, match=rf"plugins.router_options.{name} = .*must be finite. "
                                          rf"Fix: set {name} to a finite number"):
        _router(host, options)


def test_bad_group_score_is_a_config_error_through_the_cli(run_cli, tiny_config_file):
    proc = run_cli("train", "--config", tiny_config_file(), "--set",
                   "plugins.router_options={num_groups: 2, group_topk: 1, group_score: top3}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for fragment in ("moeplug: configuration error:", "plugins.router_options.group_score = "
                     "'top3'", "must be one of 'topk_share', 'top2_sum'", "Fix: set group_score"):
        assert fragment in proc.stderr, (fragment, proc.stderr)


# ---- loss invariants -------------------------------------------------------------------------

@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("E, K, B", [(8, 2, 2), (6, 3, 1), (4, 1, 3)])
def test_uniform_router_gives_one_for_every_aux_type(host, score_function, E, K, B):
    coeffs = [0.5, 0.25, 2.0]
    opts = {"score_function": score_function, "load_balancing_type": AUX_TYPES,
            "aux_loss_coeff": coeffs, "renormalize": False if K == 1 else True}
    router = _router(host, opts, num_experts=E, top_k=K)
    with torch.no_grad():
        router.weight.zero_()
    # Zero gate: every score is equal, so P_i = 1/E for each loss type, and whatever counts the
    # top-k produces sum to (tokens * K), giving E * sum_i f_i / E = 1 exactly.
    out = router(torch.randn(B * 12, 16), num_sequences=B)
    for t in AUX_TYPES:
        assert out.losses[t].item() == pytest.approx(1.0, abs=1e-6), t
    assert out.aux_loss.item() == pytest.approx(sum(coeffs), abs=1e-5)


def test_seq_aux_loss_in_the_moe_layer_sees_sequence_boundaries(host):
    cfg = tiny_model_config(num_experts=4, top_k=2)
    router = host.create("router", "topk", {"load_balancing_type": ["aux_loss", "seq_aux_loss"]}, cfg)
    layer = MoELayer(router, host.create("dispatcher", "alltoall", {}, cfg, None),
                     host.create("experts", "grouped", {}, cfg, 4))
    x_BSD = torch.randn(3, 5, 16)
    _, aux, _ = layer(x_BSD)
    logits = x_BSD.reshape(-1, 16) @ router.weight.detach().t()
    s_TE = torch.softmax(logits, -1)
    ids = s_TE.topk(2)[1]
    per_seq = [R.switch_aux_loss(s_TE[b * 5:(b + 1) * 5], R.expert_counts(ids[b * 5:(b + 1) * 5], 4), 5, 2)
               for b in range(3)]
    whole = R.switch_aux_loss(s_TE, R.expert_counts(ids, 4), 15, 2)
    coeff = cfg.moe.aux_loss_coeff
    torch.testing.assert_close(aux.detach(), coeff * (whole + sum(per_seq) / 3))


@pytest.mark.parametrize("opts", [{"load_balancing_type": t} for t in AUX_TYPES] + [
    {"load_balancing_type": "none", "z_loss_coeff": 1e-3}])
def test_aux_and_z_losses_reach_the_gate_when_main_loss_gradient_is_zero(host, opts):
    router = _router(host, opts)
    out = router(torch.randn(20, 16), num_sequences=2)
    main = (out.probs_TK * 0.0).sum()  # main loss with zero gradient
    (main + out.aux_loss).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_z_loss_value_and_logging(host):
    router = _router(host, {"load_balancing_type": "none", "z_loss_coeff": 0.1})
    x_TD = torch.randn(9, 16)
    out = router(x_TD)
    z = torch.logsumexp(x_TD @ router.weight.detach().t(), -1).square().mean()
    torch.testing.assert_close(out.losses["z_loss"], z)
    torch.testing.assert_close(out.aux_loss.detach(), 0.1 * z)


def test_global_aux_loss_accumulates_over_micro_batches_and_resets_per_step(host):
    router = _router(host, {"load_balancing_type": "global_aux_loss", "aux_loss_coeff": 1.0})
    plain = _router(host, {"load_balancing_type": "aux_loss", "aux_loss_coeff": 1.0})
    plain.load_state_dict(router.state_dict())
    x1, x2 = torch.randn(10, 16), torch.randn(6, 16)

    def counts(x):
        return R.expert_counts(torch.softmax(x @ router.weight.detach().t(), -1).topk(2)[1], 4)

    first = router(x1).losses["global_aux_loss"]
    torch.testing.assert_close(first, plain(x1).losses["aux_loss"])  # one micro-batch: == aux
    second = router(x2).losses["global_aux_loss"]
    s2 = torch.softmax(x2 @ router.weight.detach().t(), -1)
    torch.testing.assert_close(second, R.switch_aux_loss(s2, counts(x1) + counts(x2), 16, 2))
    assert int(router.global_tokens) == 16
    with torch.no_grad():  # evaluation / recompute under no_grad does not accumulate
        router(x1)
    assert int(router.global_tokens) == 16
    router.finalize_step()
    assert int(router.global_tokens) == 0 and int(router.global_counts_E.sum()) == 0
    torch.testing.assert_close(router(x2).losses["global_aux_loss"], plain(x2).losses["aux_loss"])


def _global_aux_over_dp(rank: int, world: int) -> dict:
    """Each rank routes its own micro-batches (DP); the global aux loss's f_i is the counts of
    every rank's micro-batches so far, P_i this rank's (Megatron reduces n_i over TP x DP x CP)."""
    import torch.distributed as dist
    from moeplug.plugin_host import PluginHost
    out = {}
    for fused in (True, False):
        torch.manual_seed(0)  # the same router weight on every rank
        router = _router(PluginHost.load(), {"load_balancing_type": "global_aux_loss",
                                             "aux_loss_coeff": 1.0, "fused": fused})
        gen = torch.Generator().manual_seed(5)
        xs = [[torch.randn(n, 16, generator=gen) for n in (10, 6)] for _ in range(world)]

        def counts(x):
            return R.expert_counts(torch.softmax(x @ router.weight.detach().t(), -1).topk(2)[1], 4)
        got, want = [], []
        for m in range(2):  # micro-batch m of every rank at once
            got.append(router(xs[rank][m], batch_group=dist.group.WORLD)
                       .losses["global_aux_loss"].item())
            seen = [xs[r][i] for r in range(world) for i in range(m + 1)]
            s_local = torch.softmax(xs[rank][m] @ router.weight.detach().t(), -1)
            want.append(R.switch_aux_loss(s_local, sum(counts(x) for x in seen),
                                          sum(x.shape[0] for x in seen), 2).item())
        out[fused] = (got, want, int(router.global_tokens))
    return out


def test_global_aux_loss_counts_every_data_parallel_rank():
    """Once each rank summed only its own micro-batches' counts, so under DP the 'global' loss
    was each rank's own: not Megatron's."""
    from moeplug.testing.distributed import run_distributed
    for res in run_distributed(_global_aux_over_dp, 2, timeout=120):
        for fused, (got, want, tokens) in res.items():
            assert got == pytest.approx(want, rel=1e-6), (fused, got, want)
            assert tokens == 2 * (10 + 6)


def test_aux_loss_counts_plain_topk_versus_routed(host):
    opts = {"score_function": "sigmoid", "enable_expert_bias": True, "aux_loss_coeff": 1.0}
    plain = _router(host, opts)
    routed = _router(host, {**opts, "aux_loss_counts": "routed"})
    routed.load_state_dict(plain.state_dict())
    for r in (plain, routed):
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # forces expert 3 everywhere
    x_TD = torch.randn(12, 16)
    s_TE = R.aux_scores(x_TD @ plain.weight.detach().t(), "sigmoid")
    out_plain, out_routed = plain(x_TD), routed(x_TD)
    assert (out_routed.ids_TK == 3).any(1).all()
    torch.testing.assert_close(out_plain.losses["aux_loss"],
                               R.switch_aux_loss(s_TE, R.expert_counts(s_TE.topk(2)[1], 4), 12, 2))
    torch.testing.assert_close(out_routed.losses["aux_loss"],
                               R.switch_aux_loss(s_TE, R.expert_counts(out_routed.ids_TK, 4), 12, 2))
    assert not torch.allclose(out_plain.losses["aux_loss"], out_routed.losses["aux_loss"])


# ---- routing options through the router ------------------------------------------------------

def test_deepseek_v3_style_routing_matches_the_pure_functions(host):
    cfg = dict(num_experts=16, top_k=4)
    opts = {"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": 4,
            "group_topk": 2, "topk_scaling_factor": 2.5, "dtype": "fp64"}
    router = _router(host, opts, **cfg)
    router.expert_bias.copy_(torch.randn(16) * 0.1)
    x_TD = torch.randn(21, 16)
    out = router(x_TD)
    logits = x_TD.double() @ router.weight.detach().double().t()
    s = torch.sigmoid(logits)
    ids_ref = R.group_limited_topk(s + router.expert_bias.double(), 4, 4, 2)[1]
    assert torch.equal(out.ids_TK, ids_ref)
    chosen = s.gather(1, ids_ref)
    torch.testing.assert_close(out.probs_TK, (2.5 * chosen / chosen.sum(-1, keepdim=True)).float())
    assert out.probs_TK.dtype == torch.float32 and out.logits_TE.dtype == torch.float32


@pytest.mark.parametrize("fused", [True, False])
def test_input_dtype_routes_on_the_logits_of_a_bf16_gate_under_bf16_autocast(host, fused):
    """router_options.dtype: input (Megatron's moe_router_dtype unset): the gate GEMM in bf16,
    the routing from its fp32 logits; the weight and its grad stay fp32."""
    torch.manual_seed(0)
    router = _router(host, {"dtype": "input", "fused": fused}, num_experts=16, top_k=4)
    x_TD = torch.randn(33, 16, generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x_TD)
    logits = (x_TD.bfloat16() @ router.weight.detach().bfloat16().t()).float()
    assert out.logits_TE.dtype == torch.float32 and torch.equal(out.logits_TE, logits)
    # bf16 logits tie often, and the fused kernel (lower id first) and torch.topk may order
    # tied experts apart: compare the chosen logits and the weights, sorted per token.
    probs, ids = R.topk_routing(logits, 4)
    assert torch.equal(logits.gather(1, out.ids_TK).sort(1).values,
                       logits.gather(1, ids).sort(1).values)
    torch.testing.assert_close(out.probs_TK.sort(1).values, probs.sort(1).values)
    (out.probs_TK.sum() + out.aux_loss).backward()
    assert router.weight.dtype == router.weight.grad.dtype == torch.float32


def test_group_score_option_reaches_the_routing(host):
    # 16 experts, 4 groups, 2 kept, top-6: topk_share sums a group's top 3, top2_sum its top 2.
    cfg = dict(num_experts=16, top_k=6)
    opts = {"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": 4,
            "group_topk": 2, "dtype": "fp64"}
    x_TD = torch.randn(41, 16, generator=torch.Generator().manual_seed(8))
    ids = {}
    for rule in ("topk_share", "top2_sum"):
        torch.manual_seed(0)  # same gate weights for both routers
        router = _router(host, {**opts, "group_score": rule}, **cfg)
        router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 16))
        s = torch.sigmoid(x_TD.double() @ router.weight.detach().double().t())
        ids[rule] = router(x_TD).ids_TK
        ref = R.group_limited_topk(s + router.expert_bias.double(), 6, 4, 2, rule)[1]
        assert torch.equal(ids[rule], ref), rule
    assert not torch.equal(ids["topk_share"], ids["top2_sum"])


def test_readme_documents_the_group_options_with_their_defaults():
    import dataclasses
    from pathlib import Path
    from moeplug_plugins.routers import TopKOptions
    readme = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text(encoding="utf-8")
    defaults = {f.name: f.default for f in dataclasses.fields(TopKOptions)}
    for name in ("num_groups", "group_topk", "group_score", "dtype"):
        assert f"| `router_options.{name}` | `{defaults[name]!r}` |" in readme, name


def test_input_jitter_only_in_training(host):
    router = _router(host, {"input_jitter_eps": 0.5})
    x_TD = torch.randn(64, 16)
    router.eval()
    assert torch.equal(router(x_TD).logits_TE, router(x_TD).logits_TE)
    router.train()
    assert not torch.equal(router(x_TD).logits_TE, router(x_TD).logits_TE)


def test_force_load_balancing_balances_a_skewed_gate(host):
    router = _router(host, {"force_load_balancing": True}, num_experts=8, top_k=2)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 5.0  # without forcing, expert 0 would take every token
    out = router(torch.randn(4096, 16).abs())
    counts = R.expert_counts(out.ids_TK, 8)
    assert (counts - 1024).abs().max() < 110
    assert torch.equal(out.ids_TK, router(torch.randn(4096, 16)).ids_TK)  # repeatable


# ---- expert bias -----------------------------------------------------------------------------

def test_expert_bias_moves_toward_balance(host):
    router = _router(host, {"score_function": "sigmoid", "enable_expert_bias": True,
                            "bias_update_rate": 0.02, "load_balancing_type": "none"},
                     num_experts=8, top_k=2)
    with torch.no_grad():
        router.weight[0] += 0.3  # expert 0 over-loaded
    x_TD = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)).abs()

    def imbalance():
        with torch.no_grad():
            c = R.expert_counts(router(x_TD).ids_TK, 8).float()
        return (c.max() / c.mean()).item()

    before = imbalance()
    router(x_TD)
    assert int(router.step_counts_E.sum()) == 256 * 2
    router.finalize_step()
    assert router.expert_bias[0] < 0 and int(router.step_counts_E.sum()) == 0
    for _ in range(60):
        router(x_TD)
        router.finalize_step()
    assert imbalance() < before - 0.5, (before, imbalance())
    assert "expert_bias" in router.state_dict()  # saved with checkpoints


def test_model_finalize_step_updates_every_router(host):
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    cfg = config_from_dict({
        "model": {"hidden_size": 16, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1,
                  "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}},
        "plugins": {"router_options": {"score_function": "sigmoid", "enable_expert_bias": True,
                                       "bias_update_rate": 0.1}},
        "train": {"seq_len": 8}})
    model = build_model(cfg, host, vocab_size=32)
    tokens = torch.randint(0, 32, (2, 8))
    model(tokens, tokens).loss.backward()
    model.finalize_step()
    routers = [b.ffn.router for b in model.blocks[1:]]
    assert len(routers) == 2
    for r in routers:
        assert r.expert_bias.abs().sum() > 0 and int(r.step_counts_E.sum()) == 0


# ---- capacity, dropping and padding through the dispatchers and whole MoE layers --------------

def _layer(host, router_opts, dispatcher, experts="grouped", E=4, K=2, seed=0):
    cfg = tiny_model_config(num_experts=E, top_k=K)
    torch.manual_seed(seed)
    router = host.create("router", "topk", router_opts, cfg)
    layer = MoELayer(router, host.create("dispatcher", dispatcher, {}, cfg, None),
                     host.create("experts", experts, {}, cfg, E))
    return layer


def _run(layer, x_BSD):
    x = x_BSD.clone().requires_grad_()
    y, aux, counts = layer(x)
    ((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    return y.detach(), x.grad, grads, counts


def _same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-5, atol=1e-6, msg=n)


def _reference_drop_layer(layer, x_BSD):
    """The same layer with every choice computed but the dropped ones weighted 0: what a
    dispatcher that ignores ``dropped_TK`` computes."""
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    r = layer.router(x_TD, num_sequences=x_BSD.shape[0])
    from dataclasses import replace
    d = layer.dispatcher.dispatch(x_TD, replace(r, dropped_TK=None, capacity=None))
    return layer.dispatcher.combine(layer.experts(d.x_SD, d.probs_S, d.counts_L), d.meta), r


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dropping_and_pad_to_capacity(host, dispatcher, policy):
    x_BSD = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    opts = {"capacity_factor": 0.5, "token_drop_policy": policy}
    drop = _layer(host, opts, dispatcher)
    pad = _layer(host, {**opts, "pad_to_capacity": True}, dispatcher)
    C = R.expert_capacity(18, 2, 4, 0.5)
    x_TD = x_BSD.reshape(-1, 16)
    r = drop.router(x_TD)
    assert r.dropped_TK.any() and r.losses["dropped_fraction"] > 0
    d = drop.dispatcher.dispatch(x_TD, r)
    assert (d.counts_L <= C).all() and int(d.counts_L.sum()) == int((~r.dropped_TK).sum())
    dp = pad.dispatcher.dispatch(x_TD, pad.router(x_TD))
    assert dp.counts_L.tolist() == [C] * 4 and dp.x_SD.shape[0] == 4 * C
    # drop+pad == drop == the dense computation with dropped weights 0 (outputs and grads).
    a, b = _run(drop, x_BSD), _run(pad, x_BSD)
    _same(a, b)
    y_ref, r = _reference_drop_layer(drop, x_BSD)
    torch.testing.assert_close(a[0].reshape(-1, 16), y_ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(a[3], R.expert_counts(r.ids_TK, 4, ~r.dropped_TK))  # dropped not counted


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("experts", ["grouped", "sequential"])
@pytest.mark.parametrize("multiple", [16, 32])
def test_padding_for_quantization_leaves_outputs_and_gradients_unchanged(host, dispatcher, experts,
                                                                         multiple):
    x_BSD = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(2))
    off = _layer(host, {}, dispatcher, experts)
    on = _layer(host, {"padding_for_quantization": multiple}, dispatcher, experts)
    x_TD = x_BSD.reshape(-1, 16)
    d = on.dispatcher.dispatch(x_TD, on.router(x_TD))
    assert (d.counts_L % multiple == 0).all() and int(d.counts_L.sum()) > 22 * 2
    _same(_run(off, x_BSD), _run(on, x_BSD))


def test_padding_also_works_together_with_dropping(host):
    x_BSD = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(3))
    a = _run(_layer(host, {"capacity_factor": 0.75}, "alltoall"), x_BSD)
    b = _run(_layer(host, {"capacity_factor": 0.75, "padding_for_quantization": 16}, "alltoall"), x_BSD)
    _same(a, b)


# ---- edge sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("E, K, opts", [
    (1, 1, {}),
    (256, 8, {"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": 8,
              "group_topk": 4, "load_balancing_type": AUX_TYPES}),
    (16, 2, {"capacity_factor": 1.0, "pad_to_capacity": True}),
])
def test_edge_sizes_run_through_a_whole_layer(host, E, K, opts):
    layer = _layer(host, opts, "alltoall", E=E, K=K)
    y, x_grad, grads, counts = _run(layer, torch.randn(2, 4, 16))
    assert torch.isfinite(y).all() and torch.isfinite(x_grad).all()
    assert int(counts.sum()) <= 8 * K and len(counts) == E


def test_zero_token_experts_and_zero_tokens(host):
    layer = _layer(host, {"padding_for_quantization": 16}, "allgather", E=8, K=1)
    _, _, _, counts = _run(layer, torch.randn(1, 3, 16))
    assert (counts == 0).sum() >= 5
    out = layer.router(torch.randn(0, 16))
    assert out.ids_TK.shape == (0, 1) and out.aux_loss.item() == 0.0


# ---- public contract ---------------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    {},
    {"renormalize": False, "topk_scaling_factor": 2.0},
    {"score_function": "sigmoid", "num_groups": 2, "group_topk": 1},
    {"score_function": "sqrtsoftplus", "load_balancing_type": ["aux_loss", "seq_aux_loss"],
     "aux_loss_coeff": [1e-2, 1e-3], "z_loss_coeff": 1e-3, "dtype": "fp64"},
    {"dtype": "input"},
    {"capacity_factor": 1.0, "token_drop_policy": "position", "pad_to_capacity": True},
    {"padding_for_quantization": 16, "aux_loss_counts": "routed"},
    {"force_load_balancing": True},
])
def test_router_contract_for_option_sets(host, options):
    check_router(host, "topk", options=options)
