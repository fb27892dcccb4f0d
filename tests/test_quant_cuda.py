"""The emulated recipes against real FP8 GEMMs on a GPU (``torch._scaled_mm``), and the recipes
running on CUDA tensors. Marked ``cuda``: skipped with the reason where torch sees no GPU (not
yet run on a GPU)."""

from __future__ import annotations

import pytest
import torch

from moeplug.quant import MXFP8, NVFP4, Blockwise, Delayed, Tensorwise, fp8, quant_linear

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HAS_CUDA, reason="torch sees no CUDA GPU on this machine")]


def _fp8_gemm_ok() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)  # Ada / Hopper and newer


@pytest.mark.skipif(not _fp8_gemm_ok(),
                    reason="needs a GPU of compute capability >= 8.9 (FP8 GEMMs)")
def test_scaled_mm_tensorwise_equals_the_emulation():
    torch.manual_seed(0)
    x, w = torch.randn(256, 512), torch.randn(128, 512)
    xq, sx = fp8.quantize_tensorwise(x)
    wq, sw = fp8.quantize_tensorwise(w)
    emulated = (xq.float() / sx) @ (wq.float() / sw).t()
    real = torch._scaled_mm(xq.cuda(), wq.cuda().t(), scale_a=(1 / sx).cuda(),
                            scale_b=(1 / sw).cuda(), out_dtype=torch.float32)
    # FP8 products are exact in fp32, but Hopper's FP8 tensor cores accumulate with fewer
    # mantissa bits than fp32 (the limit DeepSeek-V3 works around by promoting partial sums):
    # on an H200 the largest difference was 3.9e-3 at |x| ~ 35 over a 512-long dot product.
    # A wrong scale (1/s for s) or operand would be off by orders of magnitude more.
    # So the check is the relative error of the whole product, not element-wise closeness
    # (elements near zero carry the same absolute error).
    rel = (real.cpu() - emulated).norm() / emulated.norm()
    assert rel < 5e-4, rel


@pytest.mark.parametrize("recipe", [Tensorwise(), Delayed(), Blockwise(), MXFP8(), NVFP4()],
                         ids=lambda r: r.name)
def test_recipes_run_on_cuda_tensors_as_on_the_cpu(recipe):
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(96, 256)
    cpu = recipe.fake(x, "x", 1, key="k") @ recipe.fake(w, "w", 1, key="k").t()
    gpu = quant_linear(x.cuda(), w.cuda(), None, recipe, key="k2")
    # delayed: both keys' first step runs at scale 1 (the GPU call starts its own history)
    assert torch.allclose(gpu.cpu(), cpu, rtol=1e-4, atol=1e-3)


def test_delayed_scaling_keeps_the_steps_amaxes_on_the_gpu_until_the_step_ends():
    """No host sync per GEMM: the amaxes stay on the device until end_step, which moves the
    step's (max) into the history and the scale, as on the CPU."""
    torch.manual_seed(0)
    recipe = Delayed()
    w = torch.nn.Parameter(torch.randn(96, 256, device="cuda"))
    x = torch.randn(64, 256, device="cuda")
    quant_linear(x, w, None, recipe)
    quant_linear(x * 2, w, None, recipe)
    s = recipe.scalers[(id(w), "x")]
    assert s.pending.is_cuda and s.history.numel() == 0
    recipe.end_step({id(w): "w"}, {})
    amax = (x * 2).abs().max().float().cpu()
    assert s.history.tolist() == [amax.item()] and s.pending is None
    assert s.scale.item() == fp8.amax_to_scale(amax, fp8.E4M3).item()
