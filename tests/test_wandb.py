"""Weights & Biases as a metrics writer (``train.wandb``), offline: no network, no account.

The runs are read back from the files wandb itself wrote (``<out_dir>/wandb/offline-run-*/
run-*.wandb``: wandb's transaction log, LevelDB-log framed protobuf ``Record``s of its own
``wandb_internal.proto``), not from anything moeplug keeps:

* every train and val record's scalars, at their steps, are what metrics.jsonl holds, under the
  TensorBoard writer's tags; the expert-load heat map at each validation; the config;
* the CLI's ``--wandb``, and a resume: a second W&B run whose steps continue after the checkpoint
  and whose config names it;
* without the package: one line naming the extra, before any work.

Hermetic: WANDB_MODE=offline and wandb's cache, config and data directories under tmp_path.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

pytest.importorskip("wandb", reason="the wandb package is not installed (the test extra pins it)")

from moeplug.observability.tensorboard import record_scalars  # noqa: E402


def _wandb_env(tmp_path) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
            "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
            "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}


def _records(path: str) -> list[bytes]:
    """The payloads of a .wandb file: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc32 4, length 2 LE, type 1: full, first,
    middle, last); a block's tail under 7 bytes is padding."""
    data, block = open(path, "rb").read(), 32768
    assert data[:4] == b":W&B", path
    pos, parts, out = 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # zero fill up to the block's end
            pos += room
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            out.append(parts)
    return out


def read_runs(out_dir: str) -> list[dict]:
    """Every offline W&B run under ``out_dir``, oldest first: {"config", "history"}."""
    from wandb.proto import wandb_internal_pb2 as pb
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run = {"config": {}, "history": [], "path": path}
        for payload in _records(path):
            rec = pb.Record()
            rec.ParseFromString(payload)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in rec.history.item})
            elif kind == "run":
                run["config"].update({i.key: json.loads(i.value_json)
                                      for i in rec.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json)
                                      for i in rec.config.update})
        runs.append(run)
    return runs


def _metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return list(map(json.loads, f))


def _config_value(value):
    return value.get("value", value) if isinstance(value, dict) else value


def test_offline_run_holds_every_logged_value(tiny_cfg, tmp_path, monkeypatch):
    from moeplug.cli import check_plugins
    from moeplug.data import prepare_corpus
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import seed_everything, train
    for k, v in _wandb_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    host = PluginHost.load()
    out_dir = str(tmp_path / "run")
    cfg = tiny_cfg("train.steps=3", "train.warmup_steps=0", "train.log_interval=1",
                   "train.eval_batches=1", "train.eval_interval=2", "train.wandb=true",
                   "train.wandb_name=tiny", "plugins.router_options={z_loss_coeff: 0.01}",
                   out_dir=out_dir)
    corpus = prepare_corpus(cfg.data)
    seed_everything(cfg.train.seed)
    train(cfg, build_model(cfg, host, corpus.vocab_size), corpus, check_plugins(host, cfg), {},
          log=lambda _: None, use_bar=False)
    (run,) = read_runs(out_dir)
    records = [r for r in _metrics(out_dir) if r["kind"] in ("train", "val")]
    by_step: dict[int, dict] = {}
    for row in run["history"]:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [0, 1, 2, 3]  # step 0: the validation before training
    checked = 0
    for record in records:
        want = record_scalars(record)
        assert {"loss/train", "loss/lm", "train/lr", "perf/mfu", "loss/z",
                "moe/dropped_fraction/layer_0"} <= set(want) or record["kind"] == "val"
        for tag, value in want.items():
            assert by_step[record["step"]][tag] == pytest.approx(value, rel=1e-12, abs=1e-15), tag
            checked += 1
    assert checked > 3 * 20
    # the heat map at each validation (steps 2 and 3), as an image file of the run
    # (an image's fields are logged as nested keys: moe/expert_load/{_type,width,path,...})
    for step in (2, 3):
        row = by_step[step]
        assert row["moe/expert_load/_type"] == "image-file", row
        assert row["moe/expert_load/width"] >= 900
        png = os.path.join(os.path.dirname(run["path"]), "files", row["moe/expert_load/path"])
        assert os.path.getsize(png) == row["moe/expert_load/size"]
    assert "moe/expert_load/_type" not in by_step[1]
    assert _config_value(run["config"]["model"])["hidden_size"] == 32
    assert _config_value(run["config"]["moeplug"]) == {"start_step": 0, "resumed_from": None}


def test_cli_wandb_and_a_resume_start_a_second_run_after_the_checkpoint(run_cli, cli_env,
                                                                       tiny_config_file,
                                                                       tmp_path):
    env = {**cli_env, **_wandb_env(tmp_path)}
    out = str(tmp_path / "run")
    cfg = tiny_config_file(out)
    common = ["--config", cfg, "--wandb", "--set", "train.log_interval=1",
              "--set", "train.eval_interval=0", "--set", "train.ckpt_interval=2"]
    first = run_cli("train", *common, "--steps", "2", env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("train", *common, "--steps", "3", "--resume", "auto", env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    runs = read_runs(out)
    assert len(runs) == 2
    steps = [sorted({row["_step"] for row in r["history"]}) for r in runs]
    assert steps == [[0, 1, 2], [3]]  # (a resume scores no step 0)
    meta = _config_value(runs[1]["config"]["moeplug"])
    assert meta["start_step"] == 2 and meta["resumed_from"].endswith("step_000002")
    logged = {row["_step"]: row for r in runs for row in r["history"] if "loss/lm" in row}
    for record in _metrics(out):
        if record["kind"] == "train":
            assert logged[record["step"]]["loss/lm"] == pytest.approx(record["lm_loss"], rel=1e-12)


_WITHOUT = ("import sys; sys.modules[{name!r}] = None; from moeplug.cli import main; "
            "sys.exit(main(sys.argv[1:]))")


def test_missing_wandb_names_the_extra_before_any_work(tiny_config_file, cli_env, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _WITHOUT.format(name="wandb"), "train",
                           "--config", tiny_config_file(str(out)), "--wandb"],
                          capture_output=True, text=True, timeout=120, env=cli_env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "moeplug: configuration error: train.wandb = True needs the wandb and matplotlib "
        "packages"), proc.stderr
    assert 'Fix: pip install "moeplug[wandb]"' in lines[0]
    assert not out.exists()


def test_wandb_mode_is_checked():
    from moeplug.config import ConfigError, TrainConfig
    with pytest.raises(ConfigError) as err:
        TrainConfig(wandb=True, wandb_mode="offlien")
    assert str(err.value).startswith("TrainConfig.wandb_mode = 'offlien': is not a W&B mode")
    assert "Fix: use offline (no network)" in str(err.value)
