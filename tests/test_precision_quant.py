"""The low-precision precision plugins (fp8_tensorwise, fp8_delayed, fp8_blockwise, mxfp8,
nvfp4): the public contract, option validation through the CLI, that they reach every block
GEMM (dense, attention, experts) and the dispatch, and short training runs next to bf16."""

from __future__ import annotations

import json

import pytest
import torch

from moeplug.plugin_host import PluginHost
from moeplug.quant.wire import WIRE, reset_wire, wire_bytes_per_row
from moeplug.testing import check_precision

RECIPES = ["fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4"]


@pytest.fixture(scope="module")
def host():
    return PluginHost.load()


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_passes_the_precision_contract(host, name):
    check_precision(host, name)


def _model(tiny_cfg, host, *overrides):
    from moeplug.cli import check_plugins
    from moeplug.data import prepare_corpus
    from moeplug.build import build_model
    from moeplug.training.trainer import seed_everything
    cfg = tiny_cfg(*overrides)
    precision = check_plugins(host, cfg)
    corpus = prepare_corpus(cfg.data)
    seed_everything(0)
    return build_model(cfg, host, corpus.vocab_size), precision


def _loss(model, precision):
    torch.manual_seed(1)
    tokens = torch.randint(0, 200, (2, 16))
    with precision.autocast("cpu"):
        return model(tokens, tokens).loss


def test_recipe_changes_every_block_and_bf16_layers_switch_it_off(tiny_cfg, host):
    """2 blocks (dense, then MoE). All blocks in bf16 -> exactly the bf16 loss; only the dense
    block in bf16 -> still different (the MoE block's attention and experts are quantized)."""
    bf16 = _loss(*_model(tiny_cfg, host, "plugins.precision=bf16")).item()
    for name in RECIPES:
        base = f"plugins.precision={name}"
        assert _loss(*_model(tiny_cfg, host, base)).item() != bf16, name
        off = _model(tiny_cfg, host, base, "plugins.precision_options.bf16_first_layers=1",
                     "plugins.precision_options.bf16_last_layers=1")
        assert _loss(*off).item() == bf16, name
        moe_only = _model(tiny_cfg, host, base, "plugins.precision_options.bf16_first_layers=1")
        assert _loss(*moe_only).item() != bf16, name


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_experts_backends_agree_under_a_recipe(tiny_cfg, host, experts):
    ref = _loss(*_model(tiny_cfg, host, "plugins.precision=mxfp8", "plugins.experts=grouped"))
    got = _loss(*_model(tiny_cfg, host, "plugins.precision=mxfp8", f"plugins.experts={experts}"))
    assert got.item() == ref.item()


def test_dispatch_sends_fp8_rows_and_counts_the_bytes(tiny_cfg, host):
    """One MoE layer, 32 tokens x top-2 = 64 rows of D = 32: MXFP8 sends 32 bytes + one E8M0
    scale per row; quantize_dispatch=false sends nothing quantized."""
    model, precision = _model(tiny_cfg, host, "plugins.precision=mxfp8")
    reset_wire()
    _loss(model, precision).backward()
    assert WIRE == {"rows": 64, "bytes": 64 * (32 + 1)}
    assert wire_bytes_per_row(precision.recipe, 32) == 33
    model, precision = _model(tiny_cfg, host, "plugins.precision=mxfp8",
                              "plugins.precision_options.quantize_dispatch=false")
    reset_wire()
    _loss(model, precision).backward()
    assert WIRE == {"rows": 0, "bytes": 0}


@pytest.mark.parametrize("name, setting, message", [
    ("fp8_delayed", "amax_history_len=0", "FP8DelayedOptions.amax_history_len = 0"),
    ("fp8_delayed", "margin=-1", "FP8DelayedOptions.margin = -1"),
    ("fp8_tensorwise", "format=e5m2", "format"),
    ("nvfp4", "bf16_first_layers=-1", "NVFP4Options.bf16_first_layers = -1"),
    ("mxfp8", "block_size=16", "block_size"),
])
def test_bad_recipe_options_exit_2_naming_the_field(run_cli, name, setting, message):
    proc = run_cli("train", "--set", f"plugins.precision={name}",
                   "--set", f"plugins.precision_options.{setting}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_short_training_under_each_recipe_tracks_bf16(tiny_cfg, host, tmp_path):
    """30 steps of the tiny model: every recipe's final training loss is within 0.05 (FP8/MXFP8)
    or 0.1 (NVFP4) nats of bf16's (measured: all within 0.007 of bf16's 3.918)."""
    from moeplug.training.trainer import train
    final = {}
    for name in ["bf16"] + RECIPES:
        out = tmp_path / name
        model, precision = _model(tiny_cfg, host, f"plugins.precision={name}",
                                  "train.eval_interval=0", f"train.out_dir={out}")
        cfg = tiny_cfg(f"plugins.precision={name}", "train.eval_interval=0",
                       f"train.out_dir={out}")
        train(cfg, model, _corpus(cfg), precision, {}, log=lambda _: None, use_bar=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        final[name] = [r["lm_loss"] for r in rows if r.get("kind") == "train"][-1]
    for name in RECIPES:
        tol = 0.1 if name == "nvfp4" else 0.05
        assert abs(final[name] - final["bf16"]) < tol, final


def _corpus(cfg):
    from moeplug.data import prepare_corpus
    return prepare_corpus(cfg.data)


@pytest.mark.parametrize("name, multiple", [("fp8_tensorwise", 16), ("mxfp8", 32), ("nvfp4", 32)])
def test_router_pads_expert_rows_to_the_recipe_alignment(tiny_cfg, host, name, multiple):
    """The topk router's padding for quantization follows the recipe unless set explicitly."""
    seen = []

    def grab(module, args):
        seen.append(args[2].tolist())

    for setting, want in [(None, multiple), (8, 8)]:
        extra = [] if setting is None else [f"plugins.router_options.padding_for_quantization="
                                            f"{setting}"]
        model, precision = _model(tiny_cfg, host, f"plugins.precision={name}", *extra)
        seen.clear()
        [moe] = [m for m in model.modules() if hasattr(m, "dispatcher")]
        moe.experts.register_forward_pre_hook(grab)
        _loss(model, precision)
        assert seen and all(n % want == 0 for n in seen[0]), seen
        assert setting is not None or sum(seen[0]) > 64, seen  # 64 real rows, padded


def _ep2_mxfp8(rank: int, world: int) -> dict:
    """EP2 MoE layer under MXFP8 (rows sent as FP8 + E8M0 scales) vs one process: MXFP8 scales
    are per row (and per expert along M), so the two layouts quantize identical blocks."""
    import torch.distributed as dist

    from moeplug.moe import MoELayer
    from moeplug.parallel.sharding import load_expert_shard
    from moeplug.quant import MXFP8, recipe_scope
    from moeplug.testing._common import tiny_model_config

    host = PluginHost.load()
    cfg = tiny_model_config(num_experts=4, top_k=2, hidden_size=64, ffn_hidden_size=32)

    def layer(group):
        d = host.create("dispatcher", "alltoall", {}, cfg, group)
        return MoELayer(host.create("router", "topk", {}, cfg), d,
                        host.create("experts", "grouped", {}, cfg, d.num_local_experts))

    gen = torch.Generator().manual_seed(7)
    x_TD, w_TD = torch.randn(24, 64, generator=gen), torch.randn(24, 64, generator=gen)
    recipe = MXFP8()
    torch.manual_seed(0)
    ref = layer(None)
    xr = x_TD.clone().requires_grad_()
    with recipe_scope(recipe):
        y_ref = ref(xr)[0]
    (y_ref * w_TD).sum().backward()
    ep = layer(dist.group.WORLD)
    load_expert_shard(ep, ref.state_dict(), rank, world)
    lo, hi = rank * 12, rank * 12 + 12
    x = x_TD[lo:hi].clone().requires_grad_()
    reset_wire()
    with recipe_scope(recipe):
        y = ep(x)[0]
    (y * w_TD[lo:hi]).sum().backward()
    return {"output": (y - y_ref[lo:hi]).abs().max().item(),
            "input_grad": (x.grad - xr.grad[lo:hi]).abs().max().item(),
            "quantized": (y_ref - ref(xr)[0]).abs().max().item(),  # the recipe changed y
            "wire": dict(WIRE)}


def test_ep2_quantized_dispatch_matches_one_process_and_sends_fp8_bytes():
    from moeplug.testing.distributed import run_distributed
    for r in run_distributed(_ep2_mxfp8, 2, timeout=180):
        assert r["output"] < 1e-5 and r["input_grad"] < 1e-5, r
        assert r["quantized"] > 1e-4, r
        # 12 tokens x top-2 rows, each 64 FP8 bytes + 2 E8M0 scales (vs 256 bytes in fp32)
        assert r["wire"] == {"rows": 24, "bytes": 24 * 66}, r


def _two_steps(tiny_cfg, host, *overrides):
    """Loss and grads of a second forward/backward (after one end_step) of a fresh model."""
    model, precision = _model(tiny_cfg, host, *overrides)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = _loss(model, precision)
        loss.backward()
        precision.end_step(model)
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_delayed"])
@pytest.mark.parametrize("recompute", [
    ["model.recompute.granularity=full", "model.recompute.num_layers=1"],
    ["model.recompute.granularity=selective", "model.recompute.modules=[moe,mlp]"]],
    ids=["full", "selective-moe-mlp"])
def test_recompute_under_a_recipe_equals_no_recompute(tiny_cfg, host, recompute, recipe):
    """Recompute ≡ no recompute under a low-precision recipe (grads bitwise), with the first
    block kept bf16 so the per-block recipe decision is part of what is recomputed. Two steps,
    so fp8_delayed's second runs on scales from the first's amaxes: a recomputed forward must
    quantize with the scale its original forward used (it once took the scale its own first
    pass had just moved)."""
    base = [f"plugins.precision={recipe}", "plugins.precision_options.bf16_first_layers=1"]
    _, ref = _two_steps(tiny_cfg, host, *base)
    _, got = _two_steps(tiny_cfg, host, *base, *recompute)
    assert got.keys() == ref.keys()
    for name, g in got.items():
        assert torch.equal(g, ref[name]), name


def _train_cli(cfg_file: str, out: str, *extra: str) -> list[dict]:
    import os

    from moeplug.cli import main
    from moeplug.training.metrics import read_metrics
    rc = main(["train", "--config", cfg_file, "--out", out, "--steps", "6",
               "--set", "plugins.precision=fp8_delayed", "--set", "train.warmup_steps=2",
               "--set", "train.log_interval=1", "--set", "train.eval_interval=0",
               "--set", "train.ckpt_interval=3", *extra])
    assert rc == 0
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def test_delayed_scaling_history_resumes_bitwise(tiny_config_file, tmp_path, monkeypatch):
    """fp8_delayed's amax histories go into the checkpoint (meta.json precision_state, by
    parameter name) and come back on resume: steps 4-6 and the final weights of a run resumed
    at step 3 equal the uninterrupted run's bit for bit. Resuming the same checkpoint with the
    histories deleted does not (scale 1 instead of the history's), so the state is what
    makes them equal."""
    import os
    import shutil

    from safetensors.torch import load_file
    monkeypatch.setenv("MOEPLUG_CACHE", str(tmp_path / "cache"))
    cfg_file = tiny_config_file()
    full = str(tmp_path / "full")

    def losses(records):
        return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

    uninterrupted = losses(_train_cli(cfg_file, full))
    ckpt = os.path.join(full, "step_000003")
    meta = json.loads(open(os.path.join(ckpt, "meta.json")).read())
    state = meta["precision_state"]
    # one amax per step so far (an expert that got no rows in a step records none)
    assert state and all(1 <= len(e["history"]) <= 3 for e in state)
    assert max(len(e["history"]) for e in state) == 3
    assert {e["role"] for e in state} == {"x", "w", "g"}

    resumed_dir = str(tmp_path / "resumed")
    resumed = losses(_train_cli(cfg_file, resumed_dir, "--resume", ckpt))
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == uninterrupted[s] for s in resumed), (resumed, uninterrupted)
    a = load_file(os.path.join(full, "step_000006", "model.safetensors"))
    b = load_file(os.path.join(resumed_dir, "step_000006", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    forgot = tmp_path / "forgot_ckpt"
    shutil.copytree(ckpt, forgot)
    del meta["precision_state"]
    (forgot / "meta.json").write_text(json.dumps(meta))
    without = losses(_train_cli(cfg_file, str(tmp_path / "forgot"), "--resume", str(forgot)))
    assert without[4] != uninterrupted[4]


# (loss, grad) bounds of overlap_chunks=2 against 1, as README's overlap section states them
CHUNKED = {"fp32": (0.0, 1e-8), "fp8_delayed": (0.0, 1e-8), "fp8_blockwise": (0.0, 1e-8),
           "bf16": (0.0, 5e-4), "mxfp8": (0.0, 1e-3), "fp8_tensorwise": (5e-4, 1e-2),
           "nvfp4": (5e-4, 3e-2)}


@pytest.mark.parametrize("recipe", sorted(CHUNKED))
def test_overlap_chunks_and_the_stash_under_each_recipe(tiny_cfg, host, recipe):
    """The stash is bitwise under every recipe. Chunking the MoE layer's tokens changes the
    rows each expert GEMM quantizes together: exact to fp32 rounding where scales do not
    depend on them, within the README's bounds where they do."""
    base = f"plugins.precision={recipe}"
    loss, grads = _two_steps(tiny_cfg, host, base)
    stash_loss, stash_grads = _two_steps(tiny_cfg, host, base, "runtime.stash=true")
    assert stash_loss == loss and all(torch.equal(stash_grads[n], g) for n, g in grads.items())
    chunked_loss, chunked = _two_steps(tiny_cfg, host, base, "model.moe.overlap_chunks=2")
    loss_bound, grad_bound = CHUNKED[recipe]
    assert abs(chunked_loss - loss) <= loss_bound
    assert max((chunked[n] - g).abs().max().item() for n, g in grads.items()) <= grad_bound
