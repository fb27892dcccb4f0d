"""Runtime kernels at the standard MoE shape, each timed interleaved with its baselines.

Shape legend: T tokens, K top-k, E experts, D hidden, F expert FFN hidden, S = T*K rows.
Standard shape: T=4096, K=4, E=16, D=1024, F=1408 (S=16384 rows, balanced counts).

Run: pytest -q benchmarks/test_bench_kernels.py -s   (about 2-3 minutes on 2 cores)
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.conftest import gbytes_per_s, gflops, interleave
from moeplug import ops
from moeplug.ops import reference as ref

T, K, E, D, F = 4096, 4, 16, 1024, 1408
S = T * K
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def balanced_ids(gen: torch.Generator) -> torch.Tensor:
    return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_permute(benchmark, report, dtype_name):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(0)
    x_TD = torch.randn(T, D, generator=gen).to(dtype)
    ids_TK = balanced_ids(gen)
    src_SD, dst_SD = torch.randn(S, D).to(dtype), torch.empty(S, D, dtype=dtype)
    times = interleave({
        "kernel": lambda: ops.permute(x_TD, ids_TK, E),
        "reference": lambda: ref.permute(x_TD, ids_TK, E),
        "memcpy": lambda: dst_SD.copy_(src_SD),  # the S*D output bytes, written once
    }, repeats=7)
    nbytes = S * D * x_TD.element_size()
    name = f"permute {dtype_name}"
    report.row(name, "speed vs memcpy", times["memcpy"] / times["kernel"],
               note=f"{gbytes_per_s(nbytes, times['kernel']):.1f} GB/s written")
    report.row(name, "speedup vs torch ref", times["reference"] / times["kernel"])
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(ops.permute, args=(x_TD, ids_TK, E), rounds=3, iterations=1)
    assert torch.equal(ops.permute(x_TD, ids_TK, E)[0], ref.permute(x_TD, ids_TK, E)[0])


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_unpermute(benchmark, report, dtype_name):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(1)
    y_SD = torch.randn(S, D, generator=gen).to(dtype)
    _, row_map_TK, _ = ref.permute(torch.zeros(T, 1), balanced_ids(gen), E)
    probs_TK = torch.rand(T, K, generator=gen)
    dst_SD = torch.empty_like(y_SD)
    times = interleave({
        "kernel": lambda: ops.unpermute(y_SD, row_map_TK, probs_TK),
        "reference": lambda: ref.unpermute(y_SD, row_map_TK, probs_TK),
        "memcpy": lambda: dst_SD.copy_(y_SD),  # the S*D input bytes, read once
    }, repeats=7)
    nbytes = S * D * y_SD.element_size()
    name = f"unpermute {dtype_name}"
    # Issue 7's target (bf16; fp32 holds it too): the combine reads the expert outputs at >= 60 %
    # of a plain copy's bandwidth.
    report.row(name, "speed vs memcpy", times["memcpy"] / times["kernel"], target=0.60,
               note=f"{gbytes_per_s(nbytes, times['kernel']):.1f} GB/s read")
    report.row(name, "speedup vs torch ref", times["reference"] / times["kernel"])
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(ops.unpermute, args=(y_SD, row_map_TK, probs_TK), rounds=3, iterations=1)


@pytest.mark.parametrize("dtype_name,target", [("fp32", 0.85), ("bf16", None)])
def test_expert_mlp_vs_square_matmul(benchmark, report, dtype_name, target):
    """Useful GFLOP/s of expert_mlp fwd+bwd over GFLOP/s of a 2048^3 matmul, same dtype.

    bf16 runs the way training does: fp32 master weights under CPU autocast.
    """
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(2)
    x_SD = torch.randn(S, D, generator=gen).requires_grad_()
    probs_S = torch.rand(S, generator=gen).requires_grad_()
    counts_E = torch.full((E,), S // E, dtype=torch.int64)
    w13_E2FD = (torch.randn(E, 2 * F, D, generator=gen) * D ** -0.5).requires_grad_()
    w2_EDF = (torch.randn(E, D, F, generator=gen) * F ** -0.5).requires_grad_()
    grad_SD = torch.randn(S, D, generator=gen).to(dtype)
    a_NN = torch.randn(2048, 2048, generator=gen).to(dtype)
    b_NN = torch.randn(2048, 2048, generator=gen).to(dtype)

    def fwd_bwd():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            y_SD = ops.expert_mlp(x_SD, probs_S, counts_E, w13_E2FD, w2_EDF)
        y_SD.backward(grad_SD)
        for t in (x_SD, probs_S, w13_E2FD, w2_EDF):
            t.grad = None

    useful_flop = 3 * 2 * S * 3 * D * F  # 3 GEMMs (gate, up, down) x fwd + 2 bwd
    # One matmul sample does about the same work as one fwd+bwd (25 mm calls), so both
    # samples span the same stretch of time and see the same load from other processes.
    mm_calls = max(1, round(useful_flop / (2 * 2048 ** 3)))

    def matmuls():
        for _ in range(mm_calls):
            torch.mm(a_NN, b_NN)

    times = interleave({"expert_mlp": fwd_bwd, "matmul": matmuls}, repeats=3)
    mlp = gflops(useful_flop, times["expert_mlp"])
    mm = gflops(mm_calls * 2 * 2048 ** 3, times["matmul"])
    name = f"expert_mlp fwd+bwd {dtype_name}"
    report.row(name, "GFLOP/s vs 2048^3 mm", mlp / mm, target=target,
               note=f"{mlp:.0f} vs {mm:.0f} GFLOP/s")
    benchmark.extra_info.update({"expert_mlp_gflops": mlp, "matmul_gflops": mm,
                                 "ratio": mlp / mm})
    benchmark.pedantic(fwd_bwd, rounds=1, iterations=1)


def test_bf16_row_gemms_padded_to_the_row_multiple(benchmark, report):
    """The expert MLP's four row GEMMs (FC1, FC2, dA, dX: the routed rows are their rows) in
    bf16 over every row count 1024-1087, each over exactly its rows ("exact") and over its rows
    rounded up to ROW_MULTIPLE ("padded", what expert_mlp runs), interleaved count by count.
    Reported: the useful speed padded / exact over all counts together (routed counts fall
    anywhere; exact's summed time over padded's) and at the count where padding gains most.
    4 experts' weights per call, the standard expert shape. The exact GEMMs' speed over the counts is what moved
    expert_mlp to pad (moeplug/ops/_grouped.py)."""
    from moeplug.ops._grouped import ROW_MULTIPLE, padded_rows

    L, counts = 4, range(1024, 1088)
    gen = torch.Generator().manual_seed(5)
    rows = L * (max(counts) + ROW_MULTIPLE)
    # (input [rows, K], weights [L, K, N] as the GEMM reads them, output [rows, N])
    kinds = {
        "FC1": (D, 2 * F, True), "FC2": (F, D, True), "dA": (D, F, False), "dX": (2 * F, D, False),
    }
    total = {name: {"exact": 0.0, "padded": 0.0} for name in kinds}
    best = {name: (0.0, 0) for name in kinds}  # (exact / padded time, count): padding's best
    for name, (k_in, n_out, transposed) in kinds.items():
        x = torch.randn(rows, k_in, generator=gen).bfloat16()
        w = torch.randn(L, n_out, k_in, generator=gen).bfloat16()
        w = w.transpose(1, 2) if transposed else w.reshape(L, k_in, n_out)
        out = torch.empty(rows, n_out, dtype=torch.bfloat16)

        def gemms(n, k):
            def run():
                for e in range(L):
                    torch.mm(x[e * n:e * n + k], w[e], out=out[e * n:e * n + k])
            return run
        for n in counts:
            padded = padded_rows(ROW_MULTIPLE, n, rows)
            times = interleave({"exact": gemms(n, n), "padded": gemms(n, padded)}, repeats=3)
            for variant, t in times.items():
                total[name][variant] += t
            best[name] = max(best[name], (times["exact"] / times["padded"], n))
    for name in kinds:
        speedup = total[name]["exact"] / total[name]["padded"]
        ratio, n = best[name]
        report.row("bf16 row GEMMs, padded to the row multiple", f"{name} padded / exact",
                   speedup, note=f"summed over counts {min(counts)}-{max(counts)}; at {n} rows "
                   f"padded ran {ratio:.2f}x exact's speed")
    benchmark.extra_info.update({name: total[name]["exact"] / total[name]["padded"]
                                 for name in kinds})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_swiglu_per_expert_slice(benchmark, report, dtype_name):
    """The fused SwiGLU forward and backward as the grouped experts call them: one expert's
    S/E rows at a time, right after its FC1 GEMM wrote them (so one slice, reused, stays in
    the last-level cache as in the layer), E times, against the torch composition on the same
    slice and a memcpy of the bytes a backward moves (read dA and h, write dh: 5F per row)."""
    from moeplug.ops.swiglu import swiglu_backward_raw, swiglu_forward_raw
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(2)
    R = S // E
    h = torch.randn(R, 2 * F, generator=gen).to(dtype)
    da = torch.randn(R, F, generator=gen).to(dtype)
    p = torch.rand(R, generator=gen)
    a, dh, dp = torch.empty(R, F, dtype=dtype), torch.empty(R, 2 * F, dtype=dtype), torch.empty(R)
    src, dst = torch.randn(R, 5 * F).to(dtype), torch.empty(R, 5 * F, dtype=dtype)

    def per_expert(fn):
        def run():
            for _ in range(E):
                fn()
        return run

    def torch_bwd():
        hh, pp = h.detach().requires_grad_(), p.detach().requires_grad_()
        torch.autograd.grad(ref.swiglu(hh, pp), [hh, pp], da)

    bwd = per_expert(lambda: swiglu_backward_raw(da, h, p, True, dh, dp))
    times = interleave({
        "fwd": per_expert(lambda: swiglu_forward_raw(h, p, a)),
        "bwd": bwd,
        "torch_fwd": per_expert(lambda: ref.swiglu(h, p)),
        "torch_bwd": per_expert(torch_bwd),
        "memcpy": per_expert(lambda: dst.copy_(src)),
    }, repeats=7)
    name = f"swiglu {dtype_name} ({E} x [{R}, {F}])"
    nbytes = E * R * 5 * F * h.element_size()
    report.row(name, "bwd speed vs memcpy", times["memcpy"] / times["bwd"],
               note=f"{gbytes_per_s(nbytes, times['bwd']):.1f} GB/s; fwd "
                    f"{times['fwd'] * 1e3:.1f} ms, bwd {times['bwd'] * 1e3:.1f} ms a layer")
    report.row(name, "fwd speedup vs torch", times["torch_fwd"] / times["fwd"])
    report.row(name, "bwd speedup vs torch", times["torch_bwd"] / times["bwd"])
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(bwd, rounds=3, iterations=1)
    torch.testing.assert_close(swiglu_forward_raw(h, p), ref.swiglu(h.float(), p).to(dtype),
                               rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("ranks,local_experts", [(2, 8), (8, 32)])
def test_ep_sort_by_local_expert(benchmark, report, ranks, local_experts):
    """The alltoall dispatcher's sort of the rows an EP rank received ((source rank, local
    expert)-major) into local-expert-major order, forward + backward, as it runs: the runtime's
    chunk moves (_ep_comm._MoveChunks) against the index_select it replaced (whose backward
    zero-fills a fresh [S, D] and scatters into it) and a memcpy of the rows twice (each
    direction reads and writes S*D once). S rows of D fp32, uneven random chunk sizes."""
    from moeplug_plugins.dispatchers import _ep_comm
    W, L = ranks, local_experts
    gen = torch.Generator().manual_seed(3)
    weights = torch.rand(W * L, generator=gen) + 0.5
    counts_WL = (weights / weights.sum() * S).to(torch.int64).view(W, L)
    counts_WL[0, 0] += S - int(counts_WL.sum())
    plan = _ep_comm.A2APlan(send_W=[], recv_W=counts_WL.sum(1).tolist(), counts_WL=counts_WL)
    rows_SD = torch.randn(S, D, generator=gen)
    grad_SD = torch.randn(S, D, generator=gen)
    index_S = _ep_comm.gather_index(counts_WL, True)
    dst_SD = torch.empty_like(rows_SD)

    def moves():
        x = rows_SD.detach().requires_grad_()
        torch.autograd.backward(_ep_comm.sort_by_local_expert(x, plan), grad_SD)

    def index_select():
        x = rows_SD.detach().requires_grad_()
        torch.autograd.backward(x.index_select(0, index_S), grad_SD)

    def memcpy_twice():
        dst_SD.copy_(rows_SD)
        rows_SD.copy_(dst_SD)

    times = interleave({"moves": moves, "index_select": index_select,
                        "memcpy": memcpy_twice}, repeats=7)
    name = f"EP sort fp32 ({W} x {L} chunks, [{S}, {D}])"
    report.row(name, "speed vs memcpy", times["memcpy"] / times["moves"],
               note=f"fwd+bwd {times['moves'] * 1e3:.1f} ms, index_select "
                    f"{times['index_select'] * 1e3:.1f} ms")
    report.row(name, "speedup vs index_select", times["index_select"] / times["moves"])
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(moves, rounds=3, iterations=1)
    x = rows_SD.detach().requires_grad_()
    y = _ep_comm.sort_by_local_expert(x, plan)
    y.backward(grad_SD)
    assert torch.equal(y, rows_SD[index_S])
    assert torch.equal(x.grad, torch.zeros_like(rows_SD).index_add_(0, index_S, grad_SD))


@pytest.mark.parametrize("moment_name", list(DTYPES))
def test_adamw_main_copy_step(benchmark, report, moment_name):
    """One AdamW step of bf16 parameters with fp32 main copies (train.param_dtype: bf16) over
    N = 2^23 elements (the mid-size model's routed experts of one layer: 16 x 3 x 1024 x 1408 is
    about 69M; this is an eighth), fp32 or bf16 moments: the one-pass kernel (read main, grad,
    moments; write them and the bf16 parameter) against the three passes it replaced (fp32 copy
    of the grad, fused fp32 step, parameter.copy_(main)) and a memcpy of the kernel's bytes."""
    from moeplug.ops.adamw import adamw_step_, adamw_step_main_
    n, mdt = 1 << 23, DTYPES[moment_name]
    gen = torch.Generator().manual_seed(4)
    main = torch.randn(n, generator=gen)
    p, grad = main.bfloat16(), (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    m = (torch.randn(n, generator=gen) * 1e-3).to(mdt)
    v = (torch.rand(n, generator=gen) * 1e-4).to(mdt)
    two = [t.clone() for t in (main, p, m, v)]
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)

    def one_pass():
        adamw_step_main_(main, grad, p, m, v, **kw)

    def three_passes():
        adamw_step_(two[0], grad.float(), two[2], two[3], **kw)
        two[1].copy_(two[0])

    # Bytes of one pass: main, grad, moments read; main, moments, param written.
    moved = n * (4 + 2 + 2 * m.element_size()) + n * (4 + 2 * m.element_size() + 2)
    src, dst = (torch.empty(moved // 2, dtype=torch.uint8) for _ in range(2))
    times = interleave({"one_pass": one_pass, "three_passes": three_passes,
                        "memcpy": lambda: dst.copy_(src)}, repeats=7)
    name = f"AdamW main-copy step, {moment_name} moments (N 2^23)"
    report.row(name, "speedup vs 3 passes", times["three_passes"] / times["one_pass"],
               note=f"{times['one_pass'] * 1e3:.1f} ms vs {times['three_passes'] * 1e3:.1f} ms")
    report.row(name, "speed vs memcpy", times["memcpy"] / times["one_pass"],
               note=f"{gbytes_per_s(moved, times['one_pass']):.1f} GB/s moved")
    # Both sides took the same 1 + 7 steps from the same state: the same bits.
    for a, b in zip((main, p, m, v), two):
        assert torch.equal(a, b)
    benchmark.extra_info.update({k: t * 1e3 for k, t in times.items()})
    benchmark.pedantic(one_pass, rounds=3, iterations=1)


def test_adamw_fp32_step_fused_vs_torch_default(benchmark, report):
    """The default optimizer's step (moeplug.training.optim.AdamW: torch's fused AdamW on CPU
    parameters) against torch.optim.AdamW with torch's CPU default (the single-tensor loop, what
    it ran before) on the same fp32 parameters and grads, N = 2^23 in four tensors, and a
    memcpy of the fused pass's bytes."""
    from moeplug.training.optim import AdamW
    n = 1 << 21
    gen = torch.Generator().manual_seed(5)
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen)) for _ in range(4)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref):
        p.grad = torch.randn(n, generator=gen) * 1e-2
        q.grad = p.grad.clone()
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    fused, single = AdamW(ours, **kw), torch.optim.AdamW(ref, **kw)
    # Bytes of one fused pass: param, grad and both moments read; param and moments written.
    moved = 4 * n * 4 * (4 + 3)
    src, dst = (torch.empty(moved // 2, dtype=torch.uint8) for _ in range(2))
    times = interleave({"fused": fused.step, "single_tensor": single.step,
                        "memcpy": lambda: dst.copy_(src)}, repeats=7)
    name = "AdamW fp32 step, default optimizer (N 2^23)"
    report.row(name, "speedup vs torch's CPU default", times["single_tensor"] / times["fused"],
               note=f"{times['fused'] * 1e3:.1f} ms vs {times['single_tensor'] * 1e3:.1f} ms")
    report.row(name, "speed vs memcpy", times["memcpy"] / times["fused"],
               note=f"{gbytes_per_s(moved, times['fused']):.1f} GB/s moved")
    # The same 1 + 7 steps from the same state: the same moments; parameters that differ in
    # under 1 % of elements, where MKL's sqrt in the single-tensor loop was 1 ulp low and that
    # last bit was carried on (a few ulps of the value, or of a larger value it had before:
    # far below one step's update, lr = 1e-4).
    for p, q in zip(ours, ref):
        assert torch.equal(fused.state[p]["exp_avg"], single.state[q]["exp_avg"])
        assert torch.equal(fused.state[p]["exp_avg_sq"], single.state[q]["exp_avg_sq"])
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2.0 ** -20, atol=1e-4 * 2.0 ** -10)
        assert float((p != q).float().mean()) < 0.01
    benchmark.extra_info.update({k: t * 1e3 for k, t in times.items()})
    benchmark.pedantic(fused.step, rounds=3, iterations=1)


@pytest.mark.parametrize("live", [1, 10])
def test_workspace_small_buffer_vs_torch_empty(benchmark, report, live):
    """A MoE layer takes a few dozen small buffers a step from its arena (moeplug.runtime.workspace),
    which matters where the layer is dispatch-bound. Timed: ``live`` buffers of one size class
    taken and then dropped, against as many ``torch.empty`` calls of the same shape, in calls
    of 2000 rounds. Ratio above 1: the arena is slower than torch's allocator."""
    from moeplug.runtime import workspace
    arena, shape, rounds = workspace.Arena(), (64, 2), 2000

    def arena_calls():
        with workspace.arena_scope(arena):
            for _ in range(rounds):
                held = [workspace.empty(shape, torch.float32) for _ in range(live)]
                del held

    def torch_calls():
        for _ in range(rounds):
            held = [torch.empty(shape, dtype=torch.float32) for _ in range(live)]
            del held

    # How a free buffer is handed out: one as_strided view (now) or a slice and a view (before
    # 80d14eb), on the same buffer.
    buf = torch.empty(128)

    def as_strided_views():
        for _ in range(rounds * live):
            workspace._prefix(buf, shape)

    def slice_views():
        for _ in range(rounds * live):
            buf[:128].view(shape)

    times = interleave({"arena": arena_calls, "torch_empty": torch_calls,
                        "as_strided": as_strided_views, "slice_view": slice_views},
                       repeats=7, warmup=2)
    per = {k: t / (rounds * live) * 1e6 for k, t in times.items()}
    name = f"workspace arena, {live} buffer(s) of a class live"
    report.row(name, "time / torch.empty", times["arena"] / times["torch_empty"],
               note=f"{per['arena']:.2f} us vs {per['torch_empty']:.2f} us a buffer")
    if live == 1:
        report.row(name, "hand-out: slice+view / as_strided", times["slice_view"]
                   / times["as_strided"],
                   note=f"{per['slice_view']:.2f} us vs {per['as_strided']:.2f} us a view")
    benchmark.extra_info.update(per)
    benchmark.pedantic(arena_calls, rounds=1, iterations=1)
