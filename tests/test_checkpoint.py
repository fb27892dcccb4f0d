"""Checkpoints: exact round trip, exact resume, atomic writes, and no unpickling ever."""

from __future__ import annotations

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

    # Crash in the middle of the next save: after the tensors, before meta.json is written.
    def crash(*_a, **_k):
        raise KeyboardInterrupt("power cut")
    monkeypatch.setattr(ck, "_write_json", crash)
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
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, _Tied(), None, restore_rng=False)
    msg = str(err.value)
    assert "model.safetensors" in msg and "not a valid safetensors file" in msg
    assert "never unpickles" in msg and "Fix:" in msg
    assert not marker.exists()


def test_loading_a_torch_save_directory_is_refused(tmp_path):
    model, _ = _trained()
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save(model.state_dict(), d / "model.pt")
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(d), str(tmp_path))
    assert "no checkpoint there" in str(err.value)
    (d / "meta.json").write_text('{"format": "moeplug-checkpoint-v1"}')
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
