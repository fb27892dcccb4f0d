"""The MoE layer forward+backward at the standard shape, against the limits and a peer.

Standard shape: T=4096 tokens, D=1024 hidden, F=1408 expert FFN, E=16 experts, top-4, SwiGLU.
Timed interleaved in one run (this machine's speed drifts 2-3x within minutes; only ratios from
one run compare):
    matmul      square 2048^3 matmul of the same dtype into a kept output: the practical GEMM
                limit
    dense_ffn   a dense SwiGLU FFN (D -> F -> D) over the same S = T*K rows: same useful FLOPs,
                no routing
    gemms       only the routed experts' six GEMMs per expert (fwd 2, dX 2, dW 2) at S/E rows
                each, in the compute dtype, nothing else: the ceiling of any layer built on
                torch's GEMMs at this shape with perfectly even routing
    gemms_routed  the same six GEMMs at the rows per expert the layers' router gives this
                input (965-1087 here), run as the layer runs them (in bf16 the four row GEMMs
                over each expert's rows rounded up to moeplug.ops._grouped.ROW_MULTIPLE): the
                ceiling for this routing
    hf_mixtral  Hugging Face transformers' MixtralSparseMoeBlock with the same weights, its
                `grouped_mm` experts implementation
    moeplug     MoELayer(topk router, alltoall dispatcher, sequential|grouped experts)
    grouped_bf16_weights  (bf16 only) the grouped layer as Megatron's bf16 module runs it:
                expert weights and the layer's input in bf16 (the fp32 main copy lives in the
                optimizer), the router fp32; what autocast's casts of fp32 weights and
                activations cost is the gap to ``grouped``
Useful FLOPs count the routed-expert matmuls only: 3 (fwd + 2 bwd) x 2*S*3*D*F.
Each figure is reported as a ratio of its GFLOP/s to the matmul's, and the grouped layer also
as a ratio to gemms_routed: the share of the layer's time its own GEMMs take.

Run: pytest -q benchmarks/test_bench_moe_layer.py -s     (about 3-5 minutes on 2 cores)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from benchmarks.conftest import gflops, interleave
from moeplug.config import ModelConfig, MoEConfig
from moeplug.moe import MoELayer
from moeplug.ops._grouped import ROW_MULTIPLE, padded_rows
from moeplug.plugin_host import PluginHost

T, D, F, E, K = 4096, 1024, 1408, 16, 4
S = T * K
USEFUL_FLOP = 3 * 2 * S * 3 * D * F          # routed-expert matmuls, fwd + bwd
MATMUL_N = 2048
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Issue 7's target for the grouped layer, fp32 and bf16 alike (issue 2 had asked 0.80 in fp32).
TARGET_GROUPED = 0.90


def _model_cfg() -> ModelConfig:
    return ModelConfig(hidden_size=D, num_heads=8, num_kv_heads=8, num_layers=1, first_k_dense=0,
                       moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=F, aux_loss_coeff=1e-2))


def _moeplug_layer(host: PluginHost, experts: str) -> MoELayer:
    m = _model_cfg()
    router = host.create("router", "topk", {}, m)
    dispatcher = host.create("dispatcher", "alltoall", {}, m, None)
    return MoELayer(router, dispatcher, host.create("experts", experts, {}, m, E))


def _hf_block(layer: MoELayer):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                        num_experts_per_tok=K, router_jitter_noise=0.0)
    cfg._experts_implementation = "grouped_mm"
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.gate_up_proj)
        block.experts.down_proj.copy_(layer.experts.down_proj)
    return block


def _fwd_bwd(module_call, x, params, grad):
    """One forward+backward; grads cleared so nothing accumulates across calls."""
    def run():
        for p in params:
            p.grad = None
        x.grad = None
        out = module_call(x)
        out.backward(grad)
    return run


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_moe_layer_fwd_bwd(benchmark, report, dtype_name):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    host = PluginHost.load()
    layers = {name: _moeplug_layer(host, name) for name in ("sequential", "grouped")}
    # Same weights everywhere; gate scaled so routing is near-balanced (as in trained models).
    ref = layers["grouped"]
    with torch.no_grad():
        ref.router.weight.normal_(0.0, 0.02)
        ref.experts.gate_up_proj.normal_(0.0, 0.02)
        ref.experts.down_proj.normal_(0.0, 0.02)
        layers["sequential"].load_state_dict(ref.state_dict())
    hf = _hf_block(ref)
    bf16_module = _moeplug_layer(host, "grouped")
    bf16_module.load_state_dict(ref.state_dict())
    bf16_module.experts.to(torch.bfloat16)

    x_TD = torch.randn(T, D).requires_grad_(True)
    grad_TD = torch.randn(T, D)
    # Dense SwiGLU FFN over the same S rows: the same useful FLOPs without routing.
    w13 = (torch.randn(2 * F, D) * 0.02).requires_grad_(True)
    w2 = (torch.randn(D, F) * 0.02).requires_grad_(True)
    x_SD = torch.randn(S, D).requires_grad_(True)
    grad_SD = torch.randn(S, D)
    a_mm, b_mm = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype), torch.randn(MATMUL_N, MATMUL_N, dtype=dtype)
    # Into a kept output: a fresh 8-16 MB result is a new glibc mapping each call by default,
    # whose page faults slowed the reference (bf16: 686-737 GFLOP/s against 867-910 with freed
    # memory retained, same session) and flattered every ratio to it.
    c_mm = torch.empty(MATMUL_N, MATMUL_N, dtype=dtype)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16)

    def under_autocast(fn):
        def call(x):
            with autocast:
                return fn(x)
        return call

    def dense_ffn(x):
        g, u = Fn.linear(x, w13).chunk(2, dim=-1)
        return Fn.linear(Fn.silu(g) * u, w2)

    def moe(layer):
        return lambda x: layer(x)[0]

    def hf_call(x):
        return hf(x.unsqueeze(0)).squeeze(0)

    # every expert its own weights and rows, as in the layer (one expert's reused weights
    # would stay in cache: 0.82 -> 1.0 of the matmul in bf16 on this CPU)
    g_x, g_dy = torch.randn(S, D, dtype=dtype), torch.randn(S, D, dtype=dtype)
    g_h, g_a = torch.randn(S, 2 * F, dtype=dtype), torch.randn(S, F, dtype=dtype)
    g_w1, g_w2 = torch.randn(E, 2 * F, D, dtype=dtype), torch.randn(E, D, F, dtype=dtype)

    multiple = ROW_MULTIPLE if dtype is torch.bfloat16 else 1

    def gemms(rows_E: list[int]):
        def run():
            start = 0
            for e, n in enumerate(rows_E):
                r = slice(start, start + n)
                p = slice(start, start + padded_rows(multiple, n, S - start))  # as the layer
                start += n
                x, dy, h, a = g_x[r], g_dy[r], g_h[r], g_a[r]
                torch.mm(g_x[p], g_w1[e].t()), torch.mm(g_a[p], g_w2[e].t())  # forward
                torch.mm(g_dy[p], g_w2[e]), torch.mm(g_h[p], g_w1[e])         # dX
                torch.mm(dy.t(), a), torch.mm(h.t(), x)                        # dW
        return run

    with torch.no_grad():  # the rows per expert the layers route this input to (no drops)
        routed_E = torch.bincount(ref.router(x_TD).ids_TK.flatten(), minlength=E).tolist()
    assert sum(routed_E) == S

    x16_TD = x_TD.detach().bfloat16().requires_grad_(True)
    candidates = {
        "matmul": lambda: torch.mm(a_mm, b_mm, out=c_mm),
        "gemms": gemms([S // E] * E),
        "gemms_routed": gemms(routed_E),
        "dense_ffn": _fwd_bwd(under_autocast(dense_ffn), x_SD, [w13, w2], grad_SD),
        "hf_mixtral": _fwd_bwd(under_autocast(hf_call), x_TD, list(hf.parameters()), grad_TD),
        "sequential": _fwd_bwd(under_autocast(moe(layers["sequential"])), x_TD,
                               list(layers["sequential"].parameters()), grad_TD),
        "grouped": _fwd_bwd(under_autocast(moe(layers["grouped"])), x_TD,
                            list(layers["grouped"].parameters()), grad_TD),
    }
    if dtype is torch.bfloat16:
        candidates["grouped_bf16_weights"] = _fwd_bwd(
            under_autocast(moe(bf16_module)), x16_TD, list(bf16_module.parameters()),
            grad_TD.bfloat16())
    # Sanity before timing: moeplug and HF compute the same function with the same weights.
    # Checked in fp32: under bf16 autocast HF's gate GEMM runs in bf16 (ours stays fp32), so
    # near-tied experts may be chosen differently and the outputs legitimately differ.
    with torch.no_grad():
        ours, theirs = moe(layers["grouped"])(x_TD), hf_call(x_TD)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()

    times = interleave(candidates, repeats=5)
    matmul_gflops = gflops(2 * MATMUL_N ** 3, times["matmul"])
    for name in [n for n in candidates if n != "matmul"]:
        g = gflops(USEFUL_FLOP, times[name])
        target = TARGET_GROUPED if name == "grouped" else None
        report.row(f"moe layer {dtype_name} fwd+bwd", f"{name} / matmul", g / matmul_gflops,
                   target=target, note=f"{g:.0f} GFLOP/s useful; matmul {matmul_gflops:.0f} GFLOP/s")
    report.row(f"moe layer {dtype_name} fwd+bwd", "grouped / gemms_routed",
               times["gemms_routed"] / times["grouped"],
               note=f"rows per expert {min(routed_E)}-{max(routed_E)}")
    report.row(f"moe layer {dtype_name} fwd+bwd", "grouped speedup vs hf_mixtral",
               times["hf_mixtral"] / times["grouped"])
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(candidates["grouped"], rounds=1, iterations=1)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_moe_layer_old_vs_new(report, dtype_name):
    """#44 item 8: the same layer (standard shape, topk + alltoall + grouped, built from the
    config) fwd+bwd in the baseline tree and in this one, alternating in one run
    (benchmarks/_baseline.py); output and every gradient bitwise equal, the new/old time within
    the noise band."""
    from benchmarks._baseline import NOISE_BAND, old_vs_new
    res = old_vs_new("moe_layer", {"T": T, "D": D, "F": F, "E": E, "K": K, "dtype": dtype_name},
                     pairs=5, warmup=1)
    report.row(f"moe layer {dtype_name} fwd+bwd T{T} D{D} F{F} E{E} K{K}",
               "new / old (median pair)", res.median, note=res.note())
    print(f"\nmoe layer {dtype_name} old vs new: {res.median:.3f} ({res.note()}); "
          f"band {NOISE_BAND[0]:.2f}-{NOISE_BAND[1]:.2f}; digest {res.new_digest}")
    res.check()
