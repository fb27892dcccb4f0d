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
    from moeplug.modules.build import build_model
    from moeplug.modules.moe import MoELayer
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


@pytest.mark.cuda
@NEEDS_GPU
def test_runtime_graph_replay_equals_eager_forward_and_backward():
    from moeplug.cuda_graph import capture
    from moeplug.modules.static_moe import one_rank
    g = torch.Generator().manual_seed(0)
    T, D, F, E, K = 64, 32, 16, 4, 2
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.1).cuda()
    w2 = (torch.randn(E, D, F, generator=g) * 0.1).cuda()

    def step(x_TD, ids_TK, probs_TK):
        x = x_TD.detach().requires_grad_(True)
        y, _, _ = one_rank(x, ids_TK, None, probs_TK, w13, w2, E, T * K // E * 2, "swiglu",
                           False)
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
