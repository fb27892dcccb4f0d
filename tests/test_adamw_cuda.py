"""The CUDA AdamW and stochastic-rounding kernels (runtime_cpp/cuda/src/adamw.cu) against the
CPU kernels (runtime_cpp/src/adamw.cpp), which tests/test_adamw_kernel.py proves bitwise torch's
step: the same inputs on both devices give the same bits, for every parameter/moment dtype
pair, the main-copy step and the rounding, over several steps; and the precision-aware
optimizer stepped on the GPU (``fused_cuda=True``) ends bitwise where the same optimizer ends
on the CPU.

Written on a machine without a GPU and not yet run on one: when these pass on a GPU,
``LowPrecisionMomentsAdamW.fused_cuda`` can default to true (docs/GPU.md).

Marked ``cuda``: skipped with the reason where torch sees no GPU or the extension is not built.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.ops.adamw import adamw_step_, adamw_step_main_, stochastic_round_bf16_
from moeplug.training.optim import LowPrecisionMomentsAdamW

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="torch sees no CUDA GPU on this machine")]

SIZES = (1, 1000, 70_001, 3_000_017)  # one element; odd tails; more than one grid's stride


@pytest.fixture(scope="module", autouse=True)
def _extension():
    import moeplug.runtime as rt
    try:
        rt.get_cuda_runtime()
    except rt.RuntimeMissingError as exc:
        pytest.skip(str(exc))


def _values(n: int, seed: int) -> torch.Tensor:
    """fp32 values over many binades and both signs, with zeros, infinities and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 1.0, -2.5])
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, or both NaN (payloads are not part of the contract)."""
    a, b = a.cpu(), b.cpu()
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    both_nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(ints) == b.view(ints)) | both_nan).all())


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32], ids=["p_bf16", "p_fp32"])
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32], ids=["m_bf16", "m_fp32"])
@pytest.mark.parametrize("wd,beta1", [(0.1, 0.9), (0.0, 0.3)])
def test_cuda_adamw_step_is_bitwise_the_cpu_kernel(param_dtype, moment_dtype, wd, beta1):
    lr, beta2, eps = 3e-3, 0.95, 1e-8
    for n in SIZES:
        g = torch.Generator().manual_seed(n)
        cpu = [_values(n, n).to(param_dtype), torch.zeros(n, dtype=moment_dtype),
               torch.zeros(n, dtype=moment_dtype)]
        gpu = [t.cuda() for t in cpu]
        for t in range(1, 5):
            grad = (torch.randn(n, generator=g) * 10.0 ** (t - 3)).to(param_dtype)
            kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, step=t)
            adamw_step_(cpu[0], grad, cpu[1], cpu[2], **kw)
            adamw_step_(gpu[0], grad.cuda(), gpu[1], gpu[2], **kw)
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), gpu, cpu):
                assert _same(a, b), (name, n, t)
        assert n < 1000 or not torch.equal(cpu[0], _values(n, n).to(param_dtype))


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32], ids=["m_bf16", "m_fp32"])
def test_cuda_main_copy_step_is_bitwise_the_cpu_kernel(moment_dtype):
    kw0 = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for n in SIZES:
        g = torch.Generator().manual_seed(n)
        main0 = _values(n, n + 1)
        cpu = [main0.clone(), torch.zeros(n, dtype=moment_dtype),
               torch.zeros(n, dtype=moment_dtype), main0.bfloat16()]
        gpu = [t.cuda() for t in cpu]
        for t in range(1, 5):
            grad = (torch.randn(n, generator=g) * 10.0 ** (t - 3)).bfloat16()
            adamw_step_main_(cpu[0], grad, cpu[3], cpu[1], cpu[2], step=t, **kw0)
            adamw_step_main_(gpu[0], grad.cuda(), gpu[3], gpu[1], gpu[2], step=t, **kw0)
            for name, a, b in zip(("main", "exp_avg", "exp_avg_sq", "param"), gpu, cpu):
                assert _same(a, b), (name, n, t)


def test_cuda_stochastic_round_is_bitwise_the_cpu_kernel():
    for n in SIZES:
        x = _values(n, n + 2)
        for step in (1, 977, 2 ** 32 + 5):
            want = torch.empty(n, dtype=torch.bfloat16)
            got = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
            stochastic_round_bf16_(want, x, step)
            stochastic_round_bf16_(got, x.cuda(), step)
            assert _same(got, want), (n, step)


@pytest.mark.parametrize("main_params", [True, False], ids=["fp32_main", "bf16_master"])
def test_precision_aware_adamw_on_cuda_ends_where_the_cpu_one_does(main_params):
    """bf16 parameters through the optimizer, 5 steps, a new lr each: on the GPU (the CUDA
    kernels) and on the CPU (the C++ kernels), parameters and every state tensor bitwise."""
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (1000,), (7, 5, 3)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]

    def make(params):
        return LowPrecisionMomentsAdamW(
            [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:],
                                                           "weight_decay": 0.0}],
            lr=1e-3, betas=(0.9, 0.95), eps=1e-8, moment_dtype=torch.float32,
            main_params=main_params, fused_cuda=True)
    opts = make(cpu), make(gpu)
    start = [p.detach().clone() for p in cpu]
    for step in range(5):
        for p, q in zip(cpu, gpu):
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).bfloat16()
            q.grad = p.grad.cuda()
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (step + 1)
            opt.step()
    for p, q in zip(cpu, gpu):
        assert _same(q, p)
        for key, value in opts[0].state[p].items():
            assert _same(opts[1].state[q][key], value), key
    assert not any(torch.equal(p.detach(), p0) for p, p0 in zip(cpu, start))
