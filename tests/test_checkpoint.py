"""Checkpoints: exact round trip, exact resume, atomic writes, and no unpickling ever."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

from moeplug.training import checkpoint as ck
from moeplug.training.checkpoint import (CheckpointError, find_latest, load_checkpoint,
                                         resolve_resume, save_checkpoint)


class _Tied(nn.Module):
    """Embedding tied to the output head (shared storage) plus an ordinary layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def _trained(seed: int = 0, steps: int = 3):
    torch.manual_seed(seed)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, 11, (4, 5))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    model, opt = _trained()
    torch.manual_seed(99)
    path = save_checkpoint(str(tmp_path), 3, model, opt, {"metrics": {"tokens_seen": 60}})
    expected_draw = torch.rand(3)
    assert os.path.basename(path) == "step_000003"

    model2, opt2 = _trained(seed=1, steps=1)  # different weights and optimizer moments
    meta = load_checkpoint(path, model2, opt2)
    assert meta["step"] == 3 and meta["metrics"] == {"tokens_seen": 60}
    assert torch.equal(torch.rand(3), expected_draw)  # torch RNG continues where it was saved
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    assert model2.head.weight is model2.embed.weight  # still tied after loading
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for idx in s1["state"]:
        for k in s1["state"][idx]:
            assert torch.equal(torch.as_tensor(s1["state"][idx][k]),
                               torch.as_tensor(s2["state"][idx][k])), (idx, k)
    assert s1["param_groups"] == s2["param_groups"]


def test_latest_pointer_and_resume_resolution(tmp_path):
    model, opt = _trained()
    save_checkpoint(str(tmp_path), 1, model, opt, {})
    second = save_checkpoint(str(tmp_path), 2, model, opt, {})
    assert (tmp_path / "latest").read_text().strip() == "step_000002"
    assert find_latest(str(tmp_path)) == second
    assert resolve_resume("auto", str(tmp_path)) == second
    assert resolve_resume(str(tmp_path), "elsewhere") == second
    assert resolve_resume(str(tmp_path / "step_000001"), "x") == str(tmp_path / "step_000001")
    assert resolve_resume("", str(tmp_path)) is None
    assert resolve_resume("auto", str(tmp_path / "empty")) is None


def test_resume_from_missing_dir_names_field_value_and_fix(tmp_path):
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(tmp_path / "nope"), str(tmp_path))
    msg = str(err.value)
    assert "TrainConfig.resume" in msg and "nope" in msg and "Fix:" in msg and "'auto'" in msg


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model, opt = _trained()
    good = save_checkpoint(str(tmp_path), 1, model, opt, {"metrics": {}})
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # Crash in the middle of the next save: after the tensors, before meta.json is written,
    # with no cleanup (a power cut runs no handler: the removal of the temp dir is disabled).
    def crash(*_a, **_k):
        raise KeyboardInterrupt("power cut")
    monkeypatch.setattr(ck, "_write_json", crash)
    monkeypatch.setattr(ck.shutil, "rmtree", lambda *_a, **_k: None)
    with torch.no_grad():
        model.mid.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 2, model, opt, {"metrics": {}})
    monkeypatch.undo()

    leftovers = [d for d in os.listdir(tmp_path) if d.startswith(".tmp-")]
    assert leftovers, "the interrupted save should have left its temp dir behind"
    assert not (tmp_path / "step_000002").exists()
    assert find_latest(str(tmp_path)) == good
    fresh = _Tied()
    load_checkpoint(resolve_resume("auto", str(tmp_path)), fresh, None, restore_rng=False)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_a_stop_inside_a_save_removes_its_temp_dir(tmp_path, monkeypatch):
    # Ctrl-C (or the SIGTERM a one-process run turns into the same) mid-save: the partial
    # directory goes at once, not at the next run's prune
    model, opt = _trained()
    good = save_checkpoint(str(tmp_path), 1, model, opt, {"metrics": {}})

    def stop(*_a, **_k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ck, "_write_json", stop)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 2, model, opt, {"metrics": {}})
    monkeypatch.undo()
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".tmp-")]
    assert find_latest(str(tmp_path)) == good


def test_crash_between_rename_and_latest_update_finds_newest(tmp_path):
    model, opt = _trained()
    save_checkpoint(str(tmp_path), 1, model, opt, {})
    save_checkpoint(str(tmp_path), 2, model, opt, {})
    (tmp_path / "latest").write_text("step_000001\n")  # as if the pointer update never happened
    (tmp_path / "step_000001" / "meta.json").unlink()  # and the pointed-to one is incomplete
    assert find_latest(str(tmp_path)) == str(tmp_path / "step_000002")


def test_loading_refuses_pickle_files(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})
    # Replace the weights with a pickle (what torch.save writes); it must never be unpickled.
    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        pickle.dump(Boom(), f)
    with pytest.raises(CheckpointError, match=r"model.safetensors' is damaged: its SHA-256"):
        load_checkpoint(path, _Tied(), None, restore_rng=False)
    # Without the recorded checksums (an older checkpoint) the safetensors parser refuses it.
    _edit_meta(path, lambda meta: meta.pop("files"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, _Tied(), None, restore_rng=False)
    msg = str(err.value)
    assert "model.safetensors" in msg and "not a valid safetensors file" in msg
    assert "never unpickles" in msg and "Fix:" in msg
    assert not marker.exists()


def _edit_meta(path: str, edit) -> None:
    """Apply ``edit`` to checkpoint ``path``'s meta.json dict and write it back."""
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def test_loading_a_torch_save_directory_is_refused(tmp_path):
    model, _ = _trained()
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save(model.state_dict(), d / "model.pt")
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(d), str(tmp_path))
    assert "no checkpoint there" in str(err.value)
    # Next to a real checkpoint's meta.json, the missing safetensors file is what is named.
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(str(tmp_path / "real"), 1, model, opt, {})
    (d / "meta.json").write_text((tmp_path / "real" / "step_000001" / "meta.json").read_text())
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(d), _Tied(), None, restore_rng=False)
    assert "model.safetensors" in str(err.value) and "is missing" in str(err.value)


def test_wrong_format_and_shape_mismatch_are_reported(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 6)
            self.extra = nn.Linear(6, 2)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, Other(), None, restore_rng=False)
    assert "does not match the model" in str(err.value) and "extra.weight" in str(err.value)

    meta = os.path.join(path, "meta.json")
    with open(meta) as f:
        text = f.read()
    with open(meta, "w") as f:
        f.write(text.replace("moeplug-checkpoint-v1", "v0"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, _Tied(), None)
    assert "'v0'" in str(err.value) and "Fix:" in str(err.value)


# --------------------------------------------------------------------------------------------
# Resume with the real trainer, data, plugins and model (in-process through the CLI entry)
# --------------------------------------------------------------------------------------------

def _train(cfg_file: str, out: str, *extra: str) -> list[dict]:
    from moeplug.cli import main
    from moeplug.training.metrics import read_metrics
    rc = main(["train", "--config", cfg_file, "--out", out, "--steps", "8",
               "--set", "train.warmup_steps=2", "--set", "train.log_interval=1",
               "--set", "train.eval_interval=4", "--set", "train.ckpt_interval=4", *extra])
    assert rc == 0
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_config_file, tmp_path, monkeypatch):
    import shutil
    from safetensors.torch import load_file
    monkeypatch.setenv("MOEPLUG_CACHE", str(tmp_path / "cache"))
    cfg_file = tiny_config_file()
    full = str(tmp_path / "full")
    uninterrupted = _losses(_train(cfg_file, full))
    assert sorted(uninterrupted) == list(range(1, 9))

    # Explicit resume from the step-4 checkpoint, into a new run directory.
    resumed_dir = str(tmp_path / "resumed")
    records = _train(cfg_file, resumed_dir, "--resume", os.path.join(full, "step_000004"))
    resumed = _losses(records)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:  # fp32, one thread: bit-identical, well inside the 1e-6 requirement
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6), step
    val = {r["step"]: r["val_loss"] for r in records if r["kind"] == "val"}
    val_full = {r["step"]: r["val_loss"] for r in _read_run(full) if r["kind"] == "val"}
    assert val[8] == pytest.approx(val_full[8], abs=1e-6)
    a = load_file(os.path.join(full, "step_000008", "model.safetensors"))
    b = load_file(os.path.join(resumed_dir, "step_000008", "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)

    # resume=auto in a directory whose newest complete checkpoint is step 4 (plus a torn temp dir)
    auto_dir = tmp_path / "auto"
    auto_dir.mkdir()
    shutil.copytree(os.path.join(full, "step_000004"), auto_dir / "step_000004")
    (auto_dir / "latest").write_text("step_000004\n")
    (auto_dir / ".tmp-step_000008-123").mkdir()
    (auto_dir / ".tmp-step_000008-123" / "model.safetensors").write_bytes(b"torn")
    shutil.copy(os.path.join(full, "metrics.jsonl"), auto_dir / "metrics.jsonl")
    auto = _train(cfg_file, str(auto_dir), "--resume", "auto")
    starts = [r for r in auto if r["kind"] == "run"]
    assert len(starts) == 2, "a resumed run appends to the existing metrics file"
    assert starts[-1]["start_step"] == 4
    assert starts[-1]["resumed_from"] == str(auto_dir / "step_000004")
    after_resume = _losses(auto[auto.index(starts[-1]):])
    assert after_resume == pytest.approx({s: uninterrupted[s] for s in (5, 6, 7, 8)}, abs=1e-6)


def _read_run(run_dir: str) -> list[dict]:
    from moeplug.training.metrics import read_metrics
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def test_unreadable_metadata_is_reported(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, _Tied(), None)
    msg = str(err.value)
    assert "meta.json" in msg and "unreadable" in msg and "Fix:" in msg


def test_optimizer_state_that_does_not_fit_is_reported(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})
    other = _Tied()
    # Two parameter groups instead of one: the saved optimizer layout no longer fits.
    params = list(other.parameters())
    opt2 = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, other, opt2)
    msg = str(err.value)
    assert "optimizer state does not fit" in msg and "Fix:" in msg


def test_shape_mismatch_is_a_checkpoint_error_not_a_traceback(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})

    class Wider(_Tied):
        def __init__(self):
            super().__init__()
            self.mid = nn.Linear(6, 6, bias=False)
            self.mid.weight = nn.Parameter(torch.zeros(7, 6))
    with pytest.raises(CheckpointError, match=r"does not match the model's shapes: size "
                                              r"mismatch for mid.weight.*Fix: resume with the same"):
        load_checkpoint(path, Wider(), None, restore_rng=False)


# --------------------------------------------------------------------------------------------
# Damaged checkpoints and mismatched resumes through the real CLI: exit 2, one paragraph naming
# the file, the field and the fix, no traceback
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run4(tiny_corpus, tmp_path_factory):
    """(config file, run directory): the tiny model trained in-process to its step-4 checkpoint.
    Tests copy the directory before damaging it."""
    import yaml
    from conftest import tiny_config_dict

    from moeplug.cli import main
    d = tmp_path_factory.mktemp("run4")
    cache = str(tmp_path_factory.getbasetemp() / "moeplug_cache")
    cfg_file = d / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config_dict(tiny_corpus, str(d / "run"), cache)))
    assert main(["train", "--config", str(cfg_file), "--steps", "4",
                 "--set", "train.warmup_steps=1"]) == 0
    return str(cfg_file), str(d / "run")


def _copy_run(run4, tmp_path) -> str:
    import shutil
    dst = str(tmp_path / "run")
    shutil.copytree(run4[1], dst)
    return dst


def _resume(run_cli, run4, run: str, *extra: str, steps: str = "6"):
    return run_cli("train", "--config", run4[0], "--out", run, "--resume", run, "--steps", steps,
                   "--set", "train.warmup_steps=1", *extra)


def _assert_exit_2(proc, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("moeplug: configuration error:") == 1, proc.stderr[-3000:]
    for fragment in fragments + ("Fix:",):
        assert fragment in proc.stderr, (fragment, proc.stderr[-3000:])


def test_resume_refuses_flipped_bytes_in_the_weights(run4, tmp_path, run_cli):
    run = _copy_run(run4, tmp_path)
    weights = os.path.join(run, "step_000004", "model.safetensors")
    data = bytearray(open(weights, "rb").read())
    mid = len(data) // 2  # tensor data: the header is a few kB at the start
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    open(weights, "wb").write(bytes(data))
    _assert_exit_2(_resume(run_cli, run4, run), f"checkpoint file '{weights}' is damaged",
                   "its SHA-256 is", "recorded", "resume from another checkpoint")


def _flip_betas(meta):
    meta["optimizer"]["param_groups"][0]["betas"] = "ab"


@pytest.mark.parametrize("damage, fragments", [
    (b"\x89PNG\r\n\x1a\n\x00\xff", ["is unreadable", "utf-8"]),
    (b"[1, 2]", ["field '(top level)' = [1, 2] is a JSON list"]),
    (lambda m: m.update(step="two"), ["field 'step' = 'two' must be an integer >= 0"]),
    (lambda m: m.update(rng="garbage"), ["field 'rng' = 'garbage' must be an object"]),
    (lambda m: m["rng"].update(torch=[1, 2, 3]), ["field 'rng.torch' = [1, 2, 3] is not a "
                                                  "torch RNG state", "size 5056"]),
    (lambda m: m["rng"].update(numpy=["MT19937", [-1], 0, 0, 0.0]),
     ["field 'rng.numpy'", "integers in [0, 4294967296)"]),
    (lambda m: m["metrics"].update(tokens_seen="many"),
     ["field 'metrics.tokens_seen' = 'many' must be an integer >= 0"]),
    (_flip_betas, ["field 'optimizer.param_groups[0].betas' = 'ab' is not the kind of value "
                   "this optimizer holds there"]),
    (lambda m: m["config"]["model"].update(hidden_size=-1),
     ["field 'config' is not a valid moeplug config (ModelConfig.hidden_size = -1",
      "start a new run"]),
], ids=["binary", "list", "step", "rng", "rng.torch", "rng.numpy", "metrics", "betas", "config"])
def test_resume_refuses_a_damaged_meta_json_naming_the_field(run4, tmp_path, run_cli, damage,
                                                             fragments):
    run = _copy_run(run4, tmp_path)
    meta_path = os.path.join(run, "step_000004", "meta.json")
    if isinstance(damage, bytes):
        open(meta_path, "wb").write(damage)
    else:
        _edit_meta(os.path.dirname(meta_path), damage)
    _assert_exit_2(_resume(run_cli, run4, run), meta_path, *fragments)


def test_resume_refuses_a_binary_latest_pointer(run4, tmp_path, run_cli):
    run = _copy_run(run4, tmp_path)
    with open(os.path.join(run, "latest"), "wb") as f:
        f.write(b"\x00\x9f\x92\x96 step")
    _assert_exit_2(_resume(run_cli, run4, run), f"'{run}/latest' should hold the name of the "
                   "newest checkpoint directory", "write the right step_* name into it, or "
                   "delete it")


@pytest.mark.parametrize("extra, fragments", [
    (["--set", "model.moe.top_k=1"], ["model.moe.top_k: checkpoint 2, requested 1"]),
    (["--set", "model.moe.num_experts=8", "--set", "model.hidden_size=64"],
     ["model.hidden_size: checkpoint 32, requested 64",
      "model.moe.num_experts: checkpoint 4, requested 8"]),
    (["--set", "plugins.router_options.score_function=sigmoid"],
     ["plugins.router_options.score_function: checkpoint 'softmax', requested 'sigmoid'"]),
    # Refused by the launching process: once, before any rank or process group exists.
    (["--nproc", "2", "--set", "parallel.ep=2", "--set", "model.moe.activation=gelu"],
     ["model.moe.activation: checkpoint 'swiglu', requested 'gelu'"]),
], ids=["top_k", "shapes", "router_options", "nproc2"])
def test_resume_with_another_model_names_each_differing_field(run4, tmp_path, run_cli, extra,
                                                               fragments):
    run = _copy_run(run4, tmp_path)
    proc = _resume(run_cli, run4, run, *extra)
    _assert_exit_2(proc, "holds a different model than the one requested (from --config "
                   f"{run4[0]}", *fragments, "start a new run in another --out")
    assert "load_state_dict" not in proc.stderr and "rank" not in proc.stderr.lower()


def test_resume_accepts_the_same_model_written_otherwise(run4, tmp_path, run_cli):
    """Router options are compared as the router reads them: one written out at its default,
    or one that changes only how it runs (``fused``, the same math), is the same model. Both
    were refused as differences (found by a cross-layout resume sweep)."""
    run = _copy_run(run4, tmp_path)
    proc = _resume(run_cli, run4, run, "--set", "plugins.router_options.dtype=fp32",
                   "--set", "plugins.router_options.fused=false")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_model_differences_compare_what_the_fields_mean():
    from moeplug.config import config_from_dict, model_differences
    from moeplug.plugin_host import PluginHost
    host = PluginHost.load()

    def diff(a: dict, b: dict, **kw):
        return [k for k, _, _ in model_differences(config_from_dict(a), config_from_dict(b),
                                                   lambda n, o: host.defining_options(
                                                       "router", n, o), **kw)]
    all_moe = {"first_k_dense": 0, "dense_ffn_hidden_size": 64}
    assert diff({"model": all_moe}, {"model": {"first_k_dense": 0}}) == []  # no dense layer
    assert diff({"model": {"dense_ffn_hidden_size": 64}}, {"model": {}}) == \
        ["model.dense_ffn_hidden_size"]  # the first layer is dense: it is used
    assert diff({"model": {"vocab_size": 2048}}, {"model": {"vocab_size": 0}}) == []
    assert diff({"model": {"vocab_size": 2048}}, {"model": {"vocab_size": 512}}) == \
        ["model.vocab_size"]
    assert diff({"plugins": {"router_options": {"dtype": "fp32", "fused_cuda": True}}},
                {}) == []
    assert diff({"plugins": {"router_options": {"dtype": "fp64"}}}, {}) == \
        ["plugins.router_options.dtype"]
    # an option the router rejects: both sides as written, the one difference named
    assert diff({"plugins": {"router_options": {"nope": 1}}}, {}) == \
        ["plugins.router_options.nope"]
    tok = {"data": {"tokenizer": "bytes"}}
    assert diff({}, tok) == ["data.tokenizer"]
    assert diff({}, tok, ignore=("data.tokenizer", "data.vocab_size")) == []


def test_resume_may_turn_recompute_and_offloading_on(run4, tmp_path, run_cli):
    """Memory levers change how the model runs, not what it computes: once refused as a
    different model, they now resume the run, bitwise as without them."""
    losses = []
    for name, extra in (("plain", ()), ("levers", (
            "--set", "model.recompute={granularity: selective, modules: [moe_act, core_attn]}",
            "--set", "model.offload=[expert_fc1, mlp_norm]"))):
        run = _copy_run(run4, tmp_path / name)
        proc = _resume(run_cli, run4, run, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append({s: v for s, v in _losses(_read_run(run)).items() if s > 4})
    assert sorted(losses[0]) == [5, 6] and losses[0] == losses[1]


def test_resume_under_another_layout_is_refused_once_before_launching(run4, tmp_path, run_cli):
    # A checkpoint written before the shard manifests (no reshard_version) cannot go to PP.
    run = _copy_run(run4, tmp_path)
    _edit_meta(os.path.join(run, "step_000004"), lambda m: m.pop("reshard_version"))
    proc = _resume(run_cli, run4, run, "--nproc", "2", "--set", "parallel.pp=2")
    _assert_exit_2(proc, "was written with parallel layout single-process", "'pp': 2",
                   "predates the shard manifests", "only between layouts with cp = pp = etp = 1",
                   "resume with the same parallel settings")


@pytest.mark.parametrize("steps", ["3", "4"])
def test_resume_with_nothing_left_to_train_exits_2(run4, tmp_path, run_cli, steps):
    run = _copy_run(run4, tmp_path)
    metrics = open(os.path.join(run, "metrics.jsonl")).read()
    proc = _resume(run_cli, run4, run, steps=steps)
    _assert_exit_2(proc, f"TrainConfig.steps = {steps}", "is already at step 4",
                   "train.steps is the run's total", "pass --steps N with N > 4")
    assert open(os.path.join(run, "metrics.jsonl")).read() == metrics  # no val record written


def test_older_checkpoint_without_checksums_or_config_resumes_with_notices(run4, tmp_path,
                                                                         run_cli):
    run = _copy_run(run4, tmp_path)
    step4 = os.path.join(run, "step_000004")
    _edit_meta(step4, lambda m: (m.pop("files"), m.pop("config")))
    proc = _resume(run_cli, run4, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint '{step4}' predates per-file checksums" in proc.stderr
    assert f"checkpoint '{step4}' stores no config in meta.json; resuming with the model " \
           f"from --config {run4[0]}" in proc.stderr
    with open(os.path.join(run, "step_000006", "meta.json")) as f:
        files = json.load(f)["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.safetensors"]
    assert files["model.safetensors"]["sha256"] == ck.file_sha256(
        os.path.join(run, "step_000006", "model.safetensors"))


def _sharded_rank(rank: int, world: int, out_dir: str, save: bool) -> str:
    # EP2 over 2 ranks: each rank's shard differs. save=True writes step 1; save=False loads it.
    from moeplug.config import config_from_dict
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from moeplug.training.distributed import build_rank_model, layout_manifest
    from moeplug.training.trainer import build_rank_optimizer

    cfg = config_from_dict({"model": {"hidden_size": 16, "num_layers": 2, "num_heads": 2,
                                      "num_kv_heads": 2, "max_seq_len": 16,
                                      "dense_ffn_hidden_size": 16,
                                      "moe": {"num_experts": 4, "ffn_hidden_size": 8}},
                            "train": {"seq_len": 8}, "parallel": {"ep": 2}})
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    torch.manual_seed(0)
    model = build_rank_model(cfg, PluginHost.load(), 32, groups)
    opt = build_rank_optimizer(model, cfg, groups)
    if save:
        save_sharded_checkpoint(out_dir, 1, model, opt, {"metrics": {}}, groups,
                                layout_manifest(cfg, groups))
        return "saved"
    try:
        load_sharded_checkpoint(os.path.join(out_dir, "step_000001"), model, opt, groups,
                                layout_manifest(cfg, groups))
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_sharded_checkpoint_records_every_rank_file_and_refuses_a_damaged_shard(tmp_path):
    from moeplug.testing.distributed import run_distributed
    assert run_distributed(_sharded_rank, 2, str(tmp_path), True) == ["saved", "saved"]
    step = tmp_path / "step_000001"
    files = json.loads((step / "meta.json").read_text())["files"]
    assert sorted(files) == sorted(p for p in os.listdir(step) if p != "meta.json")
    for name, record in files.items():
        assert record == {"sha256": ck.file_sha256(str(step / name)),
                          "bytes": os.path.getsize(step / name)}, name
    damaged = step / "model_rank1.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])  # the last tensor's last bytes
    damaged.write_bytes(bytes(data))
    ok, refused = run_distributed(_sharded_rank, 2, str(tmp_path), False)
    assert ok == "loaded"  # rank 0's own files are intact
    assert f"checkpoint file '{damaged}' is damaged" in refused and "Fix:" in refused


def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(tiny_config_file,
                                                                       cli_env, tmp_path):
    """A full disk mid-run (here a real one: the process's file-size limit, so every write past
    it fails with EFBIG) ended in a safetensors traceback and left the failed save's temporary
    directory holding its space (a fault sweep). Now: one line naming the directory, the error
    and the last complete checkpoint, no temporary directory left, and `latest` untouched."""
    import resource
    import subprocess
    import sys
    out = str(tmp_path / "run")
    cfg = tiny_config_file(out)
    args = [sys.executable, "-m", "moeplug", "train", "--config", cfg, "--steps", "2",
            "--set", "train.ckpt_interval=1"]
    ok = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]  # the corpus cache exists; step 1, 2 saved
    size = os.path.getsize(os.path.join(out, "step_000001", "model.safetensors"))

    def small_files():  # writes beyond half a model file fail (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
    proc = subprocess.run(args[:7] + ["4", "--resume", "auto", "--set", "train.ckpt_interval=1"],
                          env=cli_env, capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"could not write the step-3 checkpoint in train.out_dir = {out!r} (" in
            proc.stderr and "File too large" in proc.stderr and
            "its last complete checkpoint is " in proc.stderr and
            "step_000002" in proc.stderr and "run again with --resume auto" in proc.stderr), \
        proc.stderr[-3000:]
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]
    with open(os.path.join(out, "latest")) as f:
        assert f.read().strip() == "step_000002"
