"""moeplug.quant: bit-exact against the specs' worked examples and against torchao's independent
implementation (torchao.float8 for tensorwise FP8, torchao.prototype.mx_formats for MXFP8 and
NVFP4), including saturation, NaN/Inf, all-zero blocks and subnormals."""

from __future__ import annotations

import pytest
import torch

from moeplug.quant import fp8, mx, nvfp4
from moeplug.quant.recipes import MXFP8, NVFP4, Blockwise, Delayed, Tensorwise
from moeplug.quant.linear import quant_linear

tao_f8 = pytest.importorskip("torchao.float8.float8_utils",
                             reason="torchao is the reference: pip install -e '.[test]'")
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    nvfp4_quantize, per_tensor_amax_to_scale)

SUBNORMAL = 1e-40  # an fp32 subnormal


def special_rows(cols: int) -> torch.Tensor:
    """Rows of blocks covering every edge: random, huge (saturating), all-zero, subnormal,
    a NaN, +-Inf, values straddling rounding ties."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(cols, generator=g) * s for s in (1.0, 1e-3, 1e4)]
    rows.append(torch.zeros(cols))
    rows.append(torch.full((cols,), SUBNORMAL) * torch.arange(cols))
    nan = torch.randn(cols, generator=g)
    nan[3] = float("nan")
    inf = torch.randn(cols, generator=g)
    inf[5], inf[-1] = float("inf"), float("-inf")
    rows += [nan, inf, torch.linspace(-7, 7, cols)]
    return torch.stack(rows)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- FP8 tensorwise / blockwise -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_tensorwise_matches_torchao(dtype, pow2):
    x = special_rows(64)[[0, 1, 2, 4, 7]]  # finite rows: torchao gives Inf amax scale 0
    q, scale = fp8.quantize_tensorwise(x, dtype, pow2)
    ref_scale = tao_f8.amax_to_scale(x.abs().amax(), dtype, pow2)
    ref_q = tao_f8.to_fp8_saturated(x * ref_scale, dtype)
    assert torch.equal(scale, ref_scale)
    assert same_bits(q, ref_q)


def test_tensorwise_worked_example_and_specials():
    # amax 2 -> scale 448 / 2 = 224; 1.0 -> 224 is exact in E4M3, 2.0 -> 448 (the max).
    q, scale = fp8.quantize_tensorwise(torch.tensor([1.0, -2.0, 0.0]))
    assert scale.item() == 224.0 and q.float().tolist() == [224.0, -448.0, 0.0]
    # An Inf does not zero its neighbours: scale 1, the Inf saturates, NaN stays NaN.
    q, scale = fp8.quantize_tensorwise(torch.tensor([1.0, float("inf"), float("nan"), 1e6]))
    assert scale.item() == 1.0
    assert q.float()[[0, 1, 3]].tolist() == [1.0, 448.0, 448.0] and q.float()[2].isnan()
    # All zeros: a finite scale and zero payload.
    q, scale = fp8.quantize_tensorwise(torch.zeros(8))
    assert torch.isfinite(scale) and not q.float().any()


def test_blockwise_is_tensorwise_per_block_and_tiles_per_tile():
    x = special_rows(256)[[0, 1, 2, 3, 4, 7]]
    q, s = fp8.quantize_blockwise(x, -1, 128, power_of_2=False)
    assert s.shape == (6, 2)
    for r in range(6):
        for b in range(2):
            qt, st = fp8.quantize_tensorwise(x[r, b * 128:(b + 1) * 128])
            assert same_bits(q[r, b * 128:(b + 1) * 128], qt) and s[r, b] == st
    w = torch.randn(200, 300)  # ragged: tiles are zero-padded
    qw, sw = fp8.quantize_tiles(w, 128)
    assert sw.shape == (2, 3)
    qt, st = fp8.quantize_tensorwise(w[128:, 256:], power_of_2=True)
    assert same_bits(qw[128:, 256:], qt) and sw[1, 2] == st
    back = fp8.dequantize_tiles(qw, sw, 128)
    # E4M3 rounds to half an ulp (3 mantissa bits), subnormals to half of 2^-9, in scaled units.
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 2 ** -10 / sw.min()).all()


def test_delayed_scaling_uses_the_history():
    s = fp8.DelayedScaler(history_len=2, algo="max", dtype=fp8.E4M3)
    _, first = s.quantize(torch.tensor([4.0]))
    assert first.item() == 1.0  # empty history: TE's initial scale
    _, again = s.quantize(torch.tensor([3.0]))
    assert again.item() == 1.0  # the scale holds for the whole step
    s.commit(s.pending)  # step 1's amax: the max of its GEMMs' (4, 3)
    assert s.history.tolist() == [4.0] and s.pending is None
    _, second = s.quantize(torch.tensor([1.0]))
    assert second.item() == 448.0 / 4.0  # the previous step's amax
    s.commit(s.pending)
    s.quantize(torch.tensor([2.0]))
    s.commit(s.pending)  # history is now [1, 2]: the 4 has rolled out
    assert s.scale.item() == 448.0 / 2.0
    s.commit(None)  # no GEMM recorded an amax this step: nothing appended
    assert s.history.tolist() == [1.0, 2.0]
    recent = fp8.DelayedScaler(history_len=4, algo="most_recent", dtype=fp8.E4M3)
    for v in (8.0, 1.0):
        recent.quantize(torch.tensor([v]))
        recent.commit(recent.pending)
    assert recent.scale.item() == 448.0


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_delayed_scaling_keeps_the_scale_through_a_zero_or_non_finite_amax(bad):
    """TE's rule: fp8_max / amax only where amax is finite and > 0, else the previous scale."""
    s = fp8.DelayedScaler(history_len=1, algo="max", dtype=fp8.E4M3)
    s.quantize(torch.tensor([2.0]))
    s.commit(s.pending)
    s.quantize(torch.tensor([bad]))
    s.commit(s.pending)
    assert s.scale.item() == 448.0 / 2.0
    s.restore([4.0], 112.0)  # a checkpoint's history and scale, as saved
    assert s.history.tolist() == [4.0] and s.scale.item() == 112.0


def test_delayed_scaling_margin_divides_the_scale_by_a_power_of_two():
    s = fp8.DelayedScaler(history_len=1, algo="max", dtype=fp8.E4M3, margin=2)
    s.quantize(torch.tensor([2.0]))
    s.commit(s.pending)
    assert s.scale.item() == 448.0 / 2.0 / 4.0


# ---- MXFP8 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_mx_matches_torchao(dtype):
    x = special_rows(64)
    q, code = mx.quantize_mx(x, -1, dtype)
    ref_code, ref_q = to_mx(x, dtype, 32)
    assert torch.equal(code, ref_code.view(torch.uint8))
    assert same_bits(q, ref_q)


def test_mx_spec_worked_examples():
    # OCP MX v1.0 6.3: X = 2^(floor(log2 amax) - 8) for E4M3.
    block = torch.zeros(32)
    block[0], block[1] = 1.0, 0.001
    q, code = mx.quantize_mx(block)
    assert code.item() == 127 - 8 and q.float()[0].item() == 256.0
    block[0] = 500.0  # floor(log2 500) = 8 -> X = 1; 500 saturates to 448
    q, code = mx.quantize_mx(block)
    assert code.item() == 127 and q.float()[0].item() == 448.0
    q, code = mx.quantize_mx(torch.zeros(32))  # zero block: the smallest scale, 2^-127
    assert code.item() == 0 and mx.e8m0_to_float(code).item() == 2.0 ** -127
    block[5] = float("nan")  # NaN anywhere: E8M0 NaN, the whole block dequantizes to NaN
    q, code = mx.quantize_mx(block)
    assert code.item() == 255 and mx.dequantize_mx(q, code).isnan().all()


def test_mx_axis_and_padding():
    x = torch.randn(40, 50)  # 50 is padded to 64 along axis 1; axis 0 blocks run down columns
    q1, c1 = mx.quantize_mx(x, 1)
    assert c1.shape == (40, 2) and q1.shape == x.shape
    q0, c0 = mx.quantize_mx(x, 0)
    qt, ct = mx.quantize_mx(x.t().contiguous(), 1)
    assert same_bits(q0, qt.t()) and torch.equal(c0, ct)  # scales [columns, blocks]


# ---- NVFP4 ----------------------------------------------------------------------------------

def test_e2m1_round_to_nearest_even():
    # Grid 0 .5 1 1.5 2 3 4 6; ties go to the even code (0, 1.0, 2.0, 4.0 are even codes).
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.6, 9.0, -0.75, -5.5])
    back = nvfp4.e2m1_decode(nvfp4.e2m1_encode(x.clamp(-6, 6)))
    assert back.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 6.0, -1.0, -6.0]


def test_nvfp4_matches_torchao():
    x = special_rows(64)[[0, 1, 2, 3, 4, 7]]  # torchao's packing has no NaN code
    codes, scale, pts = nvfp4.quantize_nvfp4(x)
    ref_pts = per_tensor_amax_to_scale(x.abs().amax())
    ref_scale, ref_packed = nvfp4_quantize(x, 16, ref_pts)
    assert torch.equal(pts, ref_pts)
    assert same_bits(scale, ref_scale.reshape(scale.shape))
    assert torch.equal(codes, unpack_uint4(ref_packed).reshape(codes.shape))


def test_nvfp4_worked_example_and_nan():
    # amax 6 in one block of the tensor: per-tensor 6/2688, block scale 448 -> x*... = x exactly.
    x = torch.tensor([6.0, -3.0, 1.5, 0.5] + [0.0] * 12)
    codes, scale, pts = nvfp4.quantize_nvfp4(x)
    assert scale.float().item() == 448.0
    assert torch.equal(nvfp4.dequantize_nvfp4(codes, scale, pts), x)
    x[7] = float("nan")
    codes, scale, pts = nvfp4.quantize_nvfp4(torch.cat([x, torch.ones(16)]))
    back = nvfp4.dequantize_nvfp4(codes, scale, pts)
    assert back[:16].isnan().all() and back[16:].isnan().all()  # NaN per-tensor amax


def test_nvfp4_tiles_share_one_scale_per_16x16():
    w = torch.randn(48, 40)
    codes, scale, pts = nvfp4.quantize_nvfp4_tiles(w)
    assert scale.shape == (3, 3)
    tile = w[16:32, 32:]  # a ragged 16 x 8 tile: one scale from its own amax
    s_tile = (tile.abs().amax() / 6 / pts).to(torch.float8_e4m3fn)
    assert same_bits(scale[1, 2], s_tile)
    want = nvfp4.e2m1_encode((tile * ((1 / pts) / s_tile.float())).clamp(-6, 6))
    assert torch.equal(codes[16:32, 32:], want)


def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(1)
    x = torch.full((200_000,), 2.25)  # between 2 and 3: up with probability 1/4
    back = nvfp4.e2m1_decode(nvfp4.e2m1_encode(x, g))
    assert set(back.unique().tolist()) == {2.0, 3.0}
    assert abs(back.mean().item() - 2.25) < 0.01
    assert nvfp4.e2m1_decode(nvfp4.e2m1_encode(torch.tensor([3.0]), g)).item() == 3.0


def test_random_hadamard_is_orthonormal_and_keeps_the_product():
    signs = torch.tensor([1, -1] * 8)
    t = nvfp4.random_hadamard(signs)
    assert torch.allclose(t @ t.t(), torch.eye(16), atol=1e-6)
    a, b = torch.randn(40, 8), torch.randn(40, 6)  # 40 rows: padded to 48 along the axis
    ra, rb = nvfp4.rht(a, 0, t), nvfp4.rht(b, 0, t)
    assert ra.shape == (48, 8)
    assert torch.allclose(ra.t() @ rb, a.t() @ b, atol=1e-4)
    assert not torch.allclose(ra[:40], a)


# ---- recipes applied to a GEMM --------------------------------------------------------------

RECIPES = [Tensorwise(), Delayed(), Blockwise(), MXFP8(), NVFP4()]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_quant_linear_is_the_quantized_product(recipe):
    torch.manual_seed(0)
    x = torch.randn(48, 160, requires_grad=True)
    w = torch.randn(24, 160, requires_grad=True)
    y = quant_linear(x, w, None, recipe, key="t")
    if not isinstance(recipe, Delayed):  # delayed: the forward consumed a history step
        exact = recipe.fake(x.detach(), "x", 1) @ recipe.fake(w.detach(), "w", 1).t()
        assert torch.equal(y, exact)
    ref = x.detach() @ w.detach().t()
    tol = 0.25 if isinstance(recipe, NVFP4) else 0.08
    assert (y - ref).norm() / ref.norm() < tol
    g = torch.randn_like(y)
    y.backward(g)
    dx_ref, dw_ref = g @ w.detach(), g.t() @ x.detach()
    assert (x.grad - dx_ref).norm() / dx_ref.norm() < tol
    assert (w.grad - dw_ref).norm() / dw_ref.norm() < tol
    assert x.grad.dtype == w.grad.dtype == torch.float32


# ---- moe_act recompute and the offload marks on the emulated experts -------------------------

def _experts_grads(recipe, activation, recompute, dtype):
    """quant_expert_mlp's output and every gradient for seeded inputs, and the bytes of each
    tensor autograd saved for backward (weights aside)."""
    from moeplug.quant import quant_expert_mlp
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([40, 0, 56, 32])
    X = 64 if activation == "swiglu" else 32
    x = torch.randn(128, 48, generator=gen).requires_grad_(True)
    p = torch.rand(128, generator=gen).requires_grad_(True)
    w1 = torch.randn(4, X, 48, generator=gen).mul_(0.1).requires_grad_(True)
    w2 = torch.randn(4, 48, 32, generator=gen).mul_(0.1).requires_grad_(True)
    saved = []
    weights = {w.untyped_storage().data_ptr() for w in (w1, w2)}

    def pack(t):  # bytes of what autograd keeps, the weights aside
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
        y = quant_expert_mlp(x, p, counts, w1, w2, activation, recipe, recompute)
    y.float().square().sum().backward()
    return y, [t.grad for t in (x, p, w1, w2)], saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("recipe_cls", [Tensorwise, Delayed, Blockwise, MXFP8, NVFP4],
                         ids=lambda c: c.__name__)
def test_moe_act_recompute_of_the_emulated_experts_is_bitwise_and_keeps_less(
        recipe_cls, activation, dtype):
    """Once ignored (config now lets it through): FC2 keeps FC1's output and rebuilds
    act(h) * p in backward under the forward's autocast, so output and gradients are bitwise
    those of keeping the activation, and fewer tensors are saved."""
    # a fresh recipe each: NVFP4's stochastic rounding draws from the recipe's own generator
    y0, g0, saved0 = _experts_grads(recipe_cls(), activation, False, dtype)
    y1, g1, saved1 = _experts_grads(recipe_cls(), activation, True, dtype)
    assert torch.equal(y0, y1)
    for name, a, b in zip(("x", "probs", "w1", "w2"), g0, g1):
        assert a is not None and torch.equal(a, b), name
    assert sum(saved1) < sum(saved0), (sum(saved1), sum(saved0))
