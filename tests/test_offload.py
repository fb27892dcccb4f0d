"""Fine-grained activation offloading (model.offload): identical losses and gradients with every
module name, alone and all together, with the paged stash, under EP2 (real gloo); what leaves
memory really leaves (fewer bytes held for backward), and every run's pages come back.

The reference is the same model without offloading, built from the same seed; the comparison
is bitwise in fp32 (a restored tensor has the original's bytes, storage offset and strides).
"""

from __future__ import annotations

import pytest
import torch

from moeplug.config import (OFFLOAD_MODULES, ConfigError, ModelConfig, MoEConfig,
                            RecomputeConfig, RootConfig, RuntimeSection, TrainConfig,
                            config_from_dict)
from moeplug.build import build_model
from moeplug.plugin_host import PluginHost
from moeplug.runtime import stream
from moeplug.testing.steps import backward_micro_batches

VOCAB = 40


def model_for(offload: list[str], seed: int = 0, stash: bool = False, experts: str = "grouped",
              activation: str = "swiglu", tmp_path=None, sync_free: bool = False):
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=24, shared_expert_ffn_hidden_size=16,
                    activation=activation)
    m = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=32,
                    first_k_dense=1, dense_ffn_hidden_size=48, moe=moe, offload=offload)
    rt = RuntimeSection(stash=stash, offload_min_bytes=0, sync_free=sync_free,
                        offload_dir=str(tmp_path) if tmp_path else "")
    cfg = RootConfig(model=m, train=TrainConfig(seq_len=16, warmup_steps=0), runtime=rt)
    cfg.plugins.experts = experts
    torch.manual_seed(seed)
    return build_model(cfg, PluginHost.load(), VOCAB)


def run(model, micro_batches: int = 2):
    """Loss per micro-batch, grads and the bytes held for backward (offloaded ones are not)."""
    return backward_micro_batches(model, VOCAB, micro_batches)


@pytest.fixture(scope="module")
def reference():
    return run(model_for([]))


def _assert_same(got, want):
    losses, grads, _ = got
    assert all(torch.equal(a, b) for a, b in zip(losses, want[0]))
    for name, g in want[1].items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("names", [[n] for n in OFFLOAD_MODULES] + [list(OFFLOAD_MODULES)],
                         ids=lambda n: "+".join(n) if len(n) < 3 else "all")
def test_offload_is_identical_and_holds_less(names, reference, tmp_path):
    model = model_for(names, tmp_path=tmp_path)
    got = run(model)
    _assert_same(got, reference)
    o = model.runtime.offloader
    stream("offload").synchronize()  # the queued frees ran
    stats = o.stats()
    assert stats["bytes_offloaded"] > 0, names  # the name really moved something
    assert stats["bytes_prefetched"] == stats["bytes_offloaded"]  # all came back, once each
    assert stats["pages_in_use"] == 0 and stats["overflows"] == 0
    assert o.tier.stats()["bytes_read"] == stats["bytes_offloaded"]
    if names == ["attn_proj"]:
        # On the CPU o_proj's input is a view of SDPA's output, which SDPA itself keeps for
        # backward: moving o_proj's reference frees nothing (Megatron's flash attention keeps
        # its output too). Offloaded and restored all the same (above).
        assert got[2] <= reference[2]
    else:
        assert got[2] < reference[2], (names, got[2], reference[2])  # less held in memory


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
def test_offload_on_cuda_goes_to_pinned_host_memory_and_comes_back():
    """The GPU tier: every name's tensors go to pinned host memory on a side stream and come
    back on it before backward needs them (once silently kept on the GPU). Under bf16 autocast,
    as a GPU trains; the restored bytes are the originals, so the losses and grads are those of
    no offloading (close, not bitwise: the CUDA scatter-adds of the combine may sum in another
    order from run to run)."""
    def cuda_run(names):
        model = model_for(names).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return run(model), model.runtime.offloader
    want, _ = cuda_run([])
    got, o = cuda_run(list(OFFLOAD_MODULES))
    torch.cuda.synchronize()
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    stats = o.stats()
    assert stats["bytes_offloaded"] > 0 and stats["kept_no_tier"] == 0
    assert stats["bytes_prefetched"] == stats["bytes_offloaded"]
    assert got[2] < want[2]  # less held on the GPU for backward


def test_offload_with_the_paged_stash_and_a_torch_activation(tmp_path):
    want = run(model_for([], activation="gelu"))
    _assert_same(run(model_for(["expert_fc1", "moe_act", "core_attn"], stash=True,
                               activation="gelu", tmp_path=tmp_path)), want)
    _assert_same(run(model_for(["expert_fc1", "moe_act"], stash=True, tmp_path=tmp_path)),
                 run(model_for([], stash=True)))


@pytest.mark.parametrize("precision", ["fp8_blockwise", "nvfp4"])
def test_offload_of_the_emulated_low_precision_experts_is_identical(precision, tmp_path):
    """The emulated recipes' experts (moeplug.quant.quant_expert_mlp) mark their rows and FC1
    outputs too: once they offloaded nothing, silently."""
    def under_recipe(model):  # a fresh recipe: NVFP4's rounding draws from its own generator
        recipe = PluginHost.load().create("precision", precision, {})
        with recipe.autocast("cpu"):
            return run(model), model.runtime.offloader
    want, _ = under_recipe(model_for([]))
    got, o = under_recipe(model_for(["expert_fc1", "moe_act"], tmp_path=tmp_path))
    _assert_same(got, want)
    stream("offload").synchronize()
    stats = o.stats()
    assert stats["bytes_offloaded"] > 0 and stats["bytes_prefetched"] == stats["bytes_offloaded"]
    assert got[2] < want[2]  # less held for backward


def test_offload_with_selective_recompute_is_identical():
    rc = RecomputeConfig(granularity="selective", modules=["moe_act", "mlp"])
    ref, got = model_for([]), model_for(["expert_fc1", "moe_act", "attn_proj"])
    for mdl in (ref, got):
        mdl.cfg.recompute = rc
        from moeplug.modules.recompute import apply_recompute
        apply_recompute(mdl, rc)
    _assert_same(run(got), run(ref))


def test_prefetch_runs_before_backward_needs_it(tmp_path):
    """Backward reaching a marked module queues its reads and the previous module's: by the
    time autograd unpacks, every read is already queued (none fetched on demand)."""
    from moeplug.modules import offload
    calls = {"demand": 0}
    model = model_for(["expert_fc1", "attn_proj"], tmp_path=tmp_path)
    unpack = offload._unpack

    def counting_unpack(saved):
        if isinstance(saved, offload._Saved) and saved.spill.buffer is None:
            calls["demand"] += 1
        return unpack(saved)
    offload._unpack = counting_unpack
    try:
        run(model, micro_batches=1)
    finally:
        offload._unpack = unpack
    assert calls["demand"] == 0
    assert model.runtime.offloader.stats()["bytes_prefetched"] > 0


def test_bad_offload_config_fails_naming_field_value_and_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"ModelConfig.offload = \['fc1'\]: unknown.*"
                                          r"attn_norm, qkv_linear"):
        ModelConfig(offload=["fc1"])
    with pytest.raises(ConfigError, match="recompute module 'moe' already drops"):
        config_from_dict({"model": {"offload": ["expert_fc1"], "recompute": {
            "granularity": "selective", "modules": ["moe"]}}})
    # output discarding: the norm's output is the q/k/v projections' input, and mla_up_proj's
    # q, k, v are what core_attn offload would move
    for recompute, name in (("layernorm", "qkv_linear"), ("mla_up_proj", "core_attn")):
        with pytest.raises(ConfigError, match=f"\\['{name}'\\], whose tensors recompute module "
                                              f"'{recompute}' already drops"):
            config_from_dict({"model": {"offload": [name], "recompute": {
                "granularity": "selective", "modules": [recompute]}}})
    with pytest.raises(ConfigError, match="full recompute"):
        config_from_dict({"model": {"offload": ["core_attn"],
                                    "recompute": {"granularity": "full"}}})
    with pytest.raises(ConfigError, match="offload_dir.*not an existing directory"):
        config_from_dict({"runtime": {"offload_dir": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="offload = 'moe_act': must be a list"):
        config_from_dict({"model": {"offload": "moe_act"}})
    with pytest.raises(ConfigError, match="SequentialExperts cannot run model.offload moe_act"):
        model_for(["moe_act"], experts="sequential")


MOE_ACT = {"granularity": "selective", "modules": ["moe_act"]}


@pytest.mark.parametrize("stash", [False, True], ids=["plain", "stash"])
@pytest.mark.parametrize("names", [["expert_fc1"], ["moe_act"], ["expert_fc1", "moe_act"]],
                         ids="+".join)
def test_expert_offload_in_the_sync_free_region_is_identical_and_holds_less(names, stash,
                                                                           tmp_path):
    """runtime.sync_free's eager CPU region notes the tensors the expert names mean (its
    packed FC1 input and FC1 output, budget padding included): they leave memory and come
    back, gradients bitwise. Once refused at start-up; before that, silently ignored. With the
    paged stash the offload scope is inside the stash's, as on the dynamic path: the named
    tensors go to the tier instead of the pages (nothing held either way)."""
    want = run(model_for([], stash=stash, sync_free=True))
    model = model_for(names, stash=stash, sync_free=True, tmp_path=tmp_path)
    got = run(model)
    _assert_same(got, want)
    stream("offload").synchronize()
    stats = model.runtime.offloader.stats()
    assert stats["bytes_offloaded"] > 0, names
    assert stats["bytes_prefetched"] == stats["bytes_offloaded"]
    assert stats["pages_in_use"] == 0 and stats["overflows"] == 0
    if not stash:
        assert got[2] < want[2], (names, got[2], want[2])


def test_moe_act_recompute_is_the_sync_free_regions_only_mode():
    """The eager CPU region keeps FC1's output and rebuilds the activation in backward
    whatever is asked: moe_act recompute is accepted there and changes nothing (the same bytes
    held, bitwise gradients), and still acts on the dynamic path that an over-budget rerun
    and evaluation take."""
    from moeplug.modules.recompute import apply_recompute
    rc = RecomputeConfig(granularity="selective", modules=["moe_act"])
    want = run(model_for([], sync_free=True))
    model = model_for([], sync_free=True)
    model.cfg.recompute = rc
    apply_recompute(model, rc)
    got = run(model)
    _assert_same(got, want)
    assert got[2] == want[2]
    # the flag reached the experts (the dynamic path's op keeps h, not the activation)
    assert all(b.ffn.experts.recompute_activation for b in model.blocks[1:])


@pytest.mark.parametrize("model, field", [
    ({"recompute": MOE_ACT}, r"RecomputeConfig.modules = \['moe_act'\]: moe_act acts"),
    ({"offload": ["expert_fc1", "moe_act"]},
     r"ModelConfig.offload = \['expert_fc1', 'moe_act'\]: expert_fc1 and moe_act act"),
])
def test_expert_op_levers_are_refused_where_capture_would_ignore_them(model, field):
    """moe_act recompute and the expert offload names act inside the expert ops; the region
    runtime.capture compiles keeps what inductor chooses, out of any saved-tensor hook's
    sight. (Eager sync-free runs them: the tests above.)"""
    over = {"runtime": {"sync_free": True, "capture": True}}
    with pytest.raises(ConfigError, match=f"{field} inside the expert ops; runtime.capture "
                                          f"compiles the sync-free region.* Fix: drop .* from "
                                          f"model\\.(recompute\\.modules|offload), or set "
                                          f"runtime.capture: false"):
        config_from_dict({"model": model, **over})
    config_from_dict({"model": model})  # valid on their own
    config_from_dict({"model": model, "runtime": {"sync_free": True}})  # and sync-free eager
    config_from_dict({"model": model, "plugins": {"precision": "mxfp8"}})  # the quant experts too
    config_from_dict({"model": {"offload": ["core_attn"]}, **over})  # outside the experts: fine


@pytest.mark.parametrize("settings", [
    ("--set", "model.offload=[expert_fc1]"),
    ("--set", "model.recompute={granularity: selective, modules: [moe_act]}"),
])
def test_an_experts_backend_without_the_ops_is_refused_before_training(run_cli, tiny_config_file,
                                                                      tmp_path, settings):
    """Once a traceback from the model build (exit 1); now a configuration error at the plugin
    check, before data, model or process group, and no run directory."""
    out = tmp_path / "run"
    proc = run_cli("train", "--config", tiny_config_file(str(out)), "--set",
                   "plugins.experts=sequential", *settings)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("plugins.experts = 'sequential': SequentialExperts cannot run model."
            in proc.stderr), proc.stderr
    assert "Fix: use plugins.experts: grouped" in proc.stderr and not out.exists()


def test_cuda_refuses_the_expert_settings_its_path_does_not_run():
    """``train.device: auto`` resolves to a GPU only at launch: the CUDA swiglu experts (torch's
    grouped_mm autograd) cannot delay dW. Checked on any machine. moe_act runs there (its
    activation discarded after FC2: test_grouped_mm_ffn_discards_the_activation_under_moe_act)."""
    from moeplug.config.modes import check_modes
    field = "TrainConfig.device = 'auto'"
    with pytest.raises(ConfigError, match=f"{field}: model.*delay_wgrad_compute runs in the CPU "
                                          f"expert ops only.* Fix: "):
        check_modes(config_from_dict({"model": {"moe": {"delay_wgrad_compute": True}}}),
                    device="cuda")
    check_modes(config_from_dict({"model": {"recompute": MOE_ACT}}), device="cuda")
    # the other activations run moeplug.ops.grouped_ffn.grouped_mlp on every device, which takes the flag
    gelu = {"recompute": MOE_ACT, "moe": {"activation": "gelu"}}
    check_modes(config_from_dict({"model": gelu}), device="cuda")
    # but a GPU's sync-free region keeps the activation and has no offload scope
    for model in (gelu, {"offload": ["expert_fc1"]}):
        with pytest.raises(ConfigError, match=f"{field}: model.* act in the CPU's sync-free "
                                              f"region only.* Fix: .*runtime.sync_free: false"):
            check_modes(config_from_dict({"model": model, "runtime": {"sync_free": True}}),
                        device="cuda")


def _ep2_on_off(rank: int, world: int, sync_free: bool = False) -> dict:
    """Two AdamW steps of an EP2 model with and without offloading, from the same seed."""
    import numpy as np
    from moeplug.parallel import ParallelGroups
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    ids = np.random.default_rng(3).integers(0, 64, 2048).astype(np.int64)
    out = {}
    # sync-free: the expert names only, so what moved is the static region's (its budget is
    # 2x the balanced load, T rows an expert here: no step can overflow into the dynamic path)
    names = ["expert_fc1", "moe_act"] if sync_free else list(OFFLOAD_MODULES)
    for name, offload in (("off", []), ("on", names)):
        cfg = config_from_dict({
            "model": {"hidden_size": 16, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                      "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8},
                      "offload": offload},
            "plugins": {"dispatcher": "alltoall"},
            "runtime": {"offload_min_bytes": 0, "sync_free": sync_free},
            "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 8, "lr": 1e-2,
                      "warmup_steps": 1, "seed": 7},
            "parallel": {"ep": 2}})
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        seed_everything(cfg.train.seed)
        model = build_rank_model(cfg, host, 64, groups)
        opt = build_rank_optimizer(model, cfg, groups)
        losses = [train_step(model, opt, step_batches(ids, cfg.train, s, groups), cfg.train,
                             precision, groups).loss for s in range(2)]
        rt = model.runtime if hasattr(model, "runtime") else None
        moved = rt.offloader.stats()["bytes_offloaded"] if rt and rt.offloader else 0
        out[name] = {"losses": losses, "moved": moved,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


@pytest.mark.parametrize("sync_free", [False, True], ids=["dynamic", "sync_free"])
def test_offload_under_ep2_is_identical(sync_free):
    from moeplug.testing.distributed import run_distributed
    for rank, r in enumerate(run_distributed(_ep2_on_off, 2, sync_free, timeout=300)):
        assert r["on"]["moved"] > 0, rank
        assert r["on"]["losses"] == r["off"]["losses"], rank
        for n, p in r["off"]["params"].items():
            assert torch.equal(r["on"]["params"][n], p), (rank, n)


def test_train_records_report_each_steps_offloading(run_cli, tiny_corpus, cache_dir, tmp_path):
    """A real ``moeplug train`` run (subprocess) with expert_fc1 + moe_act offloaded: every train
    record of metrics.jsonl carries that step's offloading. The tiny model has one MoE layer;
    its grouped experts save x_SD (T*K rows of D fp32) for FC1 and FC1's output (T*K rows of 2F
    fp32, SwiGLU) for the activation: those bytes leave each step, all come back before
    backward needs them, and the tier's high-water mark (reset each step) covers the two at
    once, in whole pages."""
    import json

    import yaml

    from tests.conftest import tiny_config_dict
    page = 4096
    out = str(tmp_path / "run")
    cfg = tiny_config_dict(tiny_corpus, out, cache_dir)
    cfg["model"]["offload"] = ["expert_fc1", "moe_act"]
    cfg["runtime"] = {"offload_min_bytes": 0, "offload_dir": str(tmp_path),
                      "stash_page_bytes": page}
    cfg["train"].update(steps=3, log_interval=1, eval_interval=0)
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_cli("train", "--config", str(path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(f"{out}/metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    m, t = cfg["model"], cfg["train"]
    rows = t["micro_batch_size"] * t["seq_len"] * m["moe"]["top_k"]
    x_bytes, h_bytes = rows * m["hidden_size"] * 4, rows * 2 * m["moe"]["ffn_hidden_size"] * 4
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        o = r["offload"]
        assert o["bytes_offloaded"] == x_bytes + h_bytes, o  # this step's, not the run's total
        assert o["bytes_prefetched"] == o["bytes_offloaded"], o
        assert o["high_water_bytes"] == o["high_water_pages"] * page
        assert x_bytes + h_bytes <= o["high_water_bytes"] < x_bytes + h_bytes + 2 * page, o
        assert 0.0 <= o["prefetch_wait_s"] < 60.0 and o["overflows"] == 0, o
