"""Resharding through the real CLI and real gloo ranks: a checkpoint of a data-parallel run with
the distributed optimizer (ZeRO-1 shards of flattened buckets) resumes in one process, and a
one-process checkpoint resumes under DP2 with plain AdamW; every continuation trains the
losses of the run that never changed layout (fp32 tolerance: reduction order differs)."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

COMMON = ["--set", "train.log_interval=1", "--set", "train.warmup_steps=2",
          "--set", "train.eval_interval=100", "--set", "train.ckpt_interval=3"]
DP2 = ["--nproc", "2"]
ONE_PROCESS_OF_DP2 = ["--set", "train.grad_accum_steps=2"]  # the same global batch


def _losses(out: str) -> dict[int, float]:
    from moeplug.training.metrics import read_metrics
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _train(run_cli, cfg: str, out: str, steps: int, *extra: str) -> dict[int, float]:
    # every run has the same train.steps: the LR schedule's decay depends on it
    proc = run_cli("train", "--config", cfg, "--out", out, "--steps", str(steps), *COMMON,
                   *extra, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(out)


def _close(got: dict, want: dict, steps) -> None:
    assert sorted(got) == list(steps)
    assert max(abs(got[s] - want[s]) for s in steps) < 1e-4, (got, want)


def test_dp2_distributed_optimizer_reshards_to_one_process_and_back(run_cli, tiny_config_file,
                                                                   tmp_path):
    cfg = tiny_config_file(str(tmp_path / "unused"))
    zero = str(tmp_path / "dp2_zero1")
    reference = _train(run_cli, cfg, zero, 8, *DP2,
                       "--set", "parallel.distributed_optimizer=true")

    # DP2 + ZeRO-1 -> one process: model from rank 0, AdamW moments reassembled from 2 shards
    one = str(tmp_path / "one")
    _close(_train(run_cli, cfg, one, 8, *ONE_PROCESS_OF_DP2,
                  "--resume", os.path.join(zero, "step_000003")), reference, range(4, 9))
    a = load_file(os.path.join(zero, "step_000006", "model_rank0.safetensors"))
    b = load_file(os.path.join(one, "step_000006", "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5

    # one process -> DP2 with plain AdamW on every replica
    dp2 = str(tmp_path / "dp2_plain")
    _close(_train(run_cli, cfg, dp2, 8, *DP2, "--resume", os.path.join(one, "step_000006")),
           reference, range(7, 9))



def test_ep2_reshards_to_one_process_and_back_to_ep2_with_the_distributed_optimizer(
        run_cli, tiny_config_file, tmp_path):
    # EP2 on 2 ranks is also DP2 of the dense grid: the same global batch as grad_accum 2.
    cfg = tiny_config_file(str(tmp_path / "unused"))
    ep2 = str(tmp_path / "ep2")
    reference = _train(run_cli, cfg, ep2, 8, *DP2, "--set", "parallel.ep=2")

    # EP2 -> one process: experts 0-1 from rank 0's files, 2-3 from rank 1's (weights, moments)
    one = str(tmp_path / "one")
    _close(_train(run_cli, cfg, one, 8, *ONE_PROCESS_OF_DP2,
                  "--resume", os.path.join(ep2, "step_000003")), reference, range(4, 9))

    # one process -> EP2 with ZeRO-1: each rank cuts its experts, then its bucket slices
    back = str(tmp_path / "ep2_zero1")
    _close(_train(run_cli, cfg, back, 8, *DP2, "--set", "parallel.ep=2",
                  "--set", "parallel.distributed_optimizer=true",
                  "--resume", os.path.join(one, "step_000006")), reference, range(7, 9))


def test_grouped_and_sequential_experts_resume_each_others_checkpoints(run_cli,
                                                                      tiny_config_file, tmp_path):
    # Both backends hold the same parameters (gate_up_proj [L, 2F, D], down_proj [L, D, F]):
    # the experts plugin may change on resume; only the kernels' summation order differs.
    cfg = tiny_config_file(str(tmp_path / "unused"))
    grouped = str(tmp_path / "grouped")
    reference = _train(run_cli, cfg, grouped, 8, "--set", "plugins.experts=grouped")
    sequential = str(tmp_path / "sequential")
    _close(_train(run_cli, cfg, sequential, 8, "--set", "plugins.experts=sequential",
                  "--resume", os.path.join(grouped, "step_000003")), reference, range(4, 9))
    back = str(tmp_path / "back")
    _close(_train(run_cli, cfg, back, 8, "--set", "plugins.experts=grouped",
                  "--resume", os.path.join(sequential, "step_000006")), reference, range(7, 9))


def test_tp2_reshards_to_one_process_and_back(run_cli, tiny_config_file, tmp_path):
    # TP2 on 2 ranks: DP 1, so the one-process run takes the same batch with no accumulation.
    cfg = tiny_config_file(str(tmp_path / "unused"))
    tp2 = str(tmp_path / "tp2")
    reference = _train(run_cli, cfg, tp2, 8, *DP2, "--set", "parallel.tp=2")
    # TP2 -> one process: column/row/vocab shards joined along the dims meta.json records
    one = str(tmp_path / "one")
    _close(_train(run_cli, cfg, one, 8, "--resume", os.path.join(tp2, "step_000003")),
           reference, range(4, 9))
    # one process -> TP2: each rank cuts its chunks of weights and moments
    back = str(tmp_path / "tp2_again")
    _close(_train(run_cli, cfg, back, 8, *DP2, "--set", "parallel.tp=2",
                  "--resume", os.path.join(one, "step_000006")), reference, range(7, 9))


def test_tp2_x_ep2_reshards_to_one_process(run_cli, tiny_config_file, tmp_path):
    # 4 ranks, TP2 x EP2 (DP 2 of the dense grid): TP shards and EP experts joined at once.
    cfg = tiny_config_file(str(tmp_path / "unused"))
    tp2ep2 = str(tmp_path / "tp2ep2")
    reference = _train(run_cli, cfg, tp2ep2, 8, "--nproc", "4", "--set", "parallel.tp=2",
                       "--set", "parallel.ep=2", "--set", "parallel.sequence_parallel=true")
    one = str(tmp_path / "one")
    _close(_train(run_cli, cfg, one, 8, *ONE_PROCESS_OF_DP2,
                  "--resume", os.path.join(tp2ep2, "step_000003")), reference, range(4, 9))


def test_a_checkpoint_without_optimizer_state_resumes_under_the_distributed_optimizer(
        run_cli, tiny_cfg, tmp_path):
    """A step-0 checkpoint with no optimizer state (what ``moeplug convert import`` writes)
    resumed under DP2 with the distributed optimizer: its master slices, cut when it was built
    from the fresh init, were never re-read from the loaded model, so the first step wrote the
    init plus an update back over the imported weights (losses from step 2 on those of a
    random model: a sweep found 7.64 against 7.46). Now every step equals one process's."""
    import torch
    import yaml

    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.checkpoint import save_checkpoint
    from moeplug.training.optim import build_optimizer, lr_at
    cfg_obj = tiny_cfg()
    torch.manual_seed(123)  # not the seed the runs below build their models from
    model = build_model(cfg_obj, PluginHost.load(), 256)
    ckpt = save_checkpoint(str(tmp_path / "imported"), 0, model,
                           build_optimizer(model, cfg_obj.train), {
                               "config": cfg_obj.to_dict(),
                               "plugins": {k: getattr(cfg_obj.plugins, k) for k in
                                           ("router", "dispatcher", "experts", "precision")},
                               "metrics": {"tokens_seen": 0, "train_seconds": 0.0},
                               "scheduler": {"step": 0, "lr": lr_at(0, cfg_obj.train)}})
    cfg = str(tmp_path / "cfg.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump(cfg_obj.to_dict(), f)
    one = _train(run_cli, cfg, str(tmp_path / "one"), 3, *ONE_PROCESS_OF_DP2, "--resume", ckpt)
    zero = _train(run_cli, cfg, str(tmp_path / "zero"), 3, *DP2, "--resume", ckpt,
                  "--set", "parallel.distributed_optimizer=true")
    _close(zero, one, range(1, 4))
