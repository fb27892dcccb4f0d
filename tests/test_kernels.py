"""C++ permute / unpermute / swiglu kernels vs the plain-torch references (values and grads).

Shape legend: T tokens, K top-k, D hidden, E experts, S = T*K routed rows, F FFN hidden.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from moeplug import ops, runtime
from moeplug.ops import reference as ref
from moeplug.runtime import get_runtime, runtime_info

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def random_ids(T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, like a top-k router."""
    return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()


# (T, K, E, ids builder) covering the adversarial routings the dispatcher can produce.
ROUTINGS = {
    "random": (37, 3, 8, lambda T, K, E, g: random_ids(T, K, E, g)),
    "all_to_one_expert": (20, 1, 6, lambda T, K, E, g: torch.full((T, K), 4, dtype=torch.int64)),
    "zero_token_experts": (25, 2, 9, lambda T, K, E, g: random_ids(T, K, 3, g) * 3),
    "top_k_equals_E": (11, 4, 4, lambda T, K, E, g: random_ids(T, K, E, g)),
    "one_token": (1, 2, 5, lambda T, K, E, g: torch.tensor([[3, 0]])),
    "many_tokens_parallel": (1500, 2, 16, lambda T, K, E, g: random_ids(T, K, E, g)),
    "repeated_ids_in_token": (9, 3, 2, lambda T, K, E, g: torch.randint(0, E, (T, K), generator=g)),
}


@pytest.fixture(params=list(ROUTINGS), ids=list(ROUTINGS))
def routing(request):
    T, K, E, build = ROUTINGS[request.param]
    gen = torch.Generator().manual_seed(zlib.crc32(request.param.encode()) % 1000)  # not hash(): PYTHONHASHSEED
    return T, K, E, build(T, K, E, gen), gen


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_matches_reference(routing, dtype):
    T, K, E, ids_TK, gen = routing
    D = 19  # odd: exercises vector tails
    x_TD = torch.randn(T, D, generator=gen).to(dtype).requires_grad_()
    x_SD, row_map_TK, counts_E = ops.permute(x_TD, ids_TK, E)
    rx_SD, rrow_map_TK, rcounts_E = ref.permute(x_TD.detach(), ids_TK, E)
    assert torch.equal(counts_E, rcounts_E)
    assert torch.equal(row_map_TK, rrow_map_TK)  # stable order: (token, k) within an expert
    assert torch.equal(x_SD.detach(), rx_SD)  # a permutation copies bits exactly
    assert counts_E.dtype == torch.int64 and counts_E.device.type == "cpu"

    g_SD = torch.randn(T * K, D, generator=gen).to(dtype)
    (grad,) = torch.autograd.grad(x_SD, x_TD, g_SD)
    want = g_SD.float()[row_map_TK].sum(dim=1).to(dtype)
    torch.testing.assert_close(grad, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_matches_reference(routing, dtype, with_probs):
    T, K, E, ids_TK, gen = routing
    D = 33
    _, row_map_TK, _ = ref.permute(torch.zeros(T, 1), ids_TK, E)
    y_SD = torch.randn(T * K, D, generator=gen).to(dtype).requires_grad_()
    probs_TK = torch.rand(T, K, generator=gen).requires_grad_() if with_probs else None
    ry_SD = y_SD.detach().clone().requires_grad_()
    rprobs_TK = probs_TK.detach().clone().requires_grad_() if with_probs else None

    y_TD = ops.unpermute(y_SD, row_map_TK, probs_TK)
    ry_TD = ref.unpermute(ry_SD, row_map_TK, rprobs_TK)
    assert y_TD.dtype == dtype
    torch.testing.assert_close(y_TD, ry_TD, **TOL[dtype])

    g_TD = torch.randn(T, D, generator=gen).to(dtype)
    inputs = (y_SD, probs_TK) if with_probs else (y_SD,)
    rinputs = (ry_SD, rprobs_TK) if with_probs else (ry_SD,)
    for got, want in zip(torch.autograd.grad(y_TD, inputs, g_TD),
                         torch.autograd.grad(ry_TD, rinputs, g_TD)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **TOL[dtype])


def test_permute_then_unpermute_roundtrip():
    gen = torch.Generator().manual_seed(0)
    T, K, E, D = 64, 2, 8, 16
    x_TD = torch.randn(T, D, generator=gen)
    ids_TK = random_ids(T, K, E, gen)
    x_SD, row_map_TK, _ = ops.permute(x_TD, ids_TK, E)
    # Plain sum of K identical copies is K * x.
    torch.testing.assert_close(ops.unpermute(x_SD, row_map_TK), K * x_TD)


def test_unpermute_padded_rows_get_zero_grad():
    # S > T*K (a dispatcher may pad): rows nobody reads must get exactly zero gradient.
    row_map_TK = torch.tensor([[0, 5], [2, 3]])
    y_SD = torch.randn(7, 4, requires_grad=True)
    probs_TK = torch.rand(2, 2)
    y_TD = ops.unpermute(y_SD, row_map_TK, probs_TK)
    torch.testing.assert_close(y_TD, ref.unpermute(y_SD.detach(), row_map_TK, probs_TK))
    (grad,) = torch.autograd.grad(y_TD.sum(), y_SD)
    assert torch.equal(grad[[1, 4, 6]], torch.zeros(3, 4))
    torch.testing.assert_close(grad[5], probs_TK[0, 1].expand(4))


def test_empty_batch():
    x_SD, row_map_TK, counts_E = ops.permute(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.int64), 4)
    assert x_SD.shape == (0, 8) and row_map_TK.shape == (0, 2)
    assert torch.equal(counts_E, torch.zeros(4, dtype=torch.int64))
    assert ops.unpermute(x_SD, row_map_TK).shape == (0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("S,F", [(1, 1), (7, 13), (300, 64)])
def test_swiglu_matches_reference(dtype, with_probs, S, F):
    gen = torch.Generator().manual_seed(S * 100 + F)
    # Wide range: exercises the saturated ends of the polynomial exp.
    h_S2F = (torch.randn(S, 2 * F, generator=gen) * 6).to(dtype).requires_grad_()
    probs_S = torch.rand(S, generator=gen).requires_grad_() if with_probs else None
    rh_S2F = h_S2F.detach().clone().requires_grad_()
    rprobs_S = probs_S.detach().clone().requires_grad_() if with_probs else None
    a_SF = ops.swiglu(h_S2F, probs_S)
    ra_SF = ref.swiglu(rh_S2F, rprobs_S)
    torch.testing.assert_close(a_SF, ra_SF, **TOL[dtype])

    g_SF = torch.randn(S, F, generator=gen).to(dtype)
    inputs = (h_S2F, probs_S) if with_probs else (h_S2F,)
    rinputs = (rh_S2F, rprobs_S) if with_probs else (rh_S2F,)
    for got, want in zip(torch.autograd.grad(a_SF, inputs, g_SF),
                         torch.autograd.grad(ra_SF, rinputs, g_SF)):
        # dp sums F products of size ~36 in a different order than torch: looser for fp32.
        tol = TOL[dtype] if got.shape == h_S2F.shape else {
            torch.float32: dict(atol=1e-3, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}[dtype]
        torch.testing.assert_close(got, want, **tol)


def test_swiglu_extreme_inputs_stay_finite():
    h = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    a = ops.swiglu(h)
    torch.testing.assert_close(a, ref.swiglu(h))
    assert torch.isfinite(a).all()


# ---- error paths: each message names the argument, the value and the fix ------------------

def test_bad_expert_id_names_position_and_range():
    ids_TK = torch.tensor([[0, 1], [2, 9], [1, 0]])
    with pytest.raises(ValueError, match=r"ids\[1, 1\] = 9 .*0 <= id < num_experts \(4\)"):
        ops.permute(torch.randn(3, 8), ids_TK, 4)
    with pytest.raises(ValueError, match=r"ids\[0, 0\] = -1"):
        ops.permute(torch.randn(3, 8), torch.tensor([[-1, 0], [0, 1], [1, 2]]), 4)


def test_bad_row_map_is_rejected():
    y_SD = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"row_map\[1, 0\] = 4 is outside \[0, 4\).*permute returned"):
        ops.unpermute(y_SD, torch.tensor([[0, 1], [4, 2]]))
    with pytest.raises(ValueError, match=r"row_map\[1, 1\] = 0 repeats.*exactly one"):
        ops.unpermute(y_SD, torch.tensor([[0, 1], [2, 0]]))


@pytest.mark.parametrize("call,match", [
    (lambda: ops.permute(torch.randn(4, 8, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.int64), 2),
     r"permute: x_TD has dtype torch.float64.*Fix: cast with x_TD.float\(\)"),
    (lambda: ops.permute(torch.randn(8, 4).t(), torch.zeros(4, 1, dtype=torch.int64), 2),
     r"permute: x_TD .*not contiguous. Fix: pass x_TD.contiguous\(\)"),
    (lambda: ops.permute(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int32), 2),
     r"permute: ids_TK has dtype torch.int32; expected torch.int64. Fix: pass ids_TK.long\(\)"),
    (lambda: ops.permute(torch.randn(4, 8), torch.zeros(3, 1, dtype=torch.int64), 2),
     r"ids_TK has 3 rows but x_TD has 4 tokens"),
    (lambda: ops.permute(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int64), 0),
     r"num_experts = 0 must be an integer >= 1"),
    (lambda: ops.permute(torch.randn(4), torch.zeros(4, 1, dtype=torch.int64), 2),
     r"permute: x_TD must be 2-D \[T, D\], got shape \(4,\)"),
    (lambda: ops.unpermute(torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.int64), torch.rand(2, 3)),
     r"unpermute: probs_TK must have shape \(2, 2\), got \(2, 3\)"),
    (lambda: ops.swiglu(torch.randn(3, 5)),
     r"swiglu: h_S2F has 5 columns; expected an even number"),
    (lambda: ops.swiglu(torch.randn(3, 4), torch.ones(3, dtype=torch.int64)),
     r"swiglu: probs_S has dtype torch.int64; expected a floating dtype"),
])
def test_argument_errors_name_field_and_fix(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_cpp_rejects_unknown_dtype_code():
    core = get_runtime()
    with pytest.raises(ValueError, match=r"dtype code 7 is unknown; expected 0 \(float32\) or 1"):
        core.swiglu_forward(h=0, probs=0, a=0, num_rows=0, ffn_hidden=1, dtype=7)


def test_thread_pool_size_and_build_info():
    core = get_runtime()
    before = core.get_num_threads()
    try:
        core.set_num_threads(3)
        assert core.get_num_threads() == 3
        # Results do not depend on the pool size (fixed chunking keeps permute stable).
        gen = torch.Generator().manual_seed(1)
        ids_TK = random_ids(999, 2, 7, gen)
        x_TD = torch.randn(999, 5, generator=gen)
        got = ops.permute(x_TD, ids_TK, 7)
        core.set_num_threads(1)
        want = ops.permute(x_TD, ids_TK, 7)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with pytest.raises(ValueError, match=r"set_num_threads: n must be >= 1, got 0"):
            core.set_num_threads(0)
    finally:
        core.set_num_threads(before)
    info = runtime_info()
    assert info["available"] and info["cuda"] is False
    assert {"version", "compiler", "flags", "num_threads"} <= set(info)


@pytest.mark.skipif("parallel backend: OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch's intra-op threads are not OpenMP's here")
def test_kernels_run_on_torchs_openmp_team_with_the_pools_results():
    """Under torch's OpenMP build the kernels' parallel loops run on torch's own OpenMP team
    (the GOMP_parallel of the libgomp torch loaded), and give what the runtime's pool gives,
    bit for bit (the chunking is the same); a second run in a subprocess with
    $MOEPLUG_RUNTIME_EXECUTOR=pool takes the pool."""
    import subprocess
    import sys

    from moeplug.ops.swiglu import swiglu_backward_raw, swiglu_forward_raw
    core = get_runtime()
    assert core.executor() == "openmp" and runtime_info()["openmp"] is True
    gen = torch.Generator().manual_seed(3)
    ids_TK = random_ids(777, 4, 9, gen)
    x_TD = torch.randn(777, 33, generator=gen)
    probs_TK = torch.rand(777, 4, generator=gen)
    h = torch.randn(500, 2 * 37, generator=gen).to(torch.bfloat16)
    p, da = torch.rand(500, generator=gen), torch.randn(500, 37, generator=gen).to(torch.bfloat16)

    def run():
        x_SD, row_map, counts = ops.permute(x_TD, ids_TK, 9)
        dh, dp = torch.empty_like(h), torch.empty_like(p)
        swiglu_backward_raw(da, h, p, True, dh, dp)
        return (x_SD, row_map, counts, ops.unpermute(x_SD, row_map, probs_TK),
                swiglu_forward_raw(h, p), dh, dp)

    on_openmp = run()
    address = runtime._torch_gomp_parallel()
    try:
        core.use_openmp(0)
        assert core.executor() == "pool"
        on_pool = run()
    finally:
        core.use_openmp(address)
    assert all(torch.equal(a, b) for a, b in zip(on_openmp, on_pool))
    env = {**os.environ, runtime.EXECUTOR_ENV: "pool"}
    out = subprocess.run([sys.executable, "-c", "from moeplug.runtime import get_runtime; "
                          "print(get_runtime().executor())"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "pool", out.stderr
    env[runtime.EXECUTOR_ENV] = "gomp"
    out = subprocess.run([sys.executable, "-c", "from moeplug.runtime import get_runtime; "
                          "get_runtime()"], env=env, capture_output=True, text=True, timeout=120)
    assert "MOEPLUG_RUNTIME_EXECUTOR = 'gomp': unknown. Fix:" in out.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_steps_reuse_every_workspace_buffer(dtype):
    """Steady-state fwd+bwd steps of a grouped MoE layer (fp32 weights; bf16 = under autocast,
    as the bf16 recipe runs) take every large buffer from the cache: no miss, so no fresh pages
    to fault in. The shape keeps the standard shape's ratios (rows = experts x hidden, so a
    [S, 2F] bf16 activation and an [E, D, F] fp32 weight gradient are the same bytes and share
    buffers). A former drop policy (a miss dropped as many free bytes as it allocated) missed
    27 buffers in 3 steps here in bf16, 5-15 of ~600 MB a step at the standard shape: each
    step's misses dropped buffers the next step needed."""
    from moeplug.config import ModelConfig, MoEConfig
    from moeplug.moe import MoELayer
    from moeplug.runtime import workspace
    from moeplug.plugin_host import PluginHost
    T, D, F, E, K = 1024, 256, 352, 16, 4
    m = ModelConfig(hidden_size=D, num_heads=4, num_kv_heads=4, num_layers=1, first_k_dense=0,
                    moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F))
    host = PluginHost.load()
    torch.manual_seed(0)
    layer = MoELayer(host.create("router", "topk", {}, m),
                     host.create("dispatcher", "alltoall", {}, m, None),
                     host.create("experts", "grouped", {}, m, E))
    x, grad = torch.randn(T, D, requires_grad=True), torch.randn(T, D)

    def step():
        for t in (*layer.parameters(), x):
            t.grad = None  # zero_grad(set_to_none): last step's gradient buffers are free again
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            y = layer(x)[0]
        y.backward(grad)
    workspace.clear()
    try:
        for _ in range(3):
            step()
        before = workspace.misses()
        assert before > 0  # the warm-up did fill the cache from torch
        for _ in range(3):
            step()
        assert workspace.misses() == before, "steady-state steps allocated"
    finally:
        workspace.clear()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_config_steps_reuse_every_workspace_buffer(precision):
    """The packaged default config at micro-batch 4, whole train steps: after warm-up no step
    allocates a workspace buffer (a new batch each step, so the experts' row counts change).
    With a slack of 1/8 over the high-water mark the bf16 run missed 5 buffers a step, and at
    1/4 again once the grouped expert FFN's forward and backward buffers took other size
    classes (moeplug.runtime.workspace.SLACK)."""
    import yaml

    from moeplug.cli import default_config_path
    from moeplug.config import config_from_dict
    from moeplug.runtime import workspace
    from moeplug.testing.steps import one_process_trainer
    with open(default_config_path()) as f:
        raw = yaml.safe_load(f)
    raw.setdefault("train", {})["micro_batch_size"] = 4
    _, step = one_process_trainer(config_from_dict(raw), precision, num_tokens=200_000)
    workspace.clear()
    try:
        for _ in range(4):
            step()
        before = workspace.misses()
        assert before > 0
        for _ in range(3):
            step()
        assert workspace.misses() == before, "steady-state steps allocated"
    finally:
        workspace.clear()


def test_workspace_never_hands_out_a_live_buffer():
    from moeplug.runtime import workspace

    shape = (workspace.MIN_BYTES // 4,)
    ws = workspace.Workspace()  # a model runtime's; ops reach it through the running arena
    with ws.scope():
        a = workspace.empty(shape, torch.float32)
        view = a[10:20]  # a view keeps the storage alive after `a` is gone
        ptr_a = a.data_ptr()
        del a
        b = workspace.empty(shape, torch.float32)
        assert b.data_ptr() != ptr_a
        del view
        c = workspace.empty(shape, torch.float32)
        assert c.data_ptr() == ptr_a  # freed: reused instead of page-faulting a new one
        assert c.data_ptr() != b.data_ptr()
        small = workspace.empty((4,), torch.float32)  # below MIN_BYTES: the arena's
        assert small.shape == (4,)
    assert ws.misses() == 2 and ws.cached_bytes() == 2 * shape[0] * 4


def test_workspace_is_owned_by_its_model_runtime():
    """No process-wide cache: each model runtime owns a Workspace, which its layers' arenas
    reach; outside any layer ops get torch's buffers; the cache goes with its model."""
    import ast
    import gc
    import inspect
    import weakref

    from moeplug.config import RuntimeSection
    from moeplug.runtime import stash, workspace
    tree = ast.parse(inspect.getsource(workspace))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)]
    one, two = stash.ModelRuntime(RuntimeSection()), stash.ModelRuntime(RuntimeSection())
    kw = dict(num_experts=4, top_k=2, hidden=8, ffn_hidden=16, num_local_experts=4,
              dtype="float32", activation="swiglu", stash_bytes=0)
    h1, h2 = one.register_layer(index=0, **kw), two.register_layer(index=0, **kw)
    assert h1.workspace.cache is one.workspace and h2.workspace.cache is two.workspace
    assert one.workspace is not two.workspace
    n = workspace.MIN_BYTES // 4
    with workspace.arena_scope(h1.workspace):
        workspace.empty((n,), torch.float32)
    assert (one.workspace.misses(), two.workspace.misses()) == (1, 0)
    workspace.empty((n,), torch.float32)  # outside any arena: torch's, counted by no cache
    assert (one.workspace.misses(), two.workspace.misses()) == (1, 0)
    ref = weakref.ref(one.workspace)
    del one, h1
    gc.collect()
    assert ref() is None


def test_workspace_never_grows_past_its_high_water_mark(monkeypatch):
    """The cache's footprint stays within the most bytes its buffers held live at once: a miss
    drops free buffers of other sizes before allocating; sizes within one class share buffers.
    The rule at a slack of 1/4 (the byte counts below are worked out for it; the default slack
    is tuned by the default-config test above)."""
    from moeplug.runtime import workspace
    monkeypatch.setattr(workspace, "SLACK", 1.25)
    ws = workspace.Workspace()
    with ws.scope():
        n = workspace.MIN_BYTES // 4
        a = workspace.empty((4 * n,), torch.float32)
        b = workspace.empty((2 * n,), torch.float32)
        live = ws.cached_bytes()
        assert live == (4 * n + 2 * n) * 4  # powers of two are their own class
        del a, b
        c = workspace.empty((3 * n,), torch.float32)  # a third size: a miss, both are free
        assert ws.cached_bytes() <= live
        assert ws.cached_bytes() >= 3 * n * 4
        ptr = c.data_ptr()
        del c
        # A row count a little off lands in the same class and gets the same buffer.
        d = workspace.empty((3 * n - 7, 1), torch.float32)
        assert d.data_ptr() == ptr and d.shape == (3 * n - 7, 1)
        assert workspace.size_class(3 * n * 4 + 1) <= 3 * n * 4 * 9 // 8
        e = workspace.empty((3 * n,), torch.float32)  # d is live: a new buffer, nothing free
        assert e.data_ptr() != ptr
        # only d (in a's 1 MiB buffer, within MAX_OVERSIZE) and e: the free b was dropped to
        # stay within the high-water mark, the bytes live right now
        assert ws.cached_bytes() == 4 * n * 4 + 3 * n * 4
        with workspace.bypassed():
            before = ws.cached_bytes()
            workspace.empty((8 * n,), torch.float32)
            assert ws.cached_bytes() == before  # bypassed: neither read nor filled
