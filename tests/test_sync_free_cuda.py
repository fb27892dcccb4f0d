"""Runtime-owned CUDA graphs and the sync-free layer on a GPU.

Without a GPU: the built extension (build/cuda, what .ci/run compiles) is imported directly and
its Graph / StaticBuffer bindings refuse misuse before any CUDA call. With a GPU (marked
``cuda``, skipped with the reason elsewhere): torch's own sync detector
(``torch.cuda.set_sync_debug_mode("error")``) raises on any host sync in the static layer's
forward and backward; a runtime graph of the static region's forward+backward replays equal to
eager, with new inputs.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = sorted(glob.glob(os.path.join(ROOT, "build", "cuda", "_runtime_cuda*.so")))
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU (torch sees none)")


def _built_module():
    spec = importlib.util.spec_from_file_location("_runtime_cuda", BUILT[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not BUILT, reason="build/cuda/_runtime_cuda*.so not built (.ci/run builds "
                                      "it with nvcc)")
def test_built_graph_bindings_refuse_misuse_without_touching_cuda():
    cuda = _built_module()
    g = cuda.Graph()
    assert not g.captured and not g.capturing and g.num_nodes == 0
    with pytest.raises(RuntimeError, match="nothing captured yet"):
        g.replay(0)
    with pytest.raises(ValueError, match="legacy default stream"):
        g.begin_capture(0)
    with pytest.raises(RuntimeError, match="no capture is open"):
        g.end_capture()
    assert "graphs" in cuda.__doc__


@pytest.mark.cuda
@NEEDS_GPU
def test_static_layer_makes_no_host_sync_on_a_gpu():
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.moe import MoELayer
    from moeplug.plugin_host import PluginHost
    cfg = config_from_dict({
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                  "first_k_dense": 0, "moe": {"num_experts": 4, "top_k": 2,
                                              "ffn_hidden_size": 32}},
        "runtime": {"sync_free": True}})
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), 64).cuda()
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    x, w = torch.randn(2, 16, 32, device="cuda"), torch.randn(2, 16, 32, device="cuda")
    layer(x)  # lazy CUDA init outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        xx = x.clone().requires_grad_(True)
        y, aux, _ = layer(xx)
        ((y * w).sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _one_rank(w13: torch.Tensor, w2: torch.Tensor):
    """(region, experts): capture's one_rank (moeplug.moe.capture: stages 1-6 at one EP rank)
    over a budgeted dispatcher and grouped experts holding ``w13``, ``w2``, as a function
    ``region(x_TD, ids_TK, dropped_TK, probs_TK, budget) -> (y_TD, overflow, counts_E)``."""
    import types

    from moeplug.config import RuntimeSection
    from moeplug.moe.budgeted.dispatcher import BudgetedDispatcher, budget_counts
    from moeplug.moe.capture import one_rank
    from moeplug.plugin_host import PluginHost
    from moeplug.runtime.syncfree import SyncFreeState
    from moeplug.testing import tiny_model_config
    E, F2, D = w13.shape
    cfg = tiny_model_config(num_experts=E, hidden_size=D, ffn_hidden_size=F2 // 2)
    experts = PluginHost.load().create("experts", "grouped", {}, cfg, E).to(w13.device)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
    inner = types.SimpleNamespace(num_experts=E, num_local_experts=E, quantizes_dispatch=False)
    dispatcher = BudgetedDispatcher(inner, SyncFreeState(RuntimeSection(sync_free=True)),
                                    packed=True)

    def call(x_SD, probs_S, counts_L, packed):
        if packed:
            return experts.forward_packed(x_SD.view(1, -1, D), counts_L).view(-1, D)
        return experts(x_SD, probs_S, counts_L)

    def region(x_TD, ids_TK, dropped_TK, probs_TK, budget):
        packed = dispatcher.packs(x_TD)
        return one_rank(x_TD, ids_TK, dropped_TK, probs_TK, dispatcher, call, budget, packed,
                        dispatcher.kernels(x_TD), None if packed else budget_counts(E, budget),
                        *experts.parameters())
    return region, experts


@pytest.mark.cuda
@NEEDS_GPU
def test_runtime_graph_replay_equals_eager_forward_and_backward():
    from moeplug.runtime.cuda_graph import capture
    g = torch.Generator().manual_seed(0)
    T, D, F, E, K = 64, 32, 16, 4, 2
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.1).cuda()
    w2 = (torch.randn(E, D, F, generator=g) * 0.1).cuda()
    one_rank, _ = _one_rank(w13, w2)

    def step(x_TD, ids_TK, probs_TK):
        x = x_TD.detach().requires_grad_(True)
        y, _, _ = one_rank(x, ids_TK, None, probs_TK, T * K // E * 2)
        (gx,) = torch.autograd.grad((y * y).sum(), x)
        return y, gx

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        return (torch.randn(T, D, generator=gen).cuda(), ids.cuda(),
                torch.rand(T, K, generator=gen).cuda())

    replay = capture(step, *draw(1))
    assert replay.graph.captured and replay.graph.num_nodes > 0
    for seed in (2, 3):
        inputs = draw(seed)
        y, gx = replay(*inputs)
        y_ref, gx_ref = step(*inputs)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-5)
    assert replay.graph.replays == 2


# ---- runtime.capture on CUDA: the layer's pieces as runtime forward and backward graphs -------

def _cuda_model(**runtime):
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.testing.steps import runtime_cfg
    torch.manual_seed(0)
    return build_model(runtime_cfg(**runtime), PluginHost.load(), 64).cuda()


def _cuda_train(steps: int, **runtime):
    from moeplug.plugin_host import PluginHost
    from moeplug.testing.steps import runtime_cfg
    from moeplug.training.optim import build_optimizer
    from moeplug.training.trainer import train_step
    model = _cuda_model(**runtime)
    cfg = runtime_cfg(**runtime)
    opt = build_optimizer(model, cfg.train)
    precision = PluginHost.load().create("precision", "fp32", {})
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        batches = [tuple(torch.randint(0, 64, (4, 16), generator=gen).cuda() for _ in range(2))
                   for _ in range(cfg.train.grad_accum_steps)]
        stats = train_step(model, opt, batches, cfg.train, precision, None)
        history.append((stats, {n: p.grad.detach().cpu() for n, p in model.named_parameters()
                                if p.grad is not None}))
    return model, history


@pytest.mark.cuda
@NEEDS_GPU
def test_capture_on_cuda_trains_like_eager_replaying_runtime_graphs():
    from moeplug.training.trainer import stash_runtime
    steps = 3
    eager = _cuda_train(steps, sync_free=True)
    replay = _cuda_train(steps, sync_free=True, capture=True)
    graphs = stash_runtime(replay[0]).sync_free.graphs
    # 2 layers x one piece (one_rank: EP 1, no stash), recorded once each, then one forward
    # and one backward replay per layer and micro-batch.
    assert graphs.recordings == 2
    assert graphs.replays == steps * 2 * 2
    assert stash_runtime(eager[0]).sync_free._graphs is None  # eager never recorded
    for (sa, ga), (sb, gb) in zip(replay[1], eager[1]):
        assert sa.sync_free == {"overflows": 0, "reruns": 0}
        assert abs(sa.loss - sb.loss) < 1e-5
        assert ga.keys() == gb.keys()
        for n in gb:
            torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=1e-5, msg=n)
    for (n, pa), pb in zip(replay[0].named_parameters(), eager[0].parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-5, msg=n)


def _two_layers():
    from moeplug.moe import MoELayer
    layers = []
    for runtime in ({"sync_free": True}, {"sync_free": True, "capture": True}):
        model = _cuda_model(**runtime)
        layers.append(next(m for m in model.modules() if isinstance(m, MoELayer)))
    return layers


def _replay_equals_eager(eager, replay, step) -> None:
    # step(layer) -> tensors of one fwd+bwd; with the layer's grads, the replaying layer's
    # equal the eager one's (fp32).
    results = []
    for layer in (eager, replay):
        layer.zero_grad(set_to_none=True)
        results.append(step(layer) + [p.grad.clone() for p in layer.parameters()])
    for r, e in zip(results[1], results[0]):
        torch.testing.assert_close(r, e, rtol=0, atol=1e-5)


@pytest.mark.cuda
@NEEDS_GPU
def test_forwards_in_flight_take_their_own_recordings():
    # Pipeline micro-batches: a layer's second forward comes before the first's backward. Each
    # takes its own recording (the first's saved tensors are still needed), and both
    # backwards equal eager; the next round reuses the two recordings.
    eager, replay = _two_layers()
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        x1, x2, w = (torch.randn(2, 16, 32, generator=g).cuda() for _ in range(3))

        def two_in_flight(layer):
            a, b = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
            y1, aux1, _ = layer(a)
            y2, aux2, _ = layer(b)
            ((y1 * w).sum() + (y2 * w).square().sum() + aux1 + aux2).backward()
            return [y1.detach().clone(), y2.detach().clone(), a.grad, b.grad]
        _replay_equals_eager(eager, replay, two_in_flight)
    assert replay.runtime.runtime.sync_free.graphs.recordings == 2


@pytest.mark.cuda
@NEEDS_GPU
def test_forwards_never_backwarded_stop_at_the_bound_with_the_setting_and_the_fix():
    # Each forward whose backward never runs keeps its recording (and its memory) busy; past
    # MAX_IN_FLIGHT of them the layer says so instead of recording without end.
    from moeplug.runtime.cuda_graph import MAX_IN_FLIGHT
    _, replay = _two_layers()
    x = torch.randn(2, 16, 32, device="cuda", requires_grad=True)
    held = [replay(x)[0] for _ in range(MAX_IN_FLIGHT)]
    with pytest.raises(RuntimeError, match=rf"runtime\.capture: {MAX_IN_FLIGHT} forwards of "
                                           r"one_rank .*Fix: .*runtime\.capture: false"):
        replay(x)
    assert len(held) == replay.runtime.runtime.sync_free.graphs.recordings == MAX_IN_FLIGHT


@pytest.mark.cuda
@NEEDS_GPU
def test_checkpointed_layer_recomputes_eagerly_and_leaks_no_recording():
    # A checkpoint's recompute runs inside backward: eager there (its outputs only refill saved
    # tensors), while the backward replays the forward's recording, which is then free again.
    from torch.utils.checkpoint import checkpoint
    eager, replay = _two_layers()
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        x, w = (torch.randn(2, 16, 32, generator=g).cuda() for _ in range(2))

        def checkpointed(layer):
            xx = x.clone().requires_grad_(True)
            y = checkpoint(lambda t: layer(t)[0] * 1.5, xx, use_reentrant=False)
            (y * w).sum().backward()
            return [y.detach(), xx.grad]
        _replay_equals_eager(eager, replay, checkpointed)
    graphs = replay.runtime.runtime.sync_free.graphs
    assert graphs.recordings == 1 and graphs.replays == 3


@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("budget_of_balanced, dropped, over", [
    (3.0, False, False), (0.5, False, True), (1.0, True, None)])
def test_fused_static_layer_on_cuda_equals_the_torch_stages(budget_of_balanced, dropped, over):
    # one_rank on a GPU runs the runtime's kernels (slots spread, SwiGLU with the weights,
    # slot sum); the same function on the CPU runs the torch stages. Over budget (0.5) and
    # router-dropped choices reach no row on either.
    from moeplug.moe.budgeted.slots import budget_rows
    g = torch.Generator().manual_seed(7)
    T, D, F, E, K = 96, 64, 48, 8, 2
    C = budget_rows(T, K, E, budget_of_balanced)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[: T // 3] = torch.tensor([0, 1])  # two hot experts: over a tight budget
    drop = torch.rand(T, K, generator=g) < 0.2 if dropped else None
    leaves = {"x": torch.randn(T, D, generator=g), "p": torch.rand(T, K, generator=g),
              "w13": torch.randn(E, 2 * F, D, generator=g) * 0.1,
              "w2": torch.randn(E, D, F, generator=g) * 0.1}
    w_TD = torch.randn(T, D, generator=g)
    runs = {}
    for device in ("cpu", "cuda"):
        t = {k: v.to(device, copy=True).requires_grad_() for k, v in leaves.items()}
        one_rank, experts = _one_rank(t["w13"].detach(), t["w2"].detach())
        y, overflow, counts = one_rank(t["x"], ids.to(device), None if drop is None else
                                       drop.to(device), t["p"], C)
        (y * w_TD.to(device)).sum().backward()
        t["w13"].grad, t["w2"].grad = experts.gate_up_proj.grad, experts.down_proj.grad
        runs[device] = [y, overflow, counts] + [t[k].grad for k in leaves]
    assert over is None or bool(runs["cpu"][1]) == over
    for name, c, u in zip(["y", "overflow", "counts"] + list(leaves), runs["cpu"],
                          runs["cuda"]):
        torch.testing.assert_close(u.cpu(), c, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("precision", ["fp8_delayed", "mxfp8"])
def test_static_layer_under_a_recipe_on_a_gpu_makes_no_host_sync_and_equals_dynamic(precision):
    """The quantized static region (moeplug.moe.budgeted's budget rows under a recipe) on a
    GPU: no host sync in the layer's forward and backward under torch's sync detector, and
    outputs and grads equal to the dynamic quantized path (bitwise on the CPU; a GPU's GEMMs
    may sum in another order for the padded row counts, hence the bf16-scale tolerance)."""
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.moe import MoELayer
    from moeplug.plugin_host import PluginHost
    from moeplug.quant import recipe_scope
    cfg = config_from_dict({
        "model": {"hidden_size": 64, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                  "first_k_dense": 0, "moe": {"num_experts": 4, "top_k": 2,
                                              "ffn_hidden_size": 64}},
        "plugins": {"precision": precision}, "runtime": {"sync_free": True}})
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), 64).cuda()
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    recipe = PluginHost.load().create("precision", precision, {}).recipe
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 32, 64, device="cuda", generator=g)
    w = torch.randn(2, 32, 64, device="cuda", generator=g)

    def fwd_bwd(check_syncs: bool = False) -> dict:
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16), recipe_scope(recipe):
            if check_syncs:
                torch.cuda.set_sync_debug_mode("error")
            try:
                y, aux, _ = layer(xx)
                ((y.float() * w).sum() + aux).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return {"y": y.detach().float(), "x": xx.grad.float(),
                **{n: p.grad.float() for n, p in layer.named_parameters()}}

    fwd_bwd()  # lazy CUDA init and the first step's scales outside the check
    static = fwd_bwd(check_syncs=True)
    with layer.runtime.runtime.sync_free.disabled():
        dynamic = fwd_bwd()
    for k, v in dynamic.items():
        err = ((static[k] - v).abs().max() / v.abs().max().clamp(min=1e-30)).item()
        assert err < 2e-2, (k, err)
