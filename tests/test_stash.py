"""The paged stash (moeplug.runtime.stash) and the model's registration with the runtime.

Parity: stash on vs off trains bitwise-identically (losses, grads, weights); overflow reruns the
step without the stash and still matches; `fail` says what to change; after warm-up the pool
serves every stash (no new pool memory, every page returned each step).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeplug.config import ConfigError, RootConfig
from moeplug.build import build_model
from moeplug.plugin_host import PluginHost
from moeplug.runtime import get_runtime
from moeplug.runtime.stash import StashOverflowError
from moeplug.testing.cli import run_cli
from moeplug.testing.steps import runtime_cfg as _cfg
from moeplug.testing.steps import train_ep2_variants
from moeplug.training.optim import build_optimizer
from moeplug.training.trainer import stash_runtime, train_step

VOCAB = 64


def _train(cfg: RootConfig, steps: int = 3, device: str = "cpu"):
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), VOCAB).to(device)
    opt = build_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        batches = [(torch.randint(0, VOCAB, (4, 16), generator=gen).to(device),
                    torch.randint(0, VOCAB, (4, 16), generator=gen).to(device))
                   for _ in range(2)]
        stats = train_step(model, opt, batches, cfg.train, PluginHost.load().create(
            "precision", "fp32", {}), None)
        history.append((stats, {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}))
    return model, history


def _assert_same_training(a, b):
    (model_a, hist_a), (model_b, hist_b) = a, b
    for (sa, ga), (sb, gb) in zip(hist_a, hist_b):
        assert sa.losses() == sb.losses()  # bitwise: floats compared exactly
        assert ga.keys() == gb.keys()
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), n


def test_pool_pages_are_zero_copy_torch_views():
    pool = get_runtime().PagePool(page_bytes=256, num_pages=4)
    whole = torch.frombuffer(pool, dtype=torch.uint8)
    first, count = pool.alloc(300)
    assert (first, count) == (0, 2)
    view = whole[first * 256:first * 256 + 300]
    view.fill_(7)
    again = torch.frombuffer(pool, dtype=torch.uint8)  # a second view of the same bytes
    assert again.data_ptr() == whole.data_ptr() and int(again[299]) == 7
    assert pool.stats()["pages_in_use"] == 2
    pool.free(first, count)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(first, count)


def test_core_argument_errors_reach_python_as_value_errors_naming_the_fix(tmp_path):
    """The bindings call the core directly; its std::invalid_argument arrives as ValueError with
    the core's message (pybind11's translation) for the spill tier and the shared-memory heap."""
    rt = get_runtime()
    with pytest.raises(ValueError, match="cannot create a file in .*Fix: set runtime.offload_dir"):
        rt.SpillTier(str(tmp_path / "missing"), 4096, 4)
    tier = rt.SpillTier(str(tmp_path), 4096, 4)
    with pytest.raises(ValueError, match=r"SpillTier\.write: run \{3, 2\} of 4096-byte pages"):
        tier.write(3, 2, 0, 16)  # checked before the (null) source is read
    with pytest.raises(ValueError, match="segment name 'bad' must be '/' followed by"):
        rt.ShmHeap("bad", 4096, 4, 0, 1)


def test_stash_on_and_off_train_bitwise_identically():
    off = _train(_cfg(stash=False))
    on = _train(_cfg(stash=True))
    _assert_same_training(on, off)
    rt = stash_runtime(on[0])
    stats = [s.stash for s, _ in on[1]]
    assert all(s["pages_in_use"] == 0 and s["overflows"] == 0 for s in stats)
    assert stats[0]["high_water"] > 0  # the experts' activations did go to the pool
    assert [s.stash for s, _ in off[1]] == [None] * 3 and rt.stash_active


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
def test_stash_on_a_gpu_uses_one_device_buffer_and_matches_off():
    off = _train(_cfg(stash=False), steps=2, device="cuda")
    on = _train(_cfg(stash=True), steps=2, device="cuda")
    _assert_same_training(on, off)
    rt = stash_runtime(on[0])
    assert rt._bytes.device.type == "cuda" and rt.pool.stats()["high_water"] > 0


def test_steady_state_steps_allocate_no_new_pool_memory():
    # What is counted: the pool's bytes (one allocation, made at the first stash) and its page
    # accounting. torch's own CPU allocations inside the experts are not counted here.
    cfg = _cfg(stash=True)
    model, _ = _train(cfg, steps=1)
    rt = stash_runtime(model)
    base, size = rt._bytes.data_ptr(), rt.pool.size_bytes
    allocs = rt.pool.stats()["allocs"]
    opt = build_optimizer(model, cfg.train)
    precision = PluginHost.load().create("precision", "fp32", {})
    for _ in range(2):
        batch = [(torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16)))]
        train_step(model, opt, batch, cfg.train, precision, None)
        st = rt.pool.stats()
        assert st["pages_in_use"] == 0 and st["overflows"] == 0
    assert rt._bytes.data_ptr() == base and rt.pool.size_bytes == size
    # 2 MoE layers x (x, h, a, probs) per micro-batch, all served by the pool.
    assert rt.pool.stats()["allocs"] - allocs == 2 * 2 * 4


def test_overflow_reruns_without_stash_and_matches_the_unstashed_run():
    off = _train(_cfg(stash=False))
    tiny = _train(_cfg(stash=True, stash_pages=1, stash_page_bytes=4096))
    _assert_same_training(tiny, off)
    stats = [s.stash for s, _ in tiny[1]]
    assert all(s["overflows"] > 0 and s["reruns"] == 1 for s in stats)


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_an_overflow_names_the_pool_size_that_holds_the_step(experts):
    """``pages_needed`` (the pool plus the pages of what did not fit) is enough: a pool of that
    size overflows no more. The sequential backend saves more, smaller tensors than the grouped
    op the automatic size is computed for: once it overflowed every step without a word."""
    def cfg(**rt):
        c = _cfg(stash=True, stash_page_bytes=4096, **rt)
        c.plugins.experts = experts
        return c
    small = _train(cfg(stash_pages=2), steps=2)[1]
    needed = max(s.stash["pages_needed"] for s, _ in small)
    assert all(s.stash["overflows"] > 0 for s, _ in small) and needed > 2
    held = _train(cfg(stash_pages=needed), steps=2)[1]
    assert all(s.stash["overflows"] == 0 and s.stash["reruns"] == 0 for s, _ in held)
    assert max(s.stash["high_water"] for s, _ in held) <= needed
    with pytest.raises(StashOverflowError, match=f"at least {needed},"):
        _train(cfg(stash_pages=2, stash_overflow="fail"), 1)


def test_an_automatic_pool_grows_to_what_a_step_needed_once():
    """``stash_pages: 0`` sizes the pool for what the grouped op saves; the sequential backend
    saves more, and the pool overflowed on every step (each step run twice). Now the first
    overflow grows it to ``pages_needed`` and the steps after it stash everything."""
    cfg = _cfg(stash=True)
    cfg.plugins.experts = "sequential"
    model, history = _train(cfg, steps=3)
    first, *rest = [s.stash for s, _ in history]
    assert first["overflows"] > 0 and first["reruns"] == 1
    assert first["grown_to"] == first["pages_needed"] == stash_runtime(model).pool.num_pages
    assert all(s["overflows"] == 0 and s["reruns"] == 0 and s["grown_to"] is None
               and 0 < s["high_water"] <= first["grown_to"] for s in rest)
    off = _cfg(stash=False)
    off.plugins.experts = "sequential"
    _assert_same_training((model, history), _train(off, steps=3))


def test_the_pool_grows_only_between_steps():
    """grow() replaces the pool; with pages still handed out it refuses, naming the rule."""
    model = build_model(_cfg(stash=True), PluginHost.load(), VOCAB)
    rt = stash_runtime(model)
    first, count = rt.pool.alloc(1)
    assert first >= 0
    with pytest.raises(RuntimeError, match=r"grow\(\) while pages are in use; call it between "
                                           r"steps"):
        rt.grow(rt.pool.num_pages + 1)
    rt.pool.free(first, count)
    rt.grow(rt.pool.num_pages + 1)
    assert rt.pool.num_pages == 9 and rt.pool.stats()["pages_in_use"] == 0


def test_an_overflow_is_said_on_the_console_and_recorded(tiny_config_file, tmp_path):
    out = tmp_path / "run"
    res = run_cli(["train", "--config", tiny_config_file(), "--out", str(out), "--steps", "2",
                   "--set", "runtime.stash=true", "--set", "runtime.stash_pages=1"], timeout=300)
    assert res.returncode == 0, res.stderr
    said = [line for line in (res.stdout + res.stderr).splitlines() if "stash pool overflowed"
            in line]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    over = [r for r in records if r["kind"] == "stash_overflow"]
    assert [r["step"] for r in over] == [1, 2] and [r["reruns"] for r in over] == [1, 2]
    assert all(r["grown_to"] is None for r in over)  # a size the user set is kept
    assert len(said) == 2 and "reran it without the stash" in said[0], said
    assert f"Fix: --set runtime.stash_pages={over[0]['pages_needed']}" in said[0], said


def test_overflow_keep_is_exact_too():
    off = _train(_cfg(stash=False), steps=2)
    keep = _train(_cfg(stash=True, stash_pages=1, stash_page_bytes=4096,
                       stash_overflow="keep"), steps=2)
    _assert_same_training(keep, off)
    assert all(s.stash["reruns"] == 0 and s.stash["overflows"] > 0 for s, _ in keep[1])


def test_overflow_fail_names_the_pool_and_the_fix():
    with pytest.raises(StashOverflowError, match=r"stash_overflow = 'fail'.*runtime.stash_pages"):
        _train(_cfg(stash=True, stash_pages=1, stash_page_bytes=4096, stash_overflow="fail"), 1)


def test_registration_gives_every_moe_layer_a_handle():
    model = build_model(_cfg(stash=True), PluginHost.load(), VOCAB)
    rt = stash_runtime(model)
    rec = rt.record()
    assert [l["index"] for l in rec["layers"]] == [0, 1]
    assert [l["handle"] for l in rec["layers"]] == [0, 1]
    layer = rec["layers"][0]
    assert (layer["num_experts"], layer["top_k"], layer["hidden"], layer["activation"]) == \
        (4, 2, 32, "swiglu")
    # 4*16*2 rows: x 32 + h 64 + a 32 floats, probs fp32, each rounded up to 64 KiB pages.
    assert layer["stash_pages"] == 4 and rec["pool"]["num_pages"] == 8


@pytest.mark.parametrize("override, names", [
    ({"stash_overflow": "retry"}, ("stash_overflow", "'retry'", "rerun")),
    ({"stash_page_bytes": 100}, ("stash_page_bytes", "100", "128")),
    ({"stash": "yes"}, ("RuntimeSection.stash", "'yes'", "true or false")),
])
def test_runtime_config_errors_name_field_value_and_fix(override, names):
    with pytest.raises(ConfigError) as err:
        _cfg(**override)
    for n in names:
        assert n in str(err.value)


@pytest.mark.slow
def test_cli_run_records_registration_and_stash_stats(tiny_config_file, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--config", tiny_config_file(), "--out", str(out), "--steps", "6",
            "--set", "runtime.stash=true", "--set", "train.log_interval=2"]
    res = run_cli(args, timeout=300)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = next(r for r in records if r["kind"] == "run")
    assert run["runtime"]["stash"] is True and len(run["runtime"]["layers"]) == 1
    assert run["runtime"]["layers"][0]["stash_pages"] > 0
    train = [r for r in records if r["kind"] == "train"]
    assert train and all(r["stash"]["overflows"] == 0 and r["stash"]["high_water"] > 0
                         for r in train)


def test_version_lists_the_runtime_stash_resources():
    res = subprocess.run([sys.executable, "-m", "moeplug", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "stash_pool=paged, contiguous page runs" in res.stdout


def _ep2_rank(rank: int, world: int) -> dict:
    variants = {"off": {}, "on": {"stash": True},
                "rerun": {"stash": True, "stash_pages": 1, "stash_page_bytes": 4096}}
    return train_ep2_variants(rank, world, variants, VOCAB, "stash")


@pytest.mark.slow
def test_ep2_stash_on_off_and_rerun_are_bitwise_identical():
    from moeplug.testing.distributed import run_distributed
    for res in run_distributed(_ep2_rank, 2, timeout=300):
        for name in ("on", "rerun"):
            assert res[name]["losses"] == res["off"]["losses"], name
            for n, p in res["off"]["params"].items():
                assert torch.equal(res[name]["params"][n], p), (name, n)
        assert all(s["high_water"] > 0 and s["overflows"] == 0 for s in res["on"]["stash"])
        assert all(s["reruns"] == 1 for s in res["rerun"]["stash"])
