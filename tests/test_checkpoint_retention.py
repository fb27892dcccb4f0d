"""Keep-last-N retention (train.keep_last) and clean-up of saves a crash interrupted."""

from __future__ import annotations

import os

import pytest
import torch

from moeplug.config import ConfigError
from moeplug.training.checkpoint import find_latest, load_checkpoint, save_checkpoint


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _steps(out_dir) -> list[str]:
    return sorted(d for d in os.listdir(out_dir) if d.startswith("step_"))


def test_keep_last_deletes_older_checkpoints_after_latest_moved(tmp_path):
    model, opt = _model_and_optimizer()
    (tmp_path / ".tmp-step_000002-999999").mkdir()  # a save killed midway by another process
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(str(tmp_path), step, model, opt, {}, keep_last=2)
    assert _steps(tmp_path) == ["step_000004", "step_000005"]
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".tmp-")]
    assert find_latest(str(tmp_path)) == str(tmp_path / "step_000005")
    load_checkpoint(str(tmp_path / "step_000004"), *_model_and_optimizer())  # kept ones load


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    model, opt = _model_and_optimizer()
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, model, opt, {})
    assert _steps(tmp_path) == ["step_000001", "step_000002", "step_000003"]


def test_keep_last_never_deletes_the_checkpoint_just_saved(tmp_path):
    # A run resumed from step 2 saves step 3 while a later step 9 of the old run still exists:
    # the numerically newest is not `latest`, and `latest` must survive.
    model, opt = _model_and_optimizer()
    for step in (2, 9):
        save_checkpoint(str(tmp_path), step, model, opt, {})
    save_checkpoint(str(tmp_path), 3, model, opt, {}, keep_last=1)
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    assert _steps(tmp_path) == ["step_000003", "step_000009"]


def test_keep_last_must_not_be_negative(tiny_cfg):
    with pytest.raises(ConfigError, match="keep_last"):
        tiny_cfg("train.keep_last=-1")


def test_cli_run_keeps_only_the_newest_checkpoints(tiny_config_file, tmp_path, monkeypatch):
    from moeplug.cli import main
    monkeypatch.setenv("MOEPLUG_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    rc = main(["train", "--config", tiny_config_file(), "--out", str(out), "--steps", "8",
               "--set", "train.ckpt_interval=2", "--set", "train.keep_last=2"])
    assert rc == 0
    assert _steps(out) == ["step_000006", "step_000008"]
    assert (out / "latest").read_text().strip() == "step_000008"
