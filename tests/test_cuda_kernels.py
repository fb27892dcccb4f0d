"""CUDA kernels of moeplug._runtime_cuda against the plain-torch references.

Marked `cuda`: they need a GPU and the extension built with MOEPLUG_WITH_CUDA=ON, and skip with
the reason otherwise. CI (.ci/run) compiles and links the extension on every run without a GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import moeplug.runtime as rt
from moeplug.ops import reference
from moeplug.routing.scores import topk_routing

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def cu():
    try:
        return rt.get_cuda_runtime()
    except rt.RuntimeMissingError as exc:
        pytest.skip(str(exc))


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _routed(T=37, K=3, D=24, E=8, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(T, D).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    x_SD, row_map, _ = reference.permute(x, ids, E)
    return x, ids, x_SD, row_map


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_matches_reference(cu, dtype):
    x, _, want_SD, row_map = _routed(dtype=dtype)
    T, K = row_map.shape
    x_d, rm_d = x.cuda(), row_map.cuda()
    out = torch.empty(T * K, x.shape[1], dtype=dtype, device="cuda")
    cu.permute(x=x_d.data_ptr(), row_map=rm_d.data_ptr(), x_out=out.data_ptr(), num_tokens=T,
               top_k=K, hidden=x.shape[1], dtype=rt.DTYPE_CODES[dtype], stream=_stream())
    assert torch.equal(out.cpu(), want_SD)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_unpermute_matches_reference(cu, dtype, weighted):
    _, _, y_SD, row_map = _routed(dtype=dtype)
    T, K = row_map.shape
    probs = torch.rand(T, K) if weighted else None
    want = reference.unpermute(y_SD, row_map, probs)
    y_d, rm_d = y_SD.cuda(), row_map.cuda()
    p_d = probs.cuda() if weighted else None
    out = torch.empty(T, y_SD.shape[1], dtype=dtype, device="cuda")
    cu.unpermute(y=y_d.data_ptr(), row_map=rm_d.data_ptr(), probs=p_d.data_ptr() if weighted else 0,
                 y_out=out.data_ptr(), num_tokens=T, top_k=K, hidden=y_SD.shape[1],
                 dtype=rt.DTYPE_CODES[dtype], stream=_stream())
    torch.testing.assert_close(out.cpu(), want, **TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_forward_and_backward_match_reference(cu, dtype, weighted):
    S, F = 29, 40
    h = (torch.randn(S, 2 * F) * 3).to(dtype).requires_grad_()
    probs = torch.rand(S, requires_grad=True) if weighted else None
    want = reference.swiglu(h, probs)
    grad_a = torch.randn(S, F).to(dtype)
    want.backward(grad_a)

    h_d, g_d = h.detach().cuda(), grad_a.cuda()
    p_d = probs.detach().cuda() if weighted else None
    a = torch.empty(S, F, dtype=dtype, device="cuda")
    code, s = rt.DTYPE_CODES[dtype], _stream()
    p_ptr = p_d.data_ptr() if weighted else 0
    cu.swiglu_forward(h=h_d.data_ptr(), probs=p_ptr, a=a.data_ptr(), num_rows=S, ffn_hidden=F,
                      dtype=code, stream=s)
    grad_h = torch.empty_like(h_d)
    grad_p = torch.empty(S, device="cuda") if weighted else None
    cu.swiglu_backward(grad_a=g_d.data_ptr(), h=h_d.data_ptr(), probs=p_ptr,
                       grad_h=grad_h.data_ptr(), grad_probs=grad_p.data_ptr() if weighted else 0,
                       num_rows=S, ffn_hidden=F, dtype=code, stream=s)
    torch.testing.assert_close(a.cpu(), want.detach(), **TOL[dtype])
    torch.testing.assert_close(grad_h.cpu(), h.grad, **TOL[dtype])
    if weighted:
        torch.testing.assert_close(grad_p.cpu(), probs.grad, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("score,renormalize,bias", [("softmax", True, False),
                                                    ("softmax", False, False),
                                                    ("sigmoid", True, True),
                                                    ("sigmoid", False, False)])
@pytest.mark.parametrize("E,K", [(8, 2), (256, 8)])
def test_topk_route_matches_topk_routing(cu, dtype, score, renormalize, bias, E, K):
    T = 53
    torch.manual_seed(0)
    # Distinct logits, exact in bf16 (multiples of 1/32 below 8): no ties for top-k to break.
    logits = ((torch.stack([torch.randperm(E) for _ in range(T)]) - E / 2) / 32).to(dtype)
    bias_E = torch.randn(E) * 0.1 if bias else None
    want_p, want_ids = topk_routing(logits.float(), K, score_function=score,
                                    renormalize=renormalize, expert_bias_E=bias_E,
                                    scaling_factor=2.5)
    l_d = logits.cuda()
    b_d = bias_E.cuda() if bias else None
    probs = torch.empty(T, K, device="cuda")
    ids = torch.empty(T, K, dtype=torch.int64, device="cuda")
    cu.topk_route(logits=l_d.data_ptr(), bias=b_d.data_ptr() if bias else 0,
                  probs=probs.data_ptr(), ids=ids.data_ptr(), num_tokens=T, num_experts=E,
                  top_k=K, score=0 if score == "softmax" else 1, renormalize=renormalize,
                  scaling_factor=2.5, dtype=rt.DTYPE_CODES[dtype], stream=_stream())
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(probs.cpu(), want_p, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_topk_route_rejects_too_many_experts(cu):
    with pytest.raises(ValueError, match="num_experts <= 256.*num_experts=300"):
        cu.topk_route(logits=0, bias=0, probs=0, ids=0, num_tokens=1, num_experts=300, top_k=2,
                      score=0, renormalize=True, scaling_factor=1.0, dtype=0)


@pytest.mark.cuda
def test_runtime_cuda_stream_orders_work_with_torchs_stream(cu):
    # torch writes h on its stream; the runtime stream waits for it, runs SwiGLU, and torch's
    # stream waits on the runtime's event before reading a.
    side = cu.stream("test.compute")
    assert cu.stream("test.compute") is side
    S, F = 4096, 512
    h = torch.empty(S, 2 * F, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep torch's stream busy so a missing wait would race
    h.normal_()
    a = torch.zeros(S, F, device="cuda")
    side.wait_stream(_stream())
    cu.swiglu_forward(h=h.data_ptr(), probs=0, a=a.data_ptr(), num_rows=S, ffn_hidden=F,
                      dtype=0, stream=side.handle)
    done = side.record()
    torch.cuda.current_stream().wait_stream(torch.cuda.ExternalStream(side.handle))
    done.synchronize()
    torch.testing.assert_close(a, reference.swiglu(h), atol=1e-5, rtol=1e-5)


def test_version_reports_the_cuda_extension_state():
    # No GPU needed: `moeplug --version` says whether _runtime_cuda is loaded, and why not.
    out = subprocess.run([sys.executable, "-m", "moeplug.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    if torch.cuda.is_available() and rt.cuda_extension_built():
        assert "cuda_extension=loaded (CUDA runtime" in out
    elif torch.cuda.is_available():
        assert "cuda_extension=moeplug._runtime_cuda is not built" in out
    else:
        assert "cuda_extension=moeplug._runtime_cuda is not loaded: torch sees no GPU" in out


@pytest.mark.cuda
@pytest.mark.parametrize("score,renormalize,bias,groups", [
    ("softmax", True, False, None), ("softmax", False, False, (4, 2, "topk_share")),
    ("sigmoid", True, True, (8, 4, "topk_share")), ("sqrtsoftplus", True, True, (4, 2, "top2_sum")),
    ("sigmoid", False, False, None)])
@pytest.mark.parametrize("aux_counts,B", [(None, 1), ("plain_topk", 1), ("routed", 4)])
def test_route_forward_backward_match_the_torch_routing(cu, score, renormalize, bias, groups,
                                                        aux_counts, B):
    """The CUDA fused router against the plain-torch routing math and autograd (as the CPU
    kernel in tests/test_fused_router.py): ids, probs, aux statistics, logit gradients."""
    from moeplug.routing.aux_losses import counts_for_aux, expert_counts
    from moeplug.routing.fused import _spec
    from moeplug.routing.scores import aux_scores
    T, E, K = 64, 64, 8
    gen = torch.Generator().manual_seed(1)
    # Distinct logits (a permutation scaled): no near-ties for the two exps to resolve apart.
    logits = (torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]) - E / 2) / 16
    bias_E = torch.randn(E, generator=gen) * 1e-3 if bias else None
    g_TK, h_BE = torch.randn(T, K, generator=gen), torch.randn(B, E, generator=gen)
    route = dict(score_function=score, renormalize=renormalize, expert_bias_E=bias_E,
                 scaling_factor=2.5)
    if groups:
        route.update(num_groups=groups[0], group_topk=groups[1], group_score=groups[2])
    z = logits.clone().requires_grad_()
    want_p, want_ids = topk_routing(z, K, **route)
    loss = (want_p * g_TK).sum()
    if aux_counts:
        s_TE = aux_scores(z, score)
        want_mean = s_TE.view(B, T // B, E).mean(1)
        ids_c = counts_for_aux(s_TE, want_ids, aux_counts)
        want_counts = torch.stack([expert_counts(c, E) for c in ids_c.view(B, -1, K)])
        loss = loss + (want_mean * h_BE).sum()
    loss.backward()
    spec = _spec(T, E, K, score, renormalize, route.get("num_groups"), route.get("group_topk"),
                 route.get("group_score", "topk_share"), 2.5, aux_counts, B if aux_counts else 1)
    l_d, b_d = logits.cuda(), None if bias_E is None else bias_E.cuda()
    probs = torch.empty(T, K, device="cuda")
    ids = torch.empty(T, K, dtype=torch.int64, device="cuda")
    mean = torch.empty(spec["num_sequences"], E, device="cuda")
    counts = torch.empty(spec["num_sequences"], E, dtype=torch.int64, device="cuda")
    cu.route_forward(logits=l_d.data_ptr(), bias=0 if b_d is None else b_d.data_ptr(),
                     probs=probs.data_ptr(), ids=ids.data_ptr(), aux_mean=mean.data_ptr(),
                     counts=counts.data_ptr(), stream=_stream(), **spec)
    grad = torch.empty(T, E, device="cuda")
    gp, gm = g_TK.cuda(), h_BE.cuda()
    cu.route_backward(logits=l_d.data_ptr(), ids=ids.data_ptr(), grad_probs=gp.data_ptr(),
                      grad_aux_mean=gm.data_ptr() if aux_counts else 0,
                      grad_logits=grad.data_ptr(), stream=_stream(), **spec)
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(probs.cpu(), want_p.detach(), atol=1e-5, rtol=1e-5)
    if aux_counts:
        assert torch.equal(counts.cpu(), want_counts)
        torch.testing.assert_close(mean.cpu(), want_mean.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad.cpu(), z.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [24, 13])  # 24: the 16-byte vector path (bf16: 48 B rows); 13: scalar
def test_cuda_ops_permute_unpermute_autograd_match_the_torch_reference(cu, dtype, D):
    from moeplug.ops import cuda_ops
    torch.manual_seed(1)
    T, K, E = 45, 3, 7
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    x = torch.randn(T, D, device="cuda").to(dtype)
    dy = torch.randn(T, D, device="cuda").to(dtype)
    got, want = {}, {}
    for out, impl in ((got, cuda_ops), (want, reference)):
        xi = x.clone().requires_grad_()
        x_SD, row_map, counts = impl.permute(xi, ids, E)
        w_SD = torch.randn(x_SD.shape, generator=torch.Generator().manual_seed(2)).to(x_SD)
        y = impl.unpermute(x_SD * w_SD, row_map)
        y.backward(dy)
        out.update(x_SD=x_SD.detach(), row_map=row_map, counts=counts.cpu(), y=y.detach(),
                   grad=xi.grad)
    assert torch.equal(got["x_SD"], want["x_SD"]) and torch.equal(got["row_map"], want["row_map"])
    assert torch.equal(got["counts"], want["counts"])
    for name in ("y", "grad"):
        torch.testing.assert_close(got[name], want[name], **TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("F", [40, 13])  # 40: the 16-byte vector path; 13: the scalar one
def test_cuda_ops_swiglu_autograd_matches_the_torch_reference(cu, dtype, weighted, F):
    from moeplug.ops import cuda_ops
    torch.manual_seed(3)
    S = 33
    h = (torch.randn(S, 2 * F, device="cuda") * 3).to(dtype)
    p = torch.rand(S, device="cuda") if weighted else None
    da = torch.randn(S, F, device="cuda").to(dtype)
    grads = {}
    for name, fn in (("cuda", cuda_ops.swiglu), ("ref", reference.swiglu)):
        hi = h.clone().requires_grad_()
        pi = p.clone().requires_grad_() if weighted else None
        a = fn(hi, pi)
        a.backward(da)
        grads[name] = (a.detach(), hi.grad, pi.grad if weighted else None)
    for g, w in zip(grads["cuda"], grads["ref"]):
        if w is not None:
            torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("dropped", [False, True])
def test_device_counts_and_row_map_equal_bincount_and_the_reference(dropped):
    """The sync-free counting and row numbering of the CUDA path are plain torch, so they are
    checked on the CPU too (on a GPU they run as they do here, on device tensors)."""
    from moeplug.ops import cuda_ops
    torch.manual_seed(4)
    T, K, E = 61, 3, 9
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    keep = torch.rand(T, K) > 0.3 if dropped else None
    want = torch.bincount(ids.reshape(-1)[keep.reshape(-1)] if dropped else ids.reshape(-1),
                          minlength=E)
    assert torch.equal(cuda_ops.device_counts(ids, E, keep), want)
    row_map, counts = cuda_ops.row_map(ids, E)
    _, want_row_map, want_counts = reference.permute(torch.zeros(T, 1), ids, E)
    assert torch.equal(row_map, want_row_map) and torch.equal(counts, want_counts)
