"""Experts and layers: activations, probs-on-input, shared experts, the MoE layer pattern.

Legend: T tokens, D hidden, K top-k, E experts, F expert FFN hidden, X = FC1 features
(2F gated, F plain), S routed rows, L local experts.

Every backend is compared with the other (sequential vs grouped: outputs and all gradients) and
with formulas written out here per token, independent of moeplug.ops.activations.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeplug.config import ACTIVATIONS, ConfigError, ModelConfig, MoEConfig, RootConfig, TrainConfig
from moeplug.interfaces import Router, RouterOutput
from moeplug.build import build_model
from moeplug.modules import MoELayer
from moeplug.modules.mlp import SwiGLUMLP
from moeplug.moe.shared_experts import SharedExperts
from moeplug.ops.activations import activation_fn
from moeplug.ops.grouped_ffn import grouped_mlp
from moeplug.plugin_host import PluginHost

HOST = PluginHost.load()
VOCAB = 40


def model_cfg(D=16, E=4, K=2, F=8, activation="swiglu", num_layers=1, first_k_dense=0, **moe_kw):
    moe = MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F, activation=activation, **moe_kw)
    return ModelConfig(hidden_size=D, num_heads=4, num_kv_heads=2, num_layers=num_layers,
                       first_k_dense=first_k_dense, dense_ffn_hidden_size=24, max_seq_len=16,
                       init_std=0.3, moe=moe)


# -- independent per-token reference -------------------------------------------------------------

def ref_act(name: str, h: torch.Tensor) -> torch.Tensor:
    """Activations from their textbook definitions (no torch.nn.functional)."""
    gelu = lambda z: 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))  # noqa: E731
    silu = lambda z: z / (1.0 + torch.exp(-z))  # noqa: E731
    if name in ("swiglu", "geglu"):
        half = h.shape[-1] // 2
        g, u = h[..., :half], h[..., half:]
        return (silu(g) if name == "swiglu" else gelu(g)) * u
    if name == "gelu":
        return gelu(h)
    assert name == "squared_relu"
    return torch.where(h > 0, h * h, torch.zeros_like(h))


def ref_moe(x_TD, ids_TK, probs_TK, w1_EXD, w2_EDF, activation, probs_on_input=False):
    """y_t = sum_k p_tk FC2_e(act(FC1_e x_t)), or FC2_e(act(FC1_e(p_t x_t))) on input: a loop."""
    rows = []
    for t in range(x_TD.shape[0]):
        y = torch.zeros_like(x_TD[t])
        for k in range(ids_TK.shape[1]):
            e, p = int(ids_TK[t, k]), probs_TK[t, k]
            if probs_on_input:
                y = y + w2_EDF[e] @ ref_act(activation, w1_EXD[e] @ (p * x_TD[t]))
            else:
                y = y + p * (w2_EDF[e] @ ref_act(activation, w1_EXD[e] @ x_TD[t]))
        rows.append(y)
    return torch.stack(rows)


class FixedRouter(Router):
    """A real Router that returns given choices: forces zero-token experts and exact layouts."""

    accepts_num_sequences = False

    def __init__(self, ids_TK, probs_TK, num_experts):
        super().__init__()
        self.num_experts, self.top_k = num_experts, ids_TK.shape[1]
        self.ids_TK = ids_TK
        self.probs_TK = torch.nn.Parameter(probs_TK.clone())  # so probs get a gradient too

    def forward(self, x_TD):
        return RouterOutput(self.probs_TK, self.ids_TK, torch.zeros(()))


def make_layer(cfg, experts_name, router=None, shared=None, dispatcher="alltoall"):
    router = router or HOST.create("router", "topk", {}, cfg)
    d = HOST.create("dispatcher", dispatcher, {}, cfg, None)
    experts = HOST.create("experts", experts_name, {}, cfg, d.num_local_experts)
    return MoELayer(router, d, experts, shared, apply_probs_on_input=cfg.moe.apply_probs_on_input)


def pair(cfg, router_factory=None):
    """(sequential layer, grouped layer) with identical weights."""
    torch.manual_seed(0)
    seq = make_layer(cfg, "sequential", router_factory() if router_factory else None)
    torch.manual_seed(0)
    grp = make_layer(cfg, "grouped", router_factory() if router_factory else None)
    grp.load_state_dict(seq.state_dict())
    return seq, grp


def run(layer, x_TD):
    x = x_TD.clone().requires_grad_()
    y, aux, counts = layer(x)
    # A loss whose gradient differs per element, so a transposed/misplaced grad shows.
    w = torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape)
    ((y * w).sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), x.grad, grads, counts


def assert_same(a, b, atol=1e-5):
    ya, xa, ga, ca = a
    yb, xb, gb, cb = b
    torch.testing.assert_close(ya, yb, atol=atol, rtol=1e-4)
    torch.testing.assert_close(xa, xb, atol=atol, rtol=1e-4)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=atol, rtol=1e-4, msg=n)
    assert torch.equal(ca, cb)


# -- activations ----------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_matches_textbook_formula(activation):
    X = 16 if activation in ("swiglu", "geglu") else 8
    h = torch.randn(5, X, dtype=torch.float64) * 2
    torch.testing.assert_close(activation_fn(activation)(h), ref_act(activation, h))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_expert_param_shapes_follow_activation(activation):
    cfg = model_cfg(D=16, F=8, activation=activation)
    for name in ("sequential", "grouped"):
        ex = HOST.create("experts", name, {}, cfg, 3)
        X = 16 if activation in ("swiglu", "geglu") else 8
        assert tuple(ex.gate_up_proj.shape) == (3, X, 16)
        assert tuple(ex.down_proj.shape) == (3, 16, 8)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_sequential_equals_grouped_and_reference(activation):
    cfg = model_cfg(D=16, E=4, K=2, F=8, activation=activation)
    seq, grp = pair(cfg)
    x_TD = torch.randn(24, 16)
    a, b = run(seq, x_TD), run(grp, x_TD)
    assert_same(a, b)
    # Against the per-token loop, with the router's own choices.
    with torch.no_grad():
        r = seq.router(x_TD)
        y_ref = ref_moe(x_TD, r.ids_TK, r.probs_TK, seq.experts.gate_up_proj,
                        seq.experts.down_proj, activation)
    torch.testing.assert_close(a[0], y_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("activation", ["geglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("backend", ["sequential", "grouped"])
def test_public_experts_contract_for_every_activation(backend, activation):
    """moeplug.testing.check_experts (what third-party backends run) covers each activation."""
    from moeplug.testing import check_experts
    check_experts(HOST, backend, model_cfg=model_cfg(activation=activation))


def test_public_experts_contract_catches_a_backend_that_ignores_the_activation():
    from moeplug.testing import ContractError, check_experts

    def wrong_activation(model, options, num_local_experts):
        ex = HOST.create("experts", "grouped", {}, model, num_local_experts)
        ex.activation = "gelu"  # same [L, F, D] shapes as squared_relu, different math
        return ex
    with pytest.raises(ContractError, match="output differs from the reference"):
        check_experts(wrong_activation, model_cfg=model_cfg(activation="squared_relu"))


@pytest.mark.parametrize("activation", ["geglu", "gelu", "squared_relu"])
def test_grouped_mlp_gradients_by_finite_differences(activation):
    torch.manual_seed(0)
    X, Fh = (8, 4) if activation == "geglu" else (4, 4)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    p = torch.rand(7, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(3, X, 5, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 5, Fh, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 4])  # a zero-row expert in the middle
    assert torch.autograd.gradcheck(lambda *a: grouped_mlp(*a[:2], counts, *a[2:], activation),
                                    (x, p, w1, w2))


def test_grouped_mlp_under_bf16_autocast_keeps_fp32_grads():
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w1 = torch.randn(2, 4, 8, requires_grad=True)
    w2 = torch.randn(2, 8, 4, requires_grad=True)
    counts = torch.tensor([2, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mlp(x, None, counts, w1, w2, "squared_relu")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == w1.grad.dtype == w2.grad.dtype == torch.float32
    y32 = grouped_mlp(x, None, counts, w1, w2, "squared_relu")
    torch.testing.assert_close(y.float(), y32, atol=0.1 * y32.abs().max().item(), rtol=0.05)


# -- probs on input -------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_apply_probs_on_input_matches_its_formula(activation):
    cfg = model_cfg(E=4, K=1, activation=activation, apply_probs_on_input=True)
    seq, grp = pair(cfg)
    x_TD = torch.randn(20, 16)
    a, b = run(seq, x_TD), run(grp, x_TD)
    assert_same(a, b)
    with torch.no_grad():
        r = seq.router(x_TD)
        assert (r.probs_TK < 0.999).all()  # top-1 pre-softmax: p < 1, so on-input matters
        y_on = ref_moe(x_TD, r.ids_TK, r.probs_TK, seq.experts.gate_up_proj,
                       seq.experts.down_proj, activation, probs_on_input=True)
        y_after = ref_moe(x_TD, r.ids_TK, r.probs_TK, seq.experts.gate_up_proj,
                          seq.experts.down_proj, activation)
    torch.testing.assert_close(a[0], y_on, atol=1e-5, rtol=1e-4)
    # The two semantics differ for these nonlinear activations.
    assert (a[0] - y_after).abs().max() > 1e-4


def test_probs_on_input_linear_check():
    """squared_relu is 2-homogeneous: act(p h) = p^2 act(h), so on-input = p * probs-after,
    exactly; and with p = 1 both semantics coincide."""
    x_TD = torch.randn(20, 16)
    outs = {}
    for on_input in (False, True):
        cfg = model_cfg(E=4, K=1, activation="squared_relu", apply_probs_on_input=on_input)
        torch.manual_seed(0)
        layer = make_layer(cfg, "grouped")
        outs[on_input] = layer(x_TD)[0].detach()
        p_T1 = layer.router(x_TD).probs_TK.detach()
    torch.testing.assert_close(outs[True], p_T1 * outs[False], atol=1e-6, rtol=1e-5)

    ids = torch.randint(0, 4, (20, 1), generator=torch.Generator().manual_seed(3))
    for on_input in (False, True):
        cfg = model_cfg(E=4, K=1, activation="gelu", apply_probs_on_input=on_input)
        torch.manual_seed(0)
        outs[on_input] = make_layer(cfg, "grouped",
                                    FixedRouter(ids, torch.ones(20, 1), 4))(x_TD)[0].detach()
    torch.testing.assert_close(outs[True], outs[False])


# -- shared experts -------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("gate", [False, True])
def test_shared_expert_matches_formula(activation, gate):
    cfg = model_cfg(activation=activation, shared_expert_ffn_hidden_size=12,
                    shared_expert_gate=gate)
    torch.manual_seed(0)
    shared = SharedExperts(16, cfg.moe)
    for p in shared.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = make_layer(cfg, "grouped", shared=shared)
    x_BSD = torch.randn(2, 5, 16)
    y, _, _ = layer(x_BSD)
    # Routed part: the same layer without the shared module.
    routed = MoELayer(layer.router, layer.dispatcher, layer.experts)(x_BSD)[0]
    x = x_BSD.reshape(-1, 16)
    up = x @ shared.up_proj.weight.t()
    if activation == "swiglu":
        assert tuple(shared.gate_proj.weight.shape) == (12, 16)
        g = x @ shared.gate_proj.weight.t()
        s = (g / (1 + torch.exp(-g)) * up) @ shared.down_proj.weight.t()
    else:
        assert shared.gate_proj is None
        s = (0.5 * up * (1 + torch.erf(up / math.sqrt(2)))) @ shared.down_proj.weight.t()
    if gate:
        assert tuple(shared.output_gate.weight.shape) == (1, 16)
        s = s / (1 + torch.exp(-(x @ shared.output_gate.weight.t())))
    else:
        assert shared.output_gate is None
    torch.testing.assert_close(y, routed + s.reshape(2, 5, 16), atol=1e-5, rtol=1e-4)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.parameters())


def test_build_model_adds_shared_experts_to_every_moe_layer():
    cfg = RootConfig(model=model_cfg(num_layers=3, first_k_dense=1,
                                     shared_expert_ffn_hidden_size=12, shared_expert_gate=True),
                     train=TrainConfig(seq_len=8, warmup_steps=0))
    model = build_model(cfg, HOST, VOCAB)
    moe = [b.ffn for b in model.blocks if isinstance(b.ffn, MoELayer)]
    assert len(moe) == 2 and all(isinstance(m.shared, SharedExperts) for m in moe)
    assert "blocks.1.ffn.shared.output_gate.weight" in model.state_dict()
    out = model(torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8)))
    out.loss.backward()
    assert moe[0].shared.up_proj.weight.grad.abs().sum() > 0


# -- layer pattern (its FLOPs count: tests/test_flops.py) ----------------------------------------

@pytest.mark.parametrize("num_layers, first_k, freq, want", [
    (4, 0, 1, [1, 1, 1, 1]),
    (5, 0, 2, [1, 0, 1, 0, 1]),
    (6, 0, 3, [1, 0, 0, 1, 0, 0]),
    (5, 1, 2, [0, 0, 1, 0, 1]),
    (4, 0, [0, 1, 1, 0], [0, 1, 1, 0]),
    (4, 2, [1, 1, 0, 1], [0, 0, 0, 1]),
    (3, 3, 1, [0, 0, 0]),
])
def test_layer_pattern_builds_the_right_layers(num_layers, first_k, freq, want):
    cfg = RootConfig(model=model_cfg(num_layers=num_layers, first_k_dense=first_k,
                                     layer_freq=freq),
                     train=TrainConfig(seq_len=8, warmup_steps=0))
    assert list(cfg.model.moe_layer_pattern) == [bool(v) for v in want]
    model = build_model(cfg, HOST, VOCAB)
    kinds = [1 if isinstance(b.ffn, MoELayer) else 0 for b in model.blocks]
    assert kinds == want
    assert all(isinstance(b.ffn, SwiGLUMLP) for b, k in zip(model.blocks, kinds) if not k)
    out = model(torch.randint(0, VOCAB, (1, 8)))
    assert len(out.expert_counts) == sum(want)


# -- edge cases through the whole MoE layer -------------------------------------------------------

@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_zero_token_experts(activation):
    T, E = 10, 6
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randint(0, 2, (T,), generator=g),
                       torch.randint(4, 6, (T,), generator=g)], 1)  # experts 2, 3 get nothing
    probs = torch.rand(T, 2, generator=g)
    cfg = model_cfg(E=E, K=2, activation=activation)
    seq, grp = pair(cfg, lambda: FixedRouter(ids, probs, E))
    x_TD = torch.randn(T, 16)
    a, b = run(seq, x_TD), run(grp, x_TD)
    assert_same(a, b)
    assert a[3].tolist()[2:4] == [0, 0]
    for grads in (a[2], b[2]):
        assert grads["experts.gate_up_proj"][2:4].abs().sum() == 0
        assert grads["experts.down_proj"][2:4].abs().sum() == 0
    y_ref = ref_moe(x_TD, ids, probs, seq.experts.gate_up_proj.detach(),
                    seq.experts.down_proj.detach(), activation)
    torch.testing.assert_close(a[0], y_ref, atol=1e-5, rtol=1e-4)
    # Router weight gradient: d loss / d p_tk reaches the router through the experts.
    torch.testing.assert_close(a[2]["router.probs_TK"], b[2]["router.probs_TK"],
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("E, K, activation", [(1, 1, "geglu"), (1, 1, "swiglu"),
                                              (256, 4, "gelu"), (256, 2, "swiglu")])
def test_one_expert_and_256_experts(E, K, activation):
    cfg = model_cfg(D=8, E=E, K=K, F=4, activation=activation)
    seq, grp = pair(cfg)
    x_TD = torch.randn(40, 8)
    a, b = run(seq, x_TD), run(grp, x_TD)
    assert_same(a, b)
    assert int(a[3].sum()) == 40 * K
    with torch.no_grad():
        r = seq.router(x_TD)
        y_ref = ref_moe(x_TD, r.ids_TK, r.probs_TK, seq.experts.gate_up_proj,
                        seq.experts.down_proj, activation)
    torch.testing.assert_close(a[0], y_ref, atol=1e-5, rtol=1e-4)


# -- errors ---------------------------------------------------------------------------------------

def assert_names(err, *parts):
    msg = str(err.value)
    for part in parts:
        assert part in msg, f"{part!r} not in: {msg}"
    assert "Fix:" in msg


@pytest.mark.parametrize("kwargs, parts", [
    ({"activation": "relu"}, ["MoEConfig.activation", "'relu'", "'squared_relu'"]),
    ({"top_k": 2, "apply_probs_on_input": True},
     ["apply_probs_on_input", "top_k = 2", "top_k: 1"]),
    ({"apply_probs_on_input": "yes"}, ["apply_probs_on_input", "'yes'", "boolean"]),
    ({"shared_expert_gate": True}, ["shared_expert_gate", "shared_expert_ffn_hidden_size = 0"]),
    ({"shared_expert_gate": 1, "shared_expert_ffn_hidden_size": 4},
     ["shared_expert_gate", "boolean"]),
    ({"shared_expert_ffn_hidden_size": -8}, ["shared_expert_ffn_hidden_size", "-8", ">= 0"]),
    ({"shared_expert_ffn_hidden_size": 2.5}, ["shared_expert_ffn_hidden_size", "2.5", "integer"]),
    ({"layer_freq": 0}, ["layer_freq", "0", ">= 1"]),
    ({"layer_freq": "2"}, ["layer_freq", "'2'", "must be an integer or a list"]),
    ({"layer_freq": True}, ["layer_freq", "True", "must be an integer or a list"]),
    ({"layer_freq": [1, 2]}, ["layer_freq", "[1, 2]", "0 (dense) or 1 (MoE)"]),
])
def test_moe_config_errors(kwargs, parts):
    kwargs = {"top_k": 1, **kwargs}
    with pytest.raises(ConfigError) as err:
        MoEConfig(num_experts=4, **kwargs)
    assert_names(err, *parts)


def test_layer_freq_list_length_must_match_num_layers():
    with pytest.raises(ConfigError) as err:
        ModelConfig(num_layers=3, moe=MoEConfig(layer_freq=[1, 0]))
    assert_names(err, "MoEConfig.layer_freq", "[1, 0]", "2 entries", "num_layers = 3")


def test_layer_freq_from_yaml_overrides():
    from moeplug.config import load_config
    cfg = load_config(None, ["model.num_layers=3", "model.first_k_dense=0",
                             "model.moe.layer_freq=[0, 1, 1]"])
    assert cfg.model.moe_layer_pattern == (False, True, True)


def test_moe_layer_rejects_probs_on_input_with_top2_router():
    cfg = model_cfg(K=2)
    d = HOST.create("dispatcher", "alltoall", {}, cfg, None)
    with pytest.raises(ValueError) as err:
        MoELayer(HOST.create("router", "topk", {}, cfg), d,
                 HOST.create("experts", "grouped", {}, cfg, 4), apply_probs_on_input=True)
    assert_names(err, "apply_probs_on_input", "router.top_k = 2", "top_k=1")


def test_shared_experts_need_a_size():
    with pytest.raises(ValueError) as err:
        SharedExperts(16, MoEConfig())
    assert_names(err, "shared_expert_ffn_hidden_size = 0", "only when it is > 0")


def test_unknown_activation_function():
    with pytest.raises(ValueError) as err:
        activation_fn("tanh")
    assert_names(err, "'tanh'", "'gelu'")


def test_grouped_mlp_shape_errors():
    x = torch.randn(5, 8)
    w1, w2 = torch.randn(2, 4, 8), torch.randn(2, 8, 4)
    c = torch.tensor([2, 3])
    with pytest.raises(ValueError) as err:
        grouped_mlp(x[0], None, c, w1, w2, "gelu")
    assert_names(err, "x_SD [S, D]", "(8,)")
    with pytest.raises(ValueError) as err:
        grouped_mlp(x, None, c, w1, w2, "geglu")  # gated: wants 2F = 8 rows
    assert_names(err, "'geglu'", "[L, 8, 8]", "(2, 4, 8)", "same activation")
    with pytest.raises(ValueError) as err:
        grouped_mlp(x, None, torch.tensor([2, 2]), w1, w2, "gelu")
    assert_names(err, "counts_L = [2, 2]", "S = 5", "Dispatched.counts_L")
    with pytest.raises(ValueError) as err:
        grouped_mlp(x, torch.ones(4), c, w1, w2, "gelu")
    assert_names(err, "probs_S", "(5,)", "(4,)")
