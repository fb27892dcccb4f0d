"""Activation recompute (model.recompute): identical losses and gradients with every module
name and with full recompute, fewer bytes held for backward, router side effects counted once.

The reference is the same model without recompute, built from the same seed; the comparison is
bitwise (the recomputed forward is the same code on the same inputs).
"""

from __future__ import annotations

import pytest
import torch

from moeplug.config import (RECOMPUTE_MODULES, ConfigError, MLAConfig, ModelConfig, MoEConfig,
                            RecomputeConfig, RootConfig, TrainConfig,
                            config_from_dict)
from moeplug.build import build_model
from moeplug.plugin_host import PluginHost
from moeplug.testing.steps import backward_micro_batches

VOCAB = 40
# Shared experts, expert bias and the global aux loss (whose counts are a side effect that
# recompute must not repeat), sigmoid scores for the bias.
ROUTER = {"score_function": "sigmoid", "enable_expert_bias": True,
          "load_balancing_type": ["aux_loss", "global_aux_loss"], "aux_loss_coeff": [0.01, 0.01]}


def model_for(recompute: RecomputeConfig | None, seed: int = 0, attention: str = "gqa",
              activation: str = "swiglu", router: dict | None = None):
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=24, shared_expert_ffn_hidden_size=16,
                    activation=activation)
    m = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    first_k_dense=1, dense_ffn_hidden_size=48, moe=moe, attention=attention,
                    mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=8),
                    recompute=recompute or RecomputeConfig())
    cfg = RootConfig(model=m, train=TrainConfig(seq_len=16, warmup_steps=0))
    cfg.plugins.router_options.update(router or ROUTER)
    torch.manual_seed(seed)
    return build_model(cfg, PluginHost.load(), VOCAB)


def run(model, micro_batches: int = 2):
    """Loss per micro-batch, grads, router step counts, bytes held for backward."""
    losses, grads, peak = backward_micro_batches(model, VOCAB, micro_batches)
    routers = [b.ffn.router for b in model.blocks if hasattr(b.ffn, "router")]
    counts = [(r.step_counts_E.clone(), r.global_counts_E.clone()) for r in routers]
    return losses, grads, counts, peak


CASES = [RecomputeConfig(granularity="selective", modules=[name]) for name in RECOMPUTE_MODULES]
CASES += [RecomputeConfig(granularity="selective", modules=list(RECOMPUTE_MODULES)),
          RecomputeConfig(granularity="full", method="uniform", num_layers=1),
          RecomputeConfig(granularity="full", method="uniform", num_layers=2),
          RecomputeConfig(granularity="full", method="block", num_layers=2)]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("rc", CASES, ids=lambda rc: f"{rc.granularity}-{rc.method}-"
                         f"{rc.num_layers}-{'+'.join(rc.modules) or 'all'}")
def test_recompute_is_identical_and_holds_less(rc, attention):
    if attention == "mla" and rc.granularity == "full" and rc.method == "block":
        pytest.skip("covered with gqa; mla only changes the attention module")
    ref_losses, ref_grads, ref_counts, ref_peak = run(model_for(None, attention=attention))
    losses, grads, counts, peak = run(model_for(rc, attention=attention))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    # The routers counted each micro-batch once (expert-bias step counts, global aux counts).
    for (a, b), (ra, rb) in zip(counts, ref_counts):
        assert torch.equal(a, ra) and torch.equal(b, rb)
    names = rc.modules
    if attention == "gqa" and names == ["mla_up_proj"]:
        assert peak == ref_peak  # nothing of that name in a gqa model
    else:
        assert peak < ref_peak, (peak, ref_peak)


def test_moe_act_recompute_with_torch_activation():
    """grouped_mlp (non-SwiGLU activations) rebuilds act(h) * p in backward too."""
    rc = RecomputeConfig(granularity="selective", modules=["moe_act"])
    ref_losses, ref_grads, _, ref_peak = run(model_for(None, activation="gelu"))
    losses, grads, _, peak = run(model_for(rc, activation="gelu"))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert peak < ref_peak


@pytest.mark.parametrize("precision", ["fp8_tensorwise", "mxfp8"])
def test_moe_act_recompute_of_the_emulated_low_precision_experts(precision):
    """Under an emulated recipe the experts run moeplug.quant's GEMMs, which once ignored
    moe_act: the same model, the same bits, less held (the op-level bitwise check for every
    recipe is in tests/test_quant.py)."""
    rc = RecomputeConfig(granularity="selective", modules=["moe_act"])

    def under_recipe(model):
        with PluginHost.load().create("precision", precision, {}).autocast("cpu"):
            return run(model)
    ref_losses, ref_grads, _, ref_peak = under_recipe(model_for(None))
    losses, grads, _, peak = under_recipe(model_for(rc))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert peak < ref_peak, (peak, ref_peak)


def test_full_recompute_holds_about_one_input_per_chunk():
    """Full uniform recompute of every layer keeps (about) only each block's input: far less
    than selective recompute of every module."""
    _, _, _, full = run(model_for(RecomputeConfig(granularity="full")), micro_batches=1)
    _, _, _, none = run(model_for(None), micro_batches=1)
    assert full < none / 2, (full, none)


def test_recomputed_random_draws_repeat_the_forwards():
    """Input jitter draws from torch's global RNG inside the MoE layer: its recompute must draw
    the same noise (the checkpoint's RNG replay, moeplug.modules.recompute._replaying_rng) and
    leave the RNG where the plain run leaves it. Without the replay the recomputed routing
    differs and so do the gradients."""
    jitter = {**ROUTER, "input_jitter_eps": 0.3}
    for rc in (RecomputeConfig(granularity="selective", modules=["moe"]),
               RecomputeConfig(granularity="full")):
        ref_losses, ref_grads, _, _ = run(model_for(None, router=jitter))
        ref_next = torch.rand(4)
        losses, grads, _, _ = run(model_for(rc, router=jitter))
        assert torch.equal(torch.rand(4), ref_next), rc  # the RNG advanced as without recompute
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), rc
        for name, g in ref_grads.items():
            assert torch.equal(grads[name], g), (rc, name)


_TWO_THREADS = r"""
import gc, os, sys, threading, time, torch
from torch.utils.checkpoint import checkpoint
from moeplug.modules.recompute import checkpointed


class Garbage:  # a cycle, so only the collector frees it; its finalizer leaves another behind
    def __init__(self):
        self.me = self

    def __del__(self):
        Garbage()
        time.sleep(0)  # hands the GIL to the other thread


def torchs(fn, x):
    return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)


run = torchs if sys.argv[1] == "torch" else checkpointed


def loop(seconds):
    # For a time, not a count: the hang is a race, and 200 pairs per thread once went through
    # torch's save without it (a CI run under load); ~12 s of pairs makes that vanishingly rare.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        x = torch.ones(4, requires_grad=True)
        run(lambda v: (v * 2).sin(), x).sum().backward()


loop(0.5)  # warm (the first backward imports what it needs) before the collector is pushed
gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation: one inside every RNG save
Garbage()
seconds = float(sys.argv[2])
t = threading.Thread(target=loop, args=(seconds,))
t.start()
loop(seconds)
t.join()
print("finished", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("which", ["ours", "torch"])
def test_checkpoints_on_two_threads_do_not_deadlock_in_the_rng_save(which):
    """Combined 1F1B checkpoints forwards on one thread while the overlapped backward recomputes
    on another. torch.get_rng_state holds the generator's mutex while it builds the state
    tensor; a collection there runs a finalizer that hands the GIL over, and the other thread's
    RNG save then waits on the mutex holding the GIL: a hang (a fresh-clone CI run hung so).
    ``checkpointed`` saves and replays the RNG under a lock of its own and finishes; torch's own
    preserve_rng_state, run the same way, is expected to hang - if it ever stops hanging, the
    lock can go."""
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", _TWO_THREADS, which, "12"],
                             capture_output=True, text=True,
                             timeout=30 if which == "torch" else 180)
    except subprocess.TimeoutExpired:
        assert which == "torch", "checkpointed() deadlocked on two threads"
        return
    assert out.returncode == 0 and "finished" in out.stdout, out.stderr[-2000:]
    assert which == "ours", "torch's RNG save no longer hangs on two threads: drop _RNG_LOCK?"


def test_config_errors_name_valid_modules():
    with pytest.raises(ConfigError, match="core_attn, mla_up_proj, layernorm"):
        RecomputeConfig(granularity="selective", modules=["attn"])
    with pytest.raises(ConfigError, match="granularity selective"):
        RecomputeConfig(granularity="full", modules=["moe"])
    with pytest.raises(ConfigError, match="method"):
        config_from_dict({"model": {"recompute": {"granularity": "full", "method": "even"}}})


SELECTIVE = {"recompute": {"granularity": "selective",
                           "modules": ["core_attn", "layernorm", "moe_act", "mlp", "moe"]}}
LAYOUTS = {
    "ep2_selective": ({"ep": 2}, "alltoall", 1, SELECTIVE),
    "tp2_sp_selective": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1, SELECTIVE),
    "pp2_full_uniform": ({"pp": 2}, "alltoall", 2, {"recompute": {"granularity": "full"}}),
    "ep2_distopt_full_block": ({"ep": 2, "distributed_optimizer": True}, "alltoall", 1,
                               {"recompute": {"granularity": "full", "method": "block"}}),
}


def test_recompute_under_ep_tp_pp_equals_one_process():
    """The proof-matrix helper (tests/test_parallel_train.py) with recompute on: 3 AdamW steps
    of each layout match one process (which, above, matches no recompute bitwise) in losses,
    grad norm, every gradient shard and every parameter."""
    from moeplug.testing.distributed import run_distributed
    from test_parallel_train import GRAD_CLIP, TOL, _run_layouts
    for rank, report in enumerate(run_distributed(_run_layouts, 2, LAYOUTS, timeout=400)):
        for name, r in report.items():
            assert r["min_ref_norm"] > 2 * GRAD_CLIP
            assert "distopt" in name or r["num_grads"] > 0
            bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
            assert not bad, f"{name}, rank {rank}: differs from one process: {bad}"


def test_grouped_mm_ffn_discards_the_activation_under_moe_act():
    """The GPU experts' form (torch's grouped GEMM, whose CPU kernel runs it here): under
    moe_act the activation FC2 keeps for backward is freed once FC2 has run and made again just
    before FC2's backward (Megatron's output discarding): the output and every gradient are
    bitwise the same, and the bytes held for backward fall by exactly the activation's."""
    from moeplug.ops.cuda_ffn import grouped_mm_ffn
    from moeplug.training.memory import ActivationMeter
    g = torch.Generator().manual_seed(0)
    L, D, F, counts = 3, 16, 8, [5, 0, 7]
    S = sum(counts)
    x = torch.randn(S, D, generator=g).bfloat16().requires_grad_()
    p = torch.rand(S, generator=g).requires_grad_()
    w13 = (torch.randn(L, 2 * F, D, generator=g) / 4).bfloat16().requires_grad_()
    w2 = (torch.randn(L, D, F, generator=g) / 4).bfloat16().requires_grad_()
    dy = torch.randn(S, D, generator=g).bfloat16()

    def run(recompute_act: bool):
        meter = ActivationMeter(torch.nn.Module())
        with meter.active():
            y = grouped_mm_ffn(x, p, counts, w13, w2, torch.bfloat16, recompute_act)
            held = meter.current
        return y, torch.autograd.grad(y, (x, p, w13, w2), dy), held

    y_ref, grads_ref, held_ref = run(False)
    y, grads, held = run(True)
    assert torch.equal(y, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    assert held_ref - held == S * F * 2  # the bf16 activation [S, F]
