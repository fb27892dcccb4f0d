"""Sync-free MoE (runtime.sync_free) and its capture/replay (runtime.capture).

Proofs:
  * the host-sync counter counts every kind of sync it claims to (each inserted into a tiny
    computation), and counts the dynamic MoE layer's syncs; the static layer's forward and
    backward read zero, in its eager CPU form (moeplug.moe.budgeted.arena) and as the pure
    pieces capture compiles, and a sync slipped into either is counted;
  * static (eager) equals the dynamic layer: outputs and grads, fp32, tolerance 1e-5;
  * replay (torch.compile fullgraph, compiled once) equals eager static, outputs and grads;
  * over budget raises the device flag; a training step over budget reruns on the dynamic path
    and equals the run without sync_free bitwise, the rerun counted;
  * EP2 on real gloo ranks: static eager and replay equal the dynamic alltoall layer;
  * the grouped ops over the routed rows (grouped_rows_mm, grouped_rows_act) equal a GEMM and
    the activation per group, eager and compiled with fullgraph.
The eager CPU form against the pure pieces, op for op: tests/test_static_arena.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeplug.config import ConfigError, RootConfig, config_from_dict
from moeplug.build import build_model
from moeplug.moe import MoELayer
from moeplug.moe.budgeted.slots import budget_rows, slots
from moeplug.plugin_host import PluginHost
from moeplug.testing.hostsync import HostSyncCounter
from moeplug.testing.cli import run_cli
from moeplug.testing.steps import runtime_cfg as _cfg
from moeplug.testing.steps import train_ep2_variants
from moeplug.training.optim import build_optimizer
from moeplug.training.trainer import stash_runtime, train_step

VOCAB = 64
TOL = 1e-5  # fp32; static and dynamic sum the same products in another order


def _moe_layers(model) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _layer(**runtime) -> MoELayer:
    torch.manual_seed(0)
    return _moe_layers(build_model(_cfg(**runtime), PluginHost.load(), VOCAB))[0]


def _fwd_bwd(layer: MoELayer, x: torch.Tensor, w: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y, aux, counts = layer(x)
    ((y * w).sum() + aux).backward()
    return {"y": y.detach(), "x.grad": x.grad, "counts": counts,
            **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def _close(a: dict, b: dict, tol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "counts":
            assert torch.equal(a[k].cpu(), b[k].cpu()), k
        else:
            assert torch.allclose(a[k], b[k], atol=tol, rtol=0), (k, (a[k] - b[k]).abs().max())


def _inputs(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)


# ---- the counter --------------------------------------------------------------------------

SYNCS = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "to_cpu": lambda t: t.to("cpu"),
    "int": lambda t: int(t.sum()),
    "bool": lambda t: bool((t > 0).any()),
    "nonzero": lambda t: torch.nonzero(t > 0),
    "bool_mask": lambda t: t[t > 0],
    "masked_select": lambda t: t.masked_select(t > 0),
    "bincount": lambda t: torch.bincount(t.long().abs().reshape(-1)),
    "repeat_interleave": lambda t: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])),
    "unique": lambda t: torch.unique(t),
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_counter_counts_an_inserted_sync(name):
    t = torch.randn(4, 3)
    with HostSyncCounter() as c:
        torch.tanh(t).sum(0)  # sync-free ops around it count nothing
        SYNCS[name](t)
        t * 2
    assert c.count >= 1, name


def test_counter_reads_zero_on_static_ops_and_counts_a_sync_inside_backward():
    t = torch.randn(8, 4, requires_grad=True)
    with HostSyncCounter() as c:
        torch.sort(t, dim=0, stable=True).values.sum().backward()
    assert c.count == 0, c.calls

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            g.abs().max().item()  # a host read inside backward, made from C++ autograd
            return g

    with HostSyncCounter() as c:
        ReadsInBackward.apply(t).sum().backward()
    assert c.count == 1, c.calls


def test_dynamic_layer_syncs_and_static_layer_reads_zero():
    x, w = _inputs()
    with HostSyncCounter() as dynamic:
        _fwd_bwd(_layer(), x, w)
    assert dynamic.count > 0  # the counter sees the existing path's count exchange etc.
    for runtime in ({}, {"stash": True}):  # the stash's page bookkeeping is host-only
        layer = _layer(sync_free=True, **runtime)
        with HostSyncCounter() as static:
            _fwd_bwd(layer, x, w)
        assert static.count == 0, (runtime, static.calls)
    assert stash_runtime_of(layer).pool.stats()["high_water"] > 0  # the stash was used


@pytest.mark.parametrize("form", ["arena", "pure"])
def test_static_layer_with_syncs_inserted_is_counted(monkeypatch, form):
    # The same static stages with one .tolist() slipped in: into stage 1 of the layer's eager
    # CPU form (budgeted.arena), or into the combine of the pure pieces (what capture and a GPU
    # run), called eagerly on the layer's own routing and weights.
    from moeplug.moe.budgeted import arena, slots as pure
    module, name = ((arena, "_budget_slots") if form == "arena" else (pure, "combine_rows"))
    real = getattr(module, name)

    def leaky(*args, **kwargs):
        args[0].tolist()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, leaky)
    x, w = _inputs()
    layer = _layer(sync_free=True)
    with HostSyncCounter() as c:
        if form == "arena":
            _fwd_bwd(layer, x, w)
        else:
            _pure_fwd_bwd(layer, x, w, stash_scope=None)
    assert c.calls == ["tolist"]


def _pure_fwd_bwd(layer: MoELayer, x: torch.Tensor, w: torch.Tensor, stash_scope) -> None:
    """The layer's static stages as the pure pieces, eager (``wrap`` = identity): capture's
    one_rank, or with a ``stash_scope`` piece by piece (its dispatcher's pure form, the experts
    inside the scope)."""
    from moeplug.moe.capture import one_rank
    x_TD = x.reshape(-1, x.shape[-1]).clone().requires_grad_(True)
    routing = layer.router(x_TD)
    budgeted = layer.budgeted
    if stash_scope is None:
        y_TD, _, _ = one_rank(x_TD, routing.ids_TK, routing.dropped_TK, routing.probs_TK,
                              budgeted, layer.experts_call, budgeted.budget(*routing.ids_TK.shape),
                              True, False, None, *layer.experts.parameters())
    else:
        budgeted.state.arena = False
        try:
            d = budgeted.dispatch(x_TD, routing)
            with stash_scope:
                y_SD = layer.experts_call(d.x_SD, d.probs_S, d.counts_L, d.packed)
            y_TD = budgeted.combine(y_SD, d.meta)
        finally:
            budgeted.state.arena = True
    ((y_TD * w.reshape(y_TD.shape)).sum() + routing.aux_loss).backward()


def test_pure_static_pieces_read_zero_syncs():
    import contextlib
    x, w = _inputs()
    layer = _layer(sync_free=True)
    for scope in (None, contextlib.nullcontext()):
        with HostSyncCounter() as c:
            _pure_fwd_bwd(layer, x, w, stash_scope=scope)
        assert c.count == 0, (scope, c.calls)


# ---- parity -------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", [{}, {"token_budget": 1.5}])
def test_static_equals_dynamic_outputs_and_grads(runtime):
    x, w = _inputs()
    layer = _layer(sync_free=True, **runtime)
    static = _fwd_bwd(layer, x, w)
    assert stash_runtime_of(layer).sync_free.take_overflow().item() is False
    with stash_runtime_of(layer).sync_free.disabled():
        dynamic = _fwd_bwd(layer, x, w)
    _close(static, dynamic)


def stash_runtime_of(layer: MoELayer):
    return layer.runtime.runtime


def test_static_with_router_capacity_and_probs_on_input_equals_dynamic():
    # Choices the router drops (its own capacity) are not flagged as over budget.
    torch.manual_seed(0)
    cfg = config_from_dict({**_cfg(sync_free=True).to_dict(), "plugins": {
        "router_options": {"capacity_factor": 0.5}}})
    layer = _moe_layers(build_model(cfg, PluginHost.load(), VOCAB))[0]
    x, w = _inputs()
    static = _fwd_bwd(layer, x, w)
    assert not bool(stash_runtime_of(layer).sync_free.take_overflow())
    with stash_runtime_of(layer).sync_free.disabled():
        _close(static, _fwd_bwd(layer, x, w))


@pytest.mark.parametrize("stash", [False, True])
def test_static_with_probs_on_input_equals_dynamic(stash):
    # moe.apply_probs_on_input (top-1): the weight rides on the gathered rows, so the layer
    # keeps the pure pieces eagerly (with the stash, the arena form's packed experts).
    torch.manual_seed(0)
    cfg = _cfg(sync_free=True, stash=stash).to_dict()
    cfg["model"]["moe"].update(top_k=1, apply_probs_on_input=True)
    layer = _moe_layers(build_model(config_from_dict(cfg), PluginHost.load(), VOCAB))[0]
    x, w = _inputs()
    static = _fwd_bwd(layer, x, w)
    assert not bool(stash_runtime_of(layer).sync_free.take_overflow())
    if stash:
        assert stash_runtime_of(layer).pool.stats()["high_water"] > 0
    with stash_runtime_of(layer).sync_free.disabled():
        _close(static, _fwd_bwd(layer, x, w))


def _bf16_static_vs_dynamic(layer: MoELayer, x: torch.Tensor, w: torch.Tensor) -> list:
    """Each of (y, x.grad, the experts' and the router's weight grads): the largest difference
    between the static and the dynamic layer under bf16 autocast, over its largest value."""
    def run() -> list:
        xx = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, aux, _ = layer(xx)
        ((y.float() * w).sum() + aux).backward()
        assert y.dtype == torch.bfloat16
        return [y.detach().float(), xx.grad, layer.experts.gate_up_proj.grad.clone(),
                layer.experts.down_proj.grad.clone(), layer.router.weight.grad.clone()]

    static = run()
    with stash_runtime_of(layer).sync_free.disabled():
        dynamic = run()
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(static, dynamic)]


def test_static_equals_dynamic_under_bf16_autocast():
    # bf16 GEMMs in both paths; rows are summed in another order, so the stated tolerance is
    # relative to each tensor's largest value: 2e-2 (measured: at most 8e-3, about two bf16 ulps).
    x, w = _inputs()
    errs = _bf16_static_vs_dynamic(_layer(sync_free=True), x, w)
    assert max(errs) < 2e-2, errs


def test_slots_flag_overflow_only_over_budget():
    ids_TK = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])
    slot_N, over, counts = slots(ids_TK, None, 4, budget=3)
    assert not bool(over) and counts.tolist() == [3, 2, 2, 1]
    assert slot_N.tolist() == [0, 3, 1, 6, 2, 9, 4, 7]  # expert e's k-th choice: e*3 + k
    slot_N, over, counts = slots(ids_TK, None, 4, budget=2)
    assert bool(over) and counts.tolist() == [2, 2, 2, 1]
    assert slot_N.tolist()[4] == 8  # token 2's choice of expert 0 is the third: dump slot
    dropped = torch.tensor([[False, False], [False, False], [True, False], [False, False]])
    assert not bool(slots(ids_TK, dropped, 4, budget=2)[1])  # the router's drop is no overflow
    assert budget_rows(64, 2, 4, 2.0) == 64


def test_packed_slots_put_each_experts_kept_choices_right_after_the_last_experts():
    ids_TK = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])
    slot_N, over, counts = slots(ids_TK, None, 4, budget=3, packed=True)
    assert not bool(over) and counts.tolist() == [3, 2, 2, 1]
    # expert 0 at 0-2, expert 1 at 3-4, expert 2 at 5-6, expert 3 at 7; token order inside
    assert slot_N.tolist() == [0, 3, 1, 5, 2, 7, 4, 6]
    slot_N, over, counts = slots(ids_TK, None, 4, budget=2, packed=True)
    assert bool(over) and counts.tolist() == [2, 2, 2, 1]
    assert slot_N.tolist() == [0, 2, 1, 4, 8, 6, 3, 5]  # over budget: the dump slot E*C
    dropped = torch.tensor([[False, True], [False, False], [True, False], [False, False]])
    slot_N, over, counts = slots(ids_TK, dropped, 4, budget=2, packed=True)
    assert not bool(over) and counts.tolist() == [2, 1, 2, 1]
    assert slot_N.tolist() == [0, 8, 1, 3, 8, 5, 2, 4]
    # EP2: two chunks of L*C = 6 slots (experts 0-1, experts 2-3), each packed from its start
    slot_N, over, counts = slots(ids_TK, None, 4, budget=3, packed=True, ep_size=2)
    assert not bool(over) and counts.tolist() == [3, 2, 2, 1]
    assert slot_N.tolist() == [0, 3, 1, 6, 2, 8, 4, 7]


def _grouped_rows_reference(x_SK, w_GNK, counts_G):
    rows, start = [], 0
    for g, n in enumerate(counts_G.tolist()):
        rows.append(x_SK[start:start + n] @ w_GNK[g].t())
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("K, N", [(32, 24), (30, 18)])
def test_grouped_rows_mm_equals_a_gemm_per_group_and_its_grads(dtype, tol, compiled, K, N):
    # Groups of 5, 0 (an expert without rows: zero weight grad) and 7 rows in a 16-row buffer:
    # the last 4 rows are no group's. fp32 also under torch.compile(fullgraph=True), where
    # torch's own grouped GEMM would not compile. 30 and 18 features: rows whose bytes are no
    # multiple of 16, which torch._grouped_mm refuses (the op pads them with zero features).
    from moeplug.ops.grouped_rows_mm import grouped_rows_mm
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(16, K, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(3, N, K, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(12, N, generator=g).to(dtype)
    op = torch.compile(grouped_rows_mm, fullgraph=True) if compiled else grouped_rows_mm
    y = op(x, w, counts)
    assert y.shape == (16, N) and y.dtype == dtype
    (dy * y[:12]).sum().backward()
    xr, wr = (t.detach().float().requires_grad_(True) for t in (x, w))
    yr = _grouped_rows_reference(xr, wr, counts)
    (dy.float() * yr).sum().backward()
    for got, want in ((y[:12], yr), (x.grad[:12], xr.grad[:12]), (w.grad, wr.grad)):
        err = float((got.detach().float() - want.detach()).abs().max() / want.detach().abs().max())
        assert err < tol, err
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_rows_act_equals_the_activation_on_the_routed_rows(activation, dtype, tol,
                                                                   compiled):
    # 12 routed rows of a 16-row buffer: the op computes (and differentiates) those only.
    # SwiGLU runs the runtime's fused kernel (its fast exp: within 1e-6 of torch in fp32).
    from moeplug.ops.activations import activation_fn, is_gated
    from moeplug.ops.grouped_rows_mm import grouped_rows_act
    g = torch.Generator().manual_seed(0)
    X = 24 if is_gated(activation) else 12
    counts = torch.tensor([5, 0, 7])
    h = torch.randn(16, X, generator=g).to(dtype).requires_grad_(True)
    da = torch.randn(12, X // 2 if is_gated(activation) else X, generator=g).to(dtype)
    if compiled:
        # Every custom op is called through one code object, on which dynamo counts its
        # recompiles (8 at most): this test's 8 cases and the other compiled ops' tests in one
        # worker would pass that, so each case compiles from a clean cache.
        torch._dynamo.reset()
        op = torch.compile(grouped_rows_act, fullgraph=True)
    else:
        op = grouped_rows_act
    a = op(h, counts, activation)
    (da.float() * a[:12].float()).sum().backward()
    hr = h.detach()[:12].float().requires_grad_(True)
    ar = activation_fn(activation)(hr)
    (da.float() * ar).sum().backward()
    for got, want in ((a[:12], ar), (h.grad[:12], hr.grad)):
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err < tol, err


def test_combine_never_reads_an_unwritten_row_into_a_token():
    # Packed slots leave the rows past the routed ones unwritten; the dump slot (dropped or
    # over-budget choices) reads the last row with weight 0, which must stay 0 when that row
    # holds NaN.
    from moeplug.moe.budgeted.slots import combine_rows
    y_ECD = torch.randn(6, 4)
    y_ECD[4:] = float("nan")  # slots 4-5: no choice landed there
    slot_N = torch.tensor([0, 6, 1, 2, 3, 6])  # 6 = E*C: the dump slot
    probs_TK = torch.rand(3, 2)
    y_TD = combine_rows(y_ECD, slot_N, probs_TK)
    want = torch.stack([probs_TK[0, 0] * y_ECD[0], probs_TK[1, 0] * y_ECD[1]
                        + probs_TK[1, 1] * y_ECD[2], probs_TK[2, 0] * y_ECD[3]])
    assert torch.allclose(y_TD, want, atol=1e-6), y_TD


@pytest.mark.slow  # compiling forward and backward takes ~1 min on a loaded 2-core machine
def test_replay_equals_eager_outputs_and_grads():
    from torch._dynamo.utils import counters
    x, w = _inputs()
    eager = _layer(sync_free=True)
    replay = _layer(sync_free=True, capture=True)
    graphs = []
    for step in range(2):  # the second call replays what the first compiled
        _close(_fwd_bwd(replay, x, w), _fwd_bwd(eager, x, w))
        graphs.append(counters["stats"]["unique_graphs"])
        x = x.flip(0)  # new values, same shapes
    assert graphs[0] >= 1 and graphs[1] == graphs[0]  # captured once, not recompiled


# ---- over budget: the rerun ---------------------------------------------------------------

def _train(cfg: RootConfig, steps: int = 2):
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), VOCAB)
    opt = build_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(1)
    history = []
    precision = PluginHost.load().create("precision", "fp32", {})
    for _ in range(steps):
        batches = [(torch.randint(0, VOCAB, (4, 16), generator=gen),
                    torch.randint(0, VOCAB, (4, 16), generator=gen)) for _ in range(2)]
        stats = train_step(model, opt, batches, cfg.train, precision, None)
        history.append((stats, {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}))
    return model, history


def test_over_budget_step_reruns_and_equals_the_run_without_budget():
    off = _train(_cfg())
    tiny = _train(_cfg(sync_free=True, token_budget=0.25))
    for (sa, ga), (sb, gb) in zip(tiny[1], off[1]):
        assert sa.losses() == sb.losses()  # bitwise
        need = sa.sync_free.pop("budget_needed")
        assert sa.sync_free == {"overflows": 1, "reruns": 1}
        assert 0.25 < need <= 4 / 2  # an expert takes at most every token: E/K balanced loads
        for n in gb:
            assert torch.equal(ga[n], gb[n]), n
    for (n, pa), pb in zip(tiny[0].named_parameters(), off[0].parameters()):
        assert torch.equal(pa, pb), n


def test_the_budget_a_rerun_names_is_the_one_that_fits():
    """A rerun names the token_budget that step needed (the largest demand of any layer and
    micro-batch, rounded up to 0.01, Megatron's runner logs the capacity factor likewise):
    that budget runs the same step without a rerun, 0.01 less overflows again."""
    need = _train(_cfg(sync_free=True, token_budget=0.25), steps=1)[1][0][0].sync_free[
        "budget_needed"]
    fits = _train(_cfg(sync_free=True, token_budget=need), steps=1)[1][0][0].sync_free
    assert fits == {"overflows": 0, "reruns": 0}, need
    short = _train(_cfg(sync_free=True, token_budget=need - 0.01), steps=1)[1][0][0].sync_free
    assert short["reruns"] == 1 and short["budget_needed"] == need


def test_within_budget_trains_like_dynamic_without_rerun():
    off = _train(_cfg())
    on = _train(_cfg(sync_free=True, token_budget=2.0))  # C = T: no expert can overflow
    for (sa, ga), (sb, gb) in zip(on[1], off[1]):
        assert sa.sync_free == {"overflows": 0, "reruns": 0}
        assert abs(sa.loss - sb.loss) < 1e-5
        for n in gb:
            assert torch.allclose(ga[n], gb[n], atol=1e-5, rtol=0), n
    assert stash_runtime(on[0]).record()["sync_free"] is True


def _global_aux_cfg(fused: bool, **runtime) -> RootConfig:
    return config_from_dict({**_cfg(**runtime).to_dict(), "plugins": {"router_options": {
        "load_balancing_type": ["aux_loss", "global_aux_loss"], "aux_loss_coeff": [1e-2, 1e-1],
        "fused": fused}}})


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_global_aux_loss_is_sync_free_and_reruns_bitwise(fused):
    """The global aux loss's step token count is a device buffer used on the device: once it
    was read on the host (``int(buffer)``, a sync) and sync_free refused the loss. Two
    micro-batches of the static layer read zero syncs and give the dynamic layer's losses,
    outputs and grads; over budget the rerun restores the count with the other buffers
    (bitwise the run without sync_free); within budget no rerun."""
    torch.manual_seed(0)
    layer = _moe_layers(build_model(_global_aux_cfg(fused, sync_free=True), PluginHost.load(),
                                    VOCAB))[0]
    (x0, w0), (x1, w1) = _inputs(3), _inputs(4)
    with HostSyncCounter() as c:
        static = [_fwd_bwd(layer, x0, w0), _fwd_bwd(layer, x1, w1)]
    assert c.count == 0, c.calls
    assert int(layer.router.global_tokens) == 2 * 32  # both micro-batches counted
    layer.router.finalize_step()
    with stash_runtime_of(layer).sync_free.disabled():
        dynamic = [_fwd_bwd(layer, x0, w0), _fwd_bwd(layer, x1, w1)]
    for a, b in zip(static, dynamic):
        _close(a, b)
    off = _train(_global_aux_cfg(fused))
    tiny = _train(_global_aux_cfg(fused, sync_free=True, token_budget=0.25))
    within = _train(_global_aux_cfg(fused, sync_free=True))
    for (sa, ga), (sb, gb), (sc, gc) in zip(tiny[1], off[1], within[1]):
        assert sa.sync_free["reruns"] == 1
        assert sa.losses() == sb.losses()  # the rerun counted its tokens once
        assert sc.sync_free == {"overflows": 0, "reruns": 0}
        assert abs(sc.loss - sb.loss) < 1e-5
        for n in gb:
            assert torch.equal(ga[n], gb[n]), n
            assert torch.allclose(gc[n], gb[n], atol=1e-5, rtol=0), n


def test_stash_holds_the_static_experts_activations_in_the_same_pages_every_step():
    # sync_free + stash: stage 4 saves its 2-D input and FC1 rows in the pool; static shapes,
    # so each step takes the same pages and returns them all.
    plain = _train(_cfg(sync_free=True), steps=3)
    stashed = _train(_cfg(sync_free=True, stash=True), steps=3)
    rt = stash_runtime(stashed[0])
    stats = [s.stash for s, _ in stashed[1]]
    assert all(s["overflows"] == 0 and s["pages_in_use"] == 0 for s in stats)
    assert stats[0]["high_water"] > 0 and len({s["high_water"] for s in stats}) == 1
    assert all(s.sync_free == {"overflows": 0, "reruns": 0} for s, _ in stashed[1])
    for (sa, ga), (sb, gb) in zip(stashed[1], plain[1]):
        assert abs(sa.loss - sb.loss) < 1e-6
        for n in gb:
            assert torch.allclose(ga[n], gb[n], atol=1e-6, rtol=0), n
    # One more step of one micro-batch: 2 MoE layers x (expert input, FC1 output) stashed.
    allocs = rt.pool.stats()["allocs"]
    train_step(stashed[0], build_optimizer(stashed[0], _cfg().train),
               [(torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16)))],
               _cfg().train, PluginHost.load().create("precision", "fp32", {}), None)
    assert rt.pool.stats()["allocs"] - allocs == 2 * 2


@pytest.mark.parametrize("runtime, names", [
    ({"token_budget": 0}, ("token_budget", "0", "Fix")),
    ({"token_budget": float("inf")}, ("token_budget", "inf", "Fix")),
    ({"capture": True}, ("capture", "sync_free: true")),
    ({"capture": True, "sync_free": True, "stash": True}, ("capture", "runtime.stash", "Fix")),
    ({"sync_free": "yes"}, ("sync_free", "'yes'", "true or false")),
])
def test_config_errors_name_field_value_and_fix(runtime, names):
    with pytest.raises(ConfigError) as err:
        _cfg(**runtime)
    for n in names:
        assert n in str(err.value)


def test_sync_free_refuses_a_precision_it_cannot_run_before_any_group():
    with pytest.raises(ConfigError, match=r"sync_free.*plugins.precision = 'fp8'.*Fix"):
        config_from_dict({"plugins": {"precision": "fp8"}, "runtime": {"sync_free": True}})


# ---- EP2, real gloo -----------------------------------------------------------------------

def _ep2_layer(rank: int, etp: bool = False, **runtime) -> tuple:
    """(layer, x, w) on this rank of the 2-rank world: a sync-free MoE layer (4 experts) over
    the alltoall dispatcher, registered with its own runtime, and this rank's inputs. EP2: 2
    experts here; ``etp``: ETP2 instead, all 4 experts here with half of F, the rows gathered
    over both ranks (moeplug.parallel.expert_tp, as build_model wires it)."""
    import torch.distributed as dist

    from moeplug.config import RuntimeSection
    from moeplug.moe.budgeted import budgeted_dispatcher
    from moeplug.parallel.expert_tp import ExpertTPDispatcher, expert_model_config
    from moeplug.runtime.stash import ModelRuntime
    from moeplug.testing._common import tiny_model_config
    cfg = tiny_model_config(num_experts=4, top_k=2, hidden_size=16, ffn_hidden_size=8)
    host = PluginHost.load()
    torch.manual_seed(0)
    local = 4 if etp else 2
    rt = ModelRuntime(RuntimeSection(sync_free=True, **runtime))
    handle = rt.register_layer(index=0, num_experts=4, top_k=2, hidden=16, ffn_hidden=8,
                               num_local_experts=local, dtype="float32", activation="swiglu",
                               stash_bytes=1 << 16 if runtime.get("stash") else 0)
    rt.finalize()
    dispatcher = host.create("dispatcher", "alltoall", {}, cfg, None if etp else dist.group.WORLD)
    if etp:
        dispatcher = ExpertTPDispatcher(dispatcher, dist.group.WORLD)
    experts = host.create("experts", "grouped", {}, expert_model_config(cfg, 2 if etp else 1),
                          local)
    layer = MoELayer(host.create("router", "topk", {}, cfg), dispatcher, experts,
                     runtime=handle, budgeted=budgeted_dispatcher(
                         dispatcher, experts, rt.sync_free, group=None if etp else
                         dist.group.WORLD, etp_group=dist.group.WORLD if etp else None))
    g = torch.Generator().manual_seed(10 + rank)
    return layer, torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)


def _ep2_rank(rank: int, world: int, etp: bool = False) -> dict:
    out = {}
    for name, runtime in (("eager", {}), ("replay", {"capture": True}), ("stash", {"stash": True})):
        layer, x, w = _ep2_layer(rank, etp, **runtime)
        rt = stash_runtime_of(layer)
        static = _fwd_bwd(layer, x, w)
        static_again = _fwd_bwd(layer, x, w)  # replay: the compiled code's second run
        over = bool(rt.sync_free.take_overflow())
        with rt.sync_free.disabled():
            dynamic = _fwd_bwd(layer, x, w)
        out[name] = {"errs": {k: float((static[k].float() - dynamic[k].float()).abs().max())
                              for k in dynamic},
                     "again": max(float((static[k].float() - static_again[k].float()).abs().max())
                                  for k in static),
                     "overflow": over,
                     "stashed": rt.pool.stats()["high_water"] if runtime.get("stash") else 1}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("etp", [False, True], ids=["ep2", "etp2"])
def test_ep2_static_eager_replay_and_stash_equal_dynamic_alltoall(etp):
    from moeplug.testing.distributed import run_distributed
    for rank, res in enumerate(run_distributed(_ep2_rank, 2, etp, timeout=400)):
        for name in ("eager", "replay", "stash"):
            assert not res[name]["overflow"] and res[name]["stashed"] > 0
            assert res[name]["again"] == 0.0, (rank, name)
            for k, err in res[name]["errs"].items():
                assert err <= TOL, (rank, name, k, err)


def _ep2_bf16_rank(rank: int, world: int) -> list:
    # The packed chunks' grouped GEMMs take the autocast dtype themselves (the custom op is no
    # autocast op).
    return _bf16_static_vs_dynamic(*_ep2_layer(rank))


def test_ep2_static_equals_dynamic_under_bf16_autocast():
    # Tolerance as at one rank: 2e-2 of each tensor's largest value (measured: at most 8e-3).
    from moeplug.testing.distributed import run_distributed
    for errs in run_distributed(_ep2_bf16_rank, 2, timeout=300):
        assert max(errs) < 2e-2, errs


def test_evaluation_takes_the_dynamic_path_and_loses_no_token():
    # No trainer reruns an evaluation, so an eval-mode layer never uses the budget.
    x, _ = _inputs()
    layer = _layer(sync_free=True, token_budget=0.1).eval()
    with torch.no_grad():
        y = layer(x)[0]
    assert stash_runtime_of(layer).sync_free.take_overflow() is None
    with stash_runtime_of(layer).sync_free.disabled(), torch.no_grad():
        assert torch.equal(y, layer(x)[0])


def _ep2_train_rank(rank: int, world: int) -> dict:
    variants = {"off": {}, "within": {"sync_free": True},
                "over": {"sync_free": True, "token_budget": 0.25}}
    return train_ep2_variants(rank, world, variants, VOCAB, "sync_free")


@pytest.mark.slow
def test_ep2_training_over_budget_reruns_bitwise_and_within_budget_matches():
    from moeplug.testing.distributed import run_distributed
    results = run_distributed(_ep2_train_rank, 2, timeout=400)
    # every rank names the same budget: the all-reduced largest demand
    assert results[0]["over"]["sync_free"] == results[1]["over"]["sync_free"]
    for res in results:
        assert res["over"]["losses"] == res["off"]["losses"]  # bitwise, both ranks reran
        over = res["over"]["sync_free"]
        assert [(s["overflows"], s["reruns"]) for s in over] == [(1, 1)] * 2
        assert all(0.25 < s["budget_needed"] <= 2.0 for s in over)
        for n, p in res["off"]["params"].items():
            assert torch.equal(res["over"]["params"][n], p), n
        assert res["within"]["sync_free"] == [{"overflows": 0, "reruns": 0}] * 2
        for a, b in zip(res["within"]["losses"], res["off"]["losses"]):
            assert abs(a["loss"] - b["loss"]) < 1e-5
        for n, p in res["off"]["params"].items():
            assert torch.allclose(res["within"]["params"][n], p, atol=1e-5, rtol=0), n


# ---- the CLI ------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_train_records_sync_free_and_reruns(tiny_config_file, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--config", tiny_config_file(), "--out", str(out), "--steps", "2",
            "--set", "runtime.sync_free=true", "--set", "runtime.token_budget=0.1",
            "--set", "train.log_interval=1"]
    res = run_cli(args, timeout=300)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = next(r for r in records if r["kind"] == "run")
    assert run["runtime"]["sync_free"] is True and run["runtime"]["token_budget"] == 0.1
    reruns = [r for r in records if r["kind"] == "sync_free_rerun"]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in reruns] == [1, 2]  # budget 0.1: every step over, every rerun
    assert [r["sync_free"]["reruns"] for r in train] == [1, 2]
    assert all(0.1 < r["budget_needed"] <= 2.0 for r in reruns)  # E/K: every token on one
    assert "reran on the dynamic path" in res.stdout + res.stderr
    assert f"this step needed token_budget {reruns[0]['budget_needed']}" in \
        res.stdout + res.stderr
