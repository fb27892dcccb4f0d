"""GPU benchmarks of issue 7 section 5, bf16, each figure a ratio to a reference timed beside it.

    permute / unpermute  moeplug._runtime_cuda's kernels at T=16384, K=8, D=2048: bandwidth
                         (fewest bytes: each input read once, each output written once) over a
                         device-to-device copy's (bytes read + written), and over torch's own
                         gather / index_add that compute the same thing (the peer)
    moe layer            fwd+bwd at a Qwen3-30B-A3B-like shape (T=16384 tokens, D 2048, F 768,
                         128 experts, top-8): moeplug's MoELayer (topk router, alltoall
                         dispatcher, grouped experts = torch's grouped_mm on CUDA, bf16 expert
                         weights, fp32 router) against Hugging Face transformers' Qwen3-MoE block
                         (its `grouped_mm` experts, all bf16) with the same weights, and against
                         a square bf16 matmul of the same FLOPs (2 n^3 = the layer's useful FLOPs)
    routing math         the router's math from fp32 logits (T=16384, top-8, Switch aux loss on
                         plain-top-k counts), fwd+bwd: the CUDA route kernels
                         (router_options.fused_cuda) against the torch ops the router runs
                         without them, at Qwen3's (E 128, softmax) and DeepSeek-V3's (E 256,
                         sigmoid + bias, 8 groups keep 4) routing
Useful FLOPs count the routed-expert matmuls only: 3 (fwd + 2 bwd) x 2*S*3*D*F, S = T*K.
Timed with CUDA events, round-robin over the candidates, median of the rounds.

Marked ``cuda``; skipped with the reason where torch sees no GPU or the extension is not built.
Run: pytest -q -s benchmarks/test_bench_cuda.py   (results recorded in docs/GPU.md)
"""

from __future__ import annotations

import statistics

import pytest
import torch

from benchmarks.conftest import gbytes_per_s, gflops

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="torch sees no CUDA GPU on this machine")]

T, D, F, E, K = 16384, 2048, 768, 128, 8
S = T * K
USEFUL_FLOP = 3 * 2 * S * 3 * D * F
MATMUL_N = 12288                      # 2 * 12288^3 = 3.711e12 ~ USEFUL_FLOP (3.711e12)
TARGET_COPY = 0.60
TARGET_VS_HF = 1.2
TARGET_VS_MATMUL = 0.5


def cuda_interleave(candidates: dict, repeats: int = 7, inner: int = 3, warmup: int = 2
                    ) -> dict[str, float]:
    """Median seconds per call of each candidate; each round times `inner` back-to-back calls
    of every candidate (round-robin) between CUDA events."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {n: [] for n in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / inner)
    return {n: statistics.median(s) for n, s in samples.items()}


@pytest.fixture(scope="module")
def cu():
    import moeplug.runtime as rt
    try:
        return rt.get_cuda_runtime()
    except rt.RuntimeMissingError as exc:
        pytest.skip(str(exc))


def test_cuda_permute_unpermute_vs_copy(benchmark, report, cu):
    import moeplug.runtime as rt
    from moeplug.ops import reference

    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    x_TD = torch.randn(T, D, device=dev, dtype=dtype)
    # Near-balanced routing: each token picks K distinct experts.
    ids_TK = torch.rand(T, E, device=dev).topk(K, dim=-1).indices
    want_SD, row_map_TK, _ = reference.permute(x_TD, ids_TK, E)
    probs_TK = torch.rand(T, K, device=dev)
    order_S = torch.empty(S, dtype=torch.int64, device=dev)
    order_S[row_map_TK.reshape(-1)] = torch.arange(S, device=dev)
    src_S = order_S // K                          # the token each permuted row reads
    x_SD = torch.empty(S, D, device=dev, dtype=dtype)
    y_TD = torch.empty(T, D, device=dev, dtype=dtype)
    copy_dst = torch.empty_like(want_SD)
    code, stream = rt.DTYPE_CODES[dtype], torch.cuda.current_stream().cuda_stream

    def permute():
        cu.permute(x=x_TD.data_ptr(), row_map=row_map_TK.data_ptr(), x_out=x_SD.data_ptr(),
                   num_tokens=T, top_k=K, hidden=D, dtype=code, stream=stream)

    def unpermute():
        cu.unpermute(y=want_SD.data_ptr(), row_map=row_map_TK.data_ptr(),
                     probs=probs_TK.data_ptr(), y_out=y_TD.data_ptr(), num_tokens=T, top_k=K,
                     hidden=D, dtype=code, stream=stream)

    def torch_permute():
        torch.index_select(x_TD, 0, src_S, out=x_SD)

    def torch_unpermute():
        rows = want_SD[row_map_TK.reshape(-1)].view(T, K, D) * probs_TK.to(dtype).unsqueeze(-1)
        torch.sum(rows, dim=1, out=y_TD)

    # Correct before timed: every output element written (poisoned first), equal to torch.
    x_SD.fill_(float("nan")), y_TD.fill_(float("nan"))
    permute(), unpermute()
    torch.cuda.synchronize()
    assert torch.equal(x_SD, want_SD)
    want_TD = reference.unpermute(want_SD, row_map_TK, probs_TK)
    torch.testing.assert_close(y_TD, want_TD, atol=2e-2, rtol=2e-2)

    candidates = {"copy": lambda: copy_dst.copy_(want_SD), "permute": permute,
                  "unpermute": unpermute, "torch_permute": torch_permute,
                  "torch_unpermute": torch_unpermute}
    times = cuda_interleave(candidates, repeats=9, inner=5)
    row = D * x_TD.element_size()
    moved = {"copy": 2 * S * row, "permute": (T + S) * row, "torch_permute": (T + S) * row,
             "unpermute": (S + T) * row + probs_TK.numel() * 4,
             "torch_unpermute": (S + T) * row + probs_TK.numel() * 4}
    bw = {n: gbytes_per_s(moved[n], t) for n, t in times.items()}
    for name in ("permute", "unpermute"):
        report.row("cuda bf16 T16384 K8 D2048", f"{name} bandwidth / copy", bw[name] / bw["copy"],
                   target=TARGET_COPY, note=f"{bw[name]:.0f} GB/s; copy {bw['copy']:.0f} GB/s")
        report.row("cuda bf16 T16384 K8 D2048", f"{name} speedup vs torch",
                   times[f"torch_{name}"] / times[name],
                   note=f"{times[name] * 1e6:.0f} us vs {times[f'torch_{name}'] * 1e6:.0f} us")
    benchmark.extra_info.update({k: v * 1e6 for k, v in times.items()})
    benchmark.pedantic(permute, rounds=1, iterations=1)


def _qwen3_block(layer):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                         num_experts_per_tok=K, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.gate_up_proj)
        block.experts.down_proj.copy_(layer.experts.down_proj)
    return block


def qwen3_layer(d: int = D, f: int = F, e: int = E, k: int = K, fused_cuda: bool = False,
                router_dtype: str = "fp32"):
    """moeplug's MoELayer at the Qwen3 shape (topk router with renormalize, alltoall, grouped
    experts), fp32 on the CPU, weights ~ N(0, 0.02) so routing is near balance. Also built by
    benchmarks/profile_cuda_moe_layer.py. ``fused_cuda``, ``router_dtype``: the router's
    options ``fused_cuda`` and ``dtype``."""
    from moeplug.config import ModelConfig, MoEConfig
    from moeplug.moe import MoELayer
    from moeplug.plugin_host import PluginHost

    m = ModelConfig(hidden_size=d, num_heads=16, num_kv_heads=4, num_layers=1, first_k_dense=0,
                    moe=MoEConfig(num_experts=e, top_k=k, ffn_hidden_size=f, aux_loss_coeff=1e-3))
    host = PluginHost.load()
    layer = MoELayer(host.create("router", "topk", {"renormalize": True, "fused_cuda": fused_cuda,
                                                    "dtype": router_dtype}, m),
                     host.create("dispatcher", "alltoall", {}, m, None),
                     host.create("experts", "grouped", {}, m, e))
    with torch.no_grad():
        for p in (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj):
            p.normal_(0.0, 0.02)
    return layer


def test_cuda_moe_layer_qwen3_shape(benchmark, report):
    torch.manual_seed(0)
    dev = "cuda"
    layer = qwen3_layer().to(dev)
    hf = _qwen3_block(layer).to(dev)
    # Same function before timing, checked in fp32 (in bf16 near-tied experts may differ).
    with torch.no_grad():
        x32 = torch.randn(512, D, device=dev)
        theirs = hf(x32.unsqueeze(0))
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).squeeze(0)
        torch.testing.assert_close(layer(x32)[0], theirs, atol=1e-4, rtol=1e-3)
    hf.to(torch.bfloat16)
    layer.experts.to(torch.bfloat16)              # Megatron's bf16 module: router kept fp32
    # The same layer with the router on the CUDA route kernels (router_options.fused_cuda).
    fused = qwen3_layer(fused_cuda=True).to(dev)
    fused.load_state_dict(layer.state_dict())
    fused.experts.to(torch.bfloat16)
    # The same layer with the gate GEMM in bf16 (router_options.dtype: input, Megatron's default
    # and what HF's bf16 block runs): the fp32 gate took 0.6 of ~8.9 ms on an H200.
    bf16_gate = qwen3_layer(router_dtype="input").to(dev)
    bf16_gate.load_state_dict(layer.state_dict())
    bf16_gate.experts.to(torch.bfloat16)

    x_TD = torch.randn(T, D, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    grad_TD = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    a_mm = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=torch.bfloat16)
    b_mm = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=torch.bfloat16)
    c_mm = torch.empty(MATMUL_N, MATMUL_N, device=dev, dtype=torch.bfloat16)

    def fwd_bwd(call, params):
        def run():
            for p in params:
                p.grad = None
            x_TD.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = call(x_TD)
            out.backward(grad_TD)
        return run

    def hf_call(x):
        out = hf(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)

    # The experts' GEMMs alone (grouped_mm fwd 2, dX 2, dW 2) at balanced S/E rows, with the
    # SwiGLU between them: the ceiling of any layer built on torch's grouped GEMM here.
    import torch.nn.functional as Fn
    g_x = torch.randn(S, D, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    g_w1 = (torch.randn(E, 2 * F, D, device=dev) * 0.02).bfloat16().requires_grad_(True)
    g_w2 = (torch.randn(E, D, F, device=dev) * 0.02).bfloat16().requires_grad_(True)
    g_offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (S // E)
    g_dy = torch.randn(S, D, device=dev, dtype=torch.bfloat16)

    def grouped_gemms():
        g_x.grad = g_w1.grad = g_w2.grad = None
        gate, up = Fn.grouped_mm(g_x, g_w1.transpose(-2, -1), offs=g_offs).chunk(2, dim=-1)
        Fn.grouped_mm(Fn.silu(gate) * up, g_w2.transpose(-2, -1), offs=g_offs).backward(g_dy)

    candidates = {
        "matmul": lambda: torch.mm(a_mm, b_mm, out=c_mm),
        "grouped_gemms": grouped_gemms,
        "hf_qwen3": fwd_bwd(hf_call, list(hf.parameters())),
        "moeplug": fwd_bwd(lambda x: layer(x)[0], list(layer.parameters())),
        "moeplug_fused_cuda_router": fwd_bwd(lambda x: fused(x)[0], list(fused.parameters())),
        "moeplug_bf16_gate": fwd_bwd(lambda x: bf16_gate(x)[0], list(bf16_gate.parameters())),
    }
    times = cuda_interleave(candidates, repeats=7, inner=3)
    peak = gflops(2 * MATMUL_N ** 3, times["matmul"])
    for name in ("grouped_gemms", "hf_qwen3", "moeplug", "moeplug_bf16_gate"):
        g = gflops(USEFUL_FLOP, times[name])
        report.row("cuda moe layer bf16 qwen3-30b-a3b shape fwd+bwd", f"{name} / matmul",
                   g / peak, target=TARGET_VS_MATMUL if name == "moeplug" else None,
                   note=f"{g / 1e3:.0f} TFLOP/s useful, {times[name] * 1e3:.2f} ms; "
                        f"matmul {peak / 1e3:.0f} TFLOP/s")
    report.row("cuda moe layer bf16 qwen3-30b-a3b shape fwd+bwd", "moeplug speedup vs hf_qwen3",
               times["hf_qwen3"] / times["moeplug"], target=TARGET_VS_HF)
    report.row("cuda moe layer bf16 qwen3-30b-a3b shape fwd+bwd",
               "fused_cuda router speedup vs torch router", times["moeplug"]
               / times["moeplug_fused_cuda_router"],
               note="router_options.fused_cuda: the CUDA route kernels in the router")
    report.row("cuda moe layer bf16 qwen3-30b-a3b shape fwd+bwd",
               "bf16 gate speedup vs fp32 gate", times["moeplug"] / times["moeplug_bf16_gate"],
               note="router_options.dtype: input (Megatron's default) against fp32")
    benchmark.extra_info.update({k: v * 1e3 for k, v in times.items()})
    benchmark.pedantic(candidates["moeplug"], rounds=1, iterations=1)



ROUTES = {  # name: (E, topk_routing options); T = 16384 tokens, top-8, Switch aux loss
    "qwen3 E128 softmax": (128, dict(score_function="softmax", renormalize=True)),
    "deepseek-v3 E256 sigmoid+bias groups 8/4": (256, dict(
        score_function="sigmoid", renormalize=True, num_groups=8, group_topk=4,
        scaling_factor=2.5)),
}


def routing_math(E: int, route: dict, device: torch.device, tokens: int = T, k: int = K):
    """(fused, torch): the router's math from the same fp32 logits, forward + backward, as the
    topk router runs it with ``fused_cuda`` on and off: the routed weights and ids plus the
    Switch aux loss on Megatron's plain-top-k counts. No gate GEMM in either. Returns the two
    callables, each giving (probs, ids, aux) of its last call."""
    from moeplug import routing as R
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, E, generator=gen).to(device)
    bias = (torch.randn(E, generator=gen) * 1e-2).to(device) if "num_groups" in route else None
    g = torch.randn(tokens, k, generator=gen).to(device)
    z_fused, z_torch = (logits.clone().requires_grad_() for _ in range(2))

    def fused():
        r = R.fused_topk_routing(z_fused, k, expert_bias_E=bias, aux_counts="plain_topk", **route)
        aux = 1e-2 * R.switch_aux_loss_from_mean(r.stats.mean_E, r.stats.counts_E, tokens, k)
        ((r.probs_TK * g).sum() + aux).backward()
        z_fused.grad = None
        return r.probs_TK, r.ids_TK, aux

    def plain():
        probs, ids = R.topk_routing(z_torch, k, expert_bias_E=bias, **route)
        s = R.aux_scores(z_torch, route["score_function"])
        counts = R.expert_counts(R.counts_for_aux(s, ids, "plain_topk"), E)
        aux = 1e-2 * R.switch_aux_loss_from_mean(s.mean(0), counts, tokens, k)
        ((probs * g).sum() + aux).backward()
        z_torch.grad = None
        return probs, ids, aux

    return fused, plain


@pytest.mark.parametrize("route", list(ROUTES))
def test_cuda_routing_math_fused_vs_torch(report, cu, route):
    """The CUDA route kernels (router_options.fused_cuda) against the torch ops the router runs
    without them, on the router's own math: the kernel-level figure under the layer's
    ``fused_cuda`` row (which the GEMMs dilute)."""
    E, options = ROUTES[route]
    fused, plain = routing_math(E, options, torch.device("cuda"))
    (p1, i1, a1), (p2, i2, a2) = fused(), plain()
    same = (i1 == i2).all(dim=1)  # near-ties (an ulp apart) may pick differently: <= 0.1 %
    assert (~same).sum() <= T // 1000, f"{int((~same).sum())} of {T} tokens routed differently"
    torch.testing.assert_close(p1[same], p2[same])
    torch.testing.assert_close(a1, a2)
    times = cuda_interleave({"fused": fused, "torch": plain})
    report.row(f"cuda routing math fwd+bwd T{T} K{K} {route}", "fused kernels speedup vs torch",
               times["torch"] / times["fused"],
               note=f"kernels {times['fused'] * 1e3:.3f} ms, torch {times['torch'] * 1e3:.3f} ms")


REPLAY_BUDGET = 1.25  # rows per expert = 1.25x the balanced load (static path pads to this)
REPLAY_SHAPES = {  # name: (T, D, F, E, K); the small one is launch-bound, the other GPU-bound
    "qwen3 T16384 D2048 F768 E128 K8": (T, D, F, E, K),
    "small T2048 D512 F256 E16 K4": (2048, 512, 256, 16, 4),
}


@pytest.mark.parametrize("shape", list(REPLAY_SHAPES))
def test_cuda_moe_layer_replay_vs_eager(report, shape):
    """runtime.capture on a GPU: the sync-free layer fwd+bwd, eager (op by op) against replayed
    from its runtime forward and backward graphs, beside the default (dynamic) path and a
    square matmul of the same useful FLOPs, one run, interleaved."""
    from moeplug.config import RuntimeSection
    from moeplug.runtime.stash import ModelRuntime

    t, d, f, e, k = REPLAY_SHAPES[shape]
    useful = 3 * 2 * t * k * 3 * d * f
    n = max(256, round((useful / 2) ** (1 / 3) / 256) * 256)
    torch.manual_seed(0)
    layer = qwen3_layer(d, f, e, k)
    rt = ModelRuntime(RuntimeSection(sync_free=True, capture=True, token_budget=REPLAY_BUDGET))
    layer.runtime = rt.register_layer(index=0, num_experts=e, top_k=k, hidden=d, ffn_hidden=f,
                                      num_local_experts=e, dtype="bfloat16", activation="swiglu",
                                      stash_bytes=0)
    rt.finalize()
    layer.to("cuda")
    layer.experts.to(torch.bfloat16)              # Megatron's bf16 module: router kept fp32
    state = rt.sync_free
    x_TD = torch.randn(t, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    grad_TD = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    a_mm, b_mm, c_mm = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
                        for _ in range(3))
    overflowed = []

    def mode(active: bool, capture: bool):
        def run():
            state.active, state.capture = active, capture
            for p in layer.parameters():
                p.grad = None
            x_TD.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, _, _ = layer(x_TD)
            y.backward(grad_TD)
            flag = state.take_overflow()
            if flag is not None:
                overflowed.append(flag)
        return run

    candidates = {"matmul": lambda: torch.mm(a_mm, b_mm, out=c_mm),
                  "dynamic": mode(False, False), "eager": mode(True, False),
                  "replay": mode(True, True)}
    # Replay equals eager before timing (same kernels; new inputs through the static copies).
    outs = {}
    for name in ("eager", "replay", "replay"):
        candidates[name]()
        outs[name] = [x_TD.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    for r, ref in zip(outs["replay"], outs["eager"]):  # bf16 atomics: another summation order
        assert torch.linalg.norm(r.float() - ref.float()) <= 1e-2 * torch.linalg.norm(ref.float())
    times = cuda_interleave(candidates, repeats=7, inner=3)
    peak = gflops(2 * n ** 3, times["matmul"])
    dropped = bool(torch.stack(overflowed).any()) if overflowed else False
    graphs = state.graphs
    print("\nreplay vs eager: " + ", ".join(f"{c} {s * 1e3:.3f} ms" for c, s in times.items())
          + f"; recordings {graphs.recordings}, replays {graphs.replays}, over budget {dropped}")
    where = f"cuda sync-free moe layer bf16 fwd+bwd {shape}"
    for name in ("dynamic", "eager", "replay"):
        g = gflops(useful, times[name])
        report.row(where, f"{name} / matmul", g / peak,
                   note=f"{times[name] * 1e3:.3f} ms; static path pads to {REPLAY_BUDGET}x "
                        f"the balanced rows")
    report.row(where, "eager / replay", times["eager"] / times["replay"],
               note=f"over budget: {dropped}")
    report.row(where, "dynamic / replay", times["dynamic"] / times["replay"])


# A whole training step on the GPU (issue 7's MFU figure, measured there): two MoE layers of the
# Qwen3-30B-A3B-like shape above, attention 16 heads (GQA 16/4), seq 4096 x 4 sequences (T 16384
# tokens per layer), vocabulary 32768, bf16 parameters with fp32 main weights in AdamW (Megatron's
# bf16 recipe), bf16 autocast. MFU = model FLOP/s (Megatron's count, as the train records report
# it) / the square bf16 matmul's, timed round-robin with CUDA events in one run.
STEP_LAYERS, STEP_SEQ, STEP_BATCH, STEP_VOCAB = 2, 4096, 4, 32768


def cuda_train_step_setup() -> tuple:
    """(cfg, model, optimizer, precision, batches, step_flop, routers) of the GPU train_step
    benchmark's model on "cuda"; also built by benchmarks/profile_cuda_train_step.py."""
    import numpy as np

    from moeplug.config import config_from_dict
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model, to_device
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, step_batches
    cfg = config_from_dict({
        "model": {"hidden_size": D, "num_layers": STEP_LAYERS, "num_heads": 16,
                  "num_kv_heads": 4, "max_seq_len": STEP_SEQ, "first_k_dense": 0,
                  "vocab_size": STEP_VOCAB,
                  "moe": {"num_experts": E, "top_k": K, "ffn_hidden_size": F}},
        "train": {"steps": 100, "micro_batch_size": STEP_BATCH, "seq_len": STEP_SEQ,
                  "warmup_steps": 1, "grad_accum_steps": 1, "param_dtype": "bf16",
                  "master_dtype": "fp32", "device": "cuda"},
        "plugins": {"precision": "bf16", "router_options": {"renormalize": True}},
    })
    host = PluginHost.load()
    seed_everything(0)
    model = build_rank_model(cfg, host, STEP_VOCAB, None, device="cuda")
    opt = build_rank_optimizer(model, cfg)
    precision = host.create("precision", "bf16", {})
    ids = np.random.default_rng(0).integers(0, STEP_VOCAB, 2_000_000).astype(np.int64)
    batches = to_device(step_batches(ids, cfg.train, 0), torch.device("cuda"))
    step_flop = model.flops_per_token(STEP_SEQ) * STEP_BATCH * STEP_SEQ
    routers = [m for m in model.modules() if hasattr(m, "options") and
               hasattr(m.options, "fused_cuda")]
    assert len(routers) == STEP_LAYERS, routers
    return cfg, model, opt, precision, batches, step_flop, routers


def set_fused_cuda(routers: list, fused_cuda: bool) -> None:
    """The same model, the router option switched (the option is all the router keeps)."""
    import dataclasses
    for r in routers:
        r.options = dataclasses.replace(r.options, fused_cuda=fused_cuda)


def test_cuda_train_step_mfu(report):
    from moeplug.training.trainer import train_step
    cfg, model, opt, precision, batches, step_flop, routers = cuda_train_step_setup()

    def step(fused_cuda: bool = False, adamw_kernel: bool = False):
        """The defaults (torch router, torch's AdamW step), or one of the opt-in CUDA kernels."""
        def run():
            set_fused_cuda(routers, fused_cuda)
            opt.fused_cuda = adamw_kernel  # the CUDA AdamW kernel (off by default)
            train_step(model, opt, batches, cfg.train, precision)
        return run

    mm_calls = max(1, round(step_flop / (2 * MATMUL_N ** 3)))
    a_mm = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    b_mm = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    c_mm = torch.empty(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)

    def matmuls():
        for _ in range(mm_calls):
            torch.mm(a_mm, b_mm, out=c_mm)

    times = cuda_interleave({"train_step": step(), "train_step_fused_cuda": step(fused_cuda=True),
                             "train_step_adamw_kernel": step(adamw_kernel=True),
                             "matmul": matmuls}, repeats=5, inner=1)
    peak = gflops(mm_calls * 2 * MATMUL_N ** 3, times["matmul"])
    row = (f"cuda train_step bf16 D{D} E{E} top{K} F{F} seq{STEP_SEQ} x{STEP_BATCH} "
           f"x{STEP_LAYERS} layers")
    for name in ("train_step", "train_step_fused_cuda", "train_step_adamw_kernel"):
        g = gflops(step_flop, times[name])
        print(f"\n{name} {times[name] * 1e3:.1f} ms for {step_flop / 1e12:.2f} TFLOP = "
              f"{g / 1e3:.0f} TFLOP/s; matmul {peak / 1e3:.0f} TFLOP/s; MFU {g / peak:.3f}")
        report.row(row, f"{name} MFU (model FLOP/s / matmul)", g / peak,
                   note=f"{g / 1e3:.0f} vs {peak / 1e3:.0f} TFLOP/s, "
                        f"{times[name] * 1e3:.1f} ms/step")
    report.row(row, "fused_cuda router step speedup", times["train_step"]
               / times["train_step_fused_cuda"])
    saved_ms = (times["train_step"] - times["train_step_adamw_kernel"]) * 1e3
    report.row(row, "fused AdamW kernel step speedup vs torch's AdamW step",
               times["train_step"] / times["train_step_adamw_kernel"],
               note=f"{saved_ms:.1f} ms less a step")
