"""expert_mlp (fused grouped SwiGLU MLP) vs a plain per-expert torch loop, plus runtime loading.

Shape legend: S routed rows, D hidden, F expert FFN hidden, L local experts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moeplug import ops
from moeplug.ops import reference as ref
from moeplug.ops.grouped_ffn import grouped_mlp


def make_inputs(counts: list[int], D: int = 24, F: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    S, L = sum(counts), len(counts)
    x_SD = torch.randn(S, D, generator=gen)
    probs_S = torch.rand(S, generator=gen)
    w13_L2FD = torch.randn(L, 2 * F, D, generator=gen) * D ** -0.5
    w2_LDF = torch.randn(L, D, F, generator=gen) * F ** -0.5
    return x_SD, probs_S, torch.tensor(counts, dtype=torch.int64), w13_L2FD, w2_LDF


def run(fn, x_SD, probs_S, counts_L, w13_L2FD, w2_LDF, g_SD, autocast=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x_SD, probs_S, w13_L2FD, w2_LDF)]
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        y_SD = fn(leaves[0], leaves[1], counts_L, leaves[2], leaves[3])
    grads = torch.autograd.grad(y_SD, leaves, g_SD.to(y_SD.dtype))
    return y_SD, grads


COUNTS = {
    "balanced": [8, 8, 8, 8],
    "zero_token_experts": [0, 13, 0, 7, 0],
    "one_expert": [21],
    "all_rows_one_of_many": [0, 0, 17, 0],
    "single_row": [0, 1],
}


@pytest.mark.parametrize("name", list(COUNTS))
def test_matches_per_expert_loop_fp32(name):
    inputs = make_inputs(COUNTS[name])
    g_SD = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(9))
    y, grads = run(ops.expert_mlp, *inputs, g_SD)
    ry, rgrads = run(ref.expert_mlp, *inputs, g_SD)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-5)
    for label, got, want in zip(("x", "probs", "gate_up_proj", "down_proj"), grads, rgrads):
        assert got.dtype == want.dtype, label
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=label)
    # Experts that got no rows get exactly zero weight gradients (not garbage from empty()).
    for e, n in enumerate(COUNTS[name]):
        if n == 0:
            assert not grads[2][e].any() and not grads[3][e].any()


def test_bf16_autocast_matches_loop_and_keeps_fp32_weight_grads():
    inputs = make_inputs([10, 0, 22, 5], D=32, F=48, seed=3)
    g_SD = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4))
    y, grads = run(ops.expert_mlp, *inputs, g_SD, autocast=torch.bfloat16)
    ry, rgrads = run(ref.expert_mlp, *inputs, g_SD)  # fp32 ground truth
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ry, atol=3e-2, rtol=3e-2)
    for label, got, want, leaf in zip(("x", "probs", "gate_up_proj", "down_proj"), grads, rgrads,
                                      (inputs[0], inputs[1], inputs[3], inputs[4])):
        assert got.dtype == leaf.dtype == torch.float32, label  # master weights stay fp32
        # bf16 keeps 8 mantissa bits: compare relative to each tensor's scale.
        err = (got - want).abs().max() / want.abs().max()
        assert err < 3e-2, (label, err.item())


def test_bf16_autocast_casts_fp32_weights_per_expert_and_keeps_no_copy():
    """Under bf16 autocast with fp32 weights, each expert's weight is cast right before its GEMM
    and each weight gradient is cast into its fp32 slice per expert: the same values as casting
    the whole weights first (bf16 weights, no autocast; gradients then cast to fp32), bitwise,
    and nothing saved for backward is a bf16 copy of a weight."""
    x_SD, probs_S, counts_L, w13, w2 = make_inputs([10, 0, 22, 5], D=32, F=48, seed=6)
    g_SD = torch.randn(x_SD.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    saved = []

    def pack(t):
        saved.append((t.dtype, t.dim()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, grads = run(ops.expert_mlp, x_SD, probs_S, counts_L, w13, w2, g_SD,
                       autocast=torch.bfloat16)
    assert (torch.bfloat16, 3) not in saved, saved
    by, bgrads = run(ops.expert_mlp, x_SD.bfloat16(), probs_S, counts_L, w13.bfloat16(),
                     w2.bfloat16(), g_SD)
    assert torch.equal(y, by)
    for label, got, want in zip(("x", "probs", "gate_up_proj", "down_proj"), grads, bgrads):
        assert got.dtype == torch.float32, label
        assert torch.equal(got, want.float()), label


def test_bf16_inputs_without_autocast():
    x_SD, probs_S, counts_L, w13, w2 = make_inputs([6, 9], seed=5)
    args = (x_SD.bfloat16(), probs_S, counts_L, w13.bfloat16(), w2.bfloat16())
    y = ops.expert_mlp(*args)
    torch.testing.assert_close(y, ref.expert_mlp(*args), atol=3e-2, rtol=3e-2)


def test_grouped_mm_path_agrees():
    # The CUDA path (F.grouped_mm) also runs on CPU: the two paths must agree.
    from moeplug.ops.cuda_ffn import grouped_mm_ffn as _grouped_mm_path

    x_SD, probs_S, counts_L, w13, w2 = make_inputs([5, 0, 11], seed=6)
    got = _grouped_mm_path(x_SD, probs_S, counts_L.tolist(), w13, w2, torch.float32)
    torch.testing.assert_close(ops.expert_mlp(x_SD, probs_S, counts_L, w13, w2), got,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(counts_L=torch.tensor([3, 3, 3, 3])),
     r"counts_L = \[3, 3, 3, 3\] sums to 12 but x_SD has S = 32 rows"),
    (lambda a: a.update(counts_L=torch.tensor([16, 16])),
     r"counts_L has 2 entries but the weights hold 4 experts"),
    (lambda a: a.update(counts_L=torch.tensor([8, 8, 8, 8], dtype=torch.int32)),
     r"counts_L must be a 1-D int64 CPU tensor, got dtype torch.int32"),
    (lambda a: a.update(counts_L=torch.tensor([40, -8, 0, 0])),
     r"sums to 32 but x_SD has S = 32 rows. Fix: .*all >= 0"),
    (lambda a: a.update(w2_LDF=torch.zeros(4, 24, 7)),
     r"down_proj \(4, 24, 7\) \(want \[L, 24, F\]\)"),
    (lambda a: a.update(probs_S=torch.rand(31)),
     r"probs_S must have shape \(32,\), got \(31,\)"),
    (lambda a: a.update(x_SD=a["x_SD"].double()),
     r"compute dtype torch.float64 .* Fix: pass x_SD.float\(\)"),
    (lambda a: a.update(w13_L2FD=a["w13_L2FD"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"gate_up_proj .* is not contiguous. Fix: pass gate_up_proj.contiguous\(\)"),
])
def test_errors_name_field_and_fix(mutate, match):
    x_SD, probs_S, counts_L, w13, w2 = make_inputs([8, 8, 8, 8])
    args = dict(x_SD=x_SD, probs_S=probs_S, counts_L=counts_L, w13_L2FD=w13, w2_LDF=w2)
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.expert_mlp(args["x_SD"], args["probs_S"], args["counts_L"], args["w13_L2FD"],
                       args["w2_LDF"])


def test_import_works_without_extension_and_error_names_rebuild_command():
    script = textwrap.dedent("""
        import sys
        sys.modules["moeplug._runtime_core"] = None   # makes `import` of it raise ImportError
        import moeplug, moeplug.ops, moeplug.runtime as rt
        import torch
        assert rt.runtime_info()["available"] is False
        for _ in range(2):   # the same clear error every time, no silent fallback
            try:
                moeplug.ops.permute(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), 2)
            except rt.RuntimeMissingError as exc:
                print("ERR:", exc)
            else:
                raise SystemExit("permute ran without the extension")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("ERR:")]
    assert len(lines) == 2
    assert "moeplug._runtime_core" in lines[0]
    assert "pip install -e . --no-build-isolation" in lines[0] and "pip install -e ." in lines[0]


@pytest.fixture
def in_workspace():
    """The test's ops take their buffers from a model runtime's workspace, as in a MoE layer
    (outside any layer's arena they would be torch's)."""
    from moeplug.runtime import workspace
    with workspace.Workspace().scope():
        yield


def test_pooled_buffers_survive_repeated_and_retained_backward(monkeypatch, in_workspace):
    # Buffers come from the workspace cache: outputs and saved activations held by a live graph
    # must never be reused underneath it, so a second backward gives the same gradients.
    from moeplug.runtime import workspace

    monkeypatch.setattr(workspace, "MIN_BYTES", 0)  # pool even these small test buffers
    x_SD, probs_S, counts_L, w13, w2 = make_inputs([300, 0, 200], D=64, F=96, seed=11)
    x_SD.requires_grad_()
    y1 = ops.expert_mlp(x_SD, probs_S, counts_L, w13, w2)
    y2 = ops.expert_mlp(x_SD * 2, probs_S, counts_L, w13, w2)  # allocated while y1 is alive
    (g1,) = torch.autograd.grad(y1.sum(), x_SD, retain_graph=True)
    (g2,) = torch.autograd.grad(y2.sum(), x_SD)
    (g1_again,) = torch.autograd.grad(y1.sum(), x_SD)
    torch.testing.assert_close(g1, g1_again, atol=0, rtol=0)
    torch.testing.assert_close(y1, ref.expert_mlp(x_SD, probs_S, counts_L, w13, w2))
    torch.testing.assert_close(y2, ref.expert_mlp(x_SD * 2, probs_S, counts_L, w13, w2))


class _RowCounts(torch.utils._python_dispatch.TorchDispatchMode):
    """The row counts of every mm whose first operand has ``cols`` columns."""

    def __init__(self, cols: int):
        super().__init__()
        self.cols, self.rows = cols, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        mm = func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out)
        if mm and args[0].shape[1] == self.cols:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute_act", [False, True])
@pytest.mark.parametrize("op", ["expert_mlp", "grouped_mlp"])
def test_bf16_row_gemms_padded_to_the_row_multiple_change_no_real_row(monkeypatch, op,
                                                                      recompute_act, in_workspace):
    """In bf16 each expert's row GEMMs run over its rows rounded up to ROW_MULTIPLE (into the
    next expert's rows and the buffers' spare rows): outputs and every grad equal the unpadded
    run bitwise, although the buffers hold NaN from an earlier call and the input's spare rows
    are NaN. Both grouped ops: the fused SwiGLU one and the torch one (here with GELU)."""
    from moeplug.ops import _grouped
    from moeplug.runtime import workspace

    monkeypatch.setattr(workspace, "MIN_BYTES", 0)  # workspace buffers (spare rows) for all
    counts = [13, 0, 5, 1, 22, 3]
    S, D = sum(counts), 32
    x_SD, probs_S, counts_L, w13, w2 = make_inputs(counts, D=D, F=48, seed=12)
    if op == "grouped_mlp":
        w13 = w13[:, :48].contiguous()  # GELU's FC1: F rows, not 2F
    spare = torch.full((S + 8, D), float("nan"), dtype=torch.bfloat16)
    spare[:S] = x_SD
    x16_SD = spare[:S]  # what the last expert's padded GEMM reads past S is NaN
    g_SD = torch.randn(S, D, generator=torch.Generator().manual_seed(13)).bfloat16()

    def call(x, p, c, a, b):
        if op == "grouped_mlp":
            return grouped_mlp(x, p, c, a, b, "gelu", recompute_act=recompute_act)
        return ops.expert_mlp(x, p, c, a, b, recompute_act=recompute_act)

    def leaves_and_grads(x):
        leaves = [t.detach().clone().requires_grad_() for t in (probs_S, w13, w2)]
        leaves.insert(0, x.detach().requires_grad_())  # not a copy: its spare rows stay
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = call(leaves[0], leaves[1], counts_L, leaves[2], leaves[3])
        return y, torch.autograd.grad(y, leaves, g_SD)

    def fresh_run():
        leaves_and_grads(torch.full_like(x16_SD, float("nan")))  # the workspace now holds NaN
        return leaves_and_grads(x16_SD)

    padded_rows = _RowCounts(D)
    with padded_rows:
        y, grads = fresh_run()
    monkeypatch.setattr(_grouped, "ROW_MULTIPLE", 1)
    unpadded_rows = _RowCounts(D)
    with unpadded_rows:
        uy, ugrads = fresh_run()
    workspace.clear()
    # The padding ran: FC1 (the real run's; the NaN run's came first) over 16, 8, 8, 24 rows,
    # not 13, 5, 1, 22, and the last expert's 3 over as many more as the buffers' spare rows hold.
    fc1 = padded_rows.rows[-10:-5]
    assert fc1[:4] == [16, 8, 8, 24] and 3 < fc1[4] <= 8, padded_rows.rows
    assert unpadded_rows.rows[-10:-5] == [13, 5, 1, 22, 3], unpadded_rows.rows
    assert not y.isnan().any()
    assert torch.equal(y, uy)
    for label, got, want in zip(("x", "probs", "gate_up_proj", "down_proj"), grads, ugrads):
        assert not got.isnan().any(), label
        assert torch.equal(got, want), label
