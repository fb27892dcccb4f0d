"""Resharding the layouts that split the model along pipeline stages, the sequence or each
expert's FFN, and the distributed optimizer's shards of split models: through the real CLI on
real gloo ranks, a checkpoint saved under one layout resumes under another and trains the
losses of the run that never changed layout (fp32 tolerance 1e-4: reduction orders differ).

Global batch: a layout with DP data-parallel replicas and grad_accum_steps A draws DP * A
micro-batches per step, so each continuation sets A to keep DP * A equal to the reference's.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow

COMMON = ["--set", "train.log_interval=1", "--set", "train.warmup_steps=2",
          "--set", "train.eval_interval=100", "--set", "train.ckpt_interval=3"]
TOL = 1e-4


def _losses(out: str) -> dict[int, float]:
    from moeplug.training.metrics import read_metrics
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _train(run_cli, cfg: str, out: str, *extra: str) -> dict[int, float]:
    # every run has the same train.steps: the LR schedule's decay depends on it
    proc = run_cli("train", "--config", cfg, "--out", out, "--steps", "8", *COMMON, *extra,
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(out)


def _layout(nproc: int, accum: int, **degrees) -> list[str]:
    args = ["--nproc", str(nproc)] if nproc > 1 else []
    args += ["--set", f"train.grad_accum_steps={accum}"]
    for k, v in degrees.items():
        args += ["--set", f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return args


def _close(got: dict, want: dict, steps) -> None:
    assert sorted(got) == list(steps)
    gap = max(abs(got[s] - want[s]) for s in steps)
    assert gap < TOL, (gap, got, want)


def _chain(run_cli, cfg: str, tmp_path, reference: list[str], *continuations: list[str]):
    """Train ``reference`` for 8 steps; then each continuation resumes the previous run's
    checkpoint (steps 3, 6) and must log the reference's losses from there on. Returns the
    run directories (reference first)."""
    out = str(tmp_path / "reference")
    want = _train(run_cli, cfg, out, *reference)
    assert sorted(want) == list(range(1, 9))
    runs = [out]
    for i, layout in enumerate(continuations):
        start = 3 * (i + 1)
        here = str(tmp_path / f"continued{i}")
        _close(_train(run_cli, cfg, here, *layout, "--resume",
                      os.path.join(runs[-1], f"step_{start:06d}")), want, range(start + 1, 9))
        runs.append(here)
    return runs


def _buffers(run: str, suffix: str) -> dict:
    """{one-process name: tensor} of the buffers ending in ``suffix`` in a run's step-8 files."""
    from safetensors.torch import load_file
    step = os.path.join(run, "step_000008")
    with open(os.path.join(step, "meta.json")) as f:
        pipeline = (json.load(f).get("parallel") or {}).get("pp", 1) > 1  # "<chunk>." keys
    out = {}
    for f in sorted(os.listdir(step)):
        if f.startswith("model"):
            for k, t in load_file(os.path.join(step, f)).items():
                if k.endswith(suffix):
                    out.setdefault(k.split(".", 1)[1] if pipeline else k, t)
    return out


def test_pp2_reshards_to_one_process_and_back(run_cli, tiny_config_file, tmp_path):
    # PP2 on 2 ranks: DP 1. Each stage's file holds its own layers under the one-process names.
    _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
           _layout(2, 1, pp=2), _layout(1, 1), _layout(2, 1, pp=2))


# Megatron layout strings over the tiny model's 2 layers: PP2 x VPP2 with an embedding-only
# first and a loss-only last stage (rank 0: E, then layer 1; rank 1: layer 0, then L), and
# PP4 with a stage that holds nothing (rank 1) and a loss-only last stage (rank 3). The files
# hold each chunk's pieces under the one-process names, whatever the chunk holds.
PP2_VPP2_LAYOUT = _layout(2, 2, pp=2, pipeline_layout="E|t|t|L")
PP4_LAYOUT = _layout(4, 2, pp=4, pipeline_layout="Et||t|L")


def test_pipeline_layouts_reshard_to_one_process_and_back(run_cli, tiny_config_file, tmp_path):
    _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
           PP2_VPP2_LAYOUT, _layout(1, 2), PP4_LAYOUT)


def test_pipeline_layouts_reshard_into_each_other_and_an_even_split(run_cli, tiny_config_file,
                                                                    tmp_path):
    _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
           PP4_LAYOUT, PP2_VPP2_LAYOUT, _layout(2, 2, pp=2))


def test_cp2_reshards_to_one_process_and_back(run_cli, tiny_config_file, tmp_path):
    # CP changes no weight: every CP rank saved the whole model and its own optimizer state.
    _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
           _layout(2, 1, cp=2), _layout(1, 1), _layout(2, 1, cp=2))


def test_mla_split_over_tp2_reshards_to_one_process_and_back(run_cli, tiny_config_file,
                                                            tmp_path):
    # MLA's heads split over TP2 (q_b_proj / kv_b_proj by rows, o_proj by columns; the down
    # projections and latent norms whole on both ranks), with SP, then without it.
    mla = ["--set", "model.attention=mla"]
    _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
           _layout(2, 2, tp=2, sequence_parallel=True) + mla, _layout(1, 2) + mla,
           _layout(2, 2, tp=2) + mla)


def test_etp2_with_the_distributed_optimizer_reshards_to_one_process_and_back(
        run_cli, tiny_config_file, tmp_path):
    # ETP2 on 2 ranks: each expert's F split in two (gate and up rows halved separately), dense
    # grid DP 2; ZeRO-1 shards the dense buckets over DP 2.
    zero1 = {"distributed_optimizer": True}
    _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
           _layout(2, 1, etp=2, **zero1), _layout(1, 2), _layout(2, 1, etp=2, **zero1))


def test_ep2_and_tp2_with_the_distributed_optimizer_reshard_into_each_other_and_pp2(
        run_cli, tiny_config_file, tmp_path):
    # EP2 + ZeRO-1 (dense DP 2) -> TP2 + ZeRO-1 (DP 1, two micro-batches) -> PP2: the
    # optimizer's bucket slices of split models, never through one process.
    # The router's aux-loss-free expert bias (a buffer, updated every step) carries over too.
    zero1 = {"distributed_optimizer": True}
    bias = ["--set", "plugins.router_options.score_function=sigmoid",
            "--set", "plugins.router_options.enable_expert_bias=true"]
    runs = _chain(run_cli, tiny_config_file(str(tmp_path / "unused")), tmp_path,
                  _layout(2, 1, ep=2, **zero1) + bias, _layout(2, 2, tp=2, **zero1) + bias,
                  _layout(2, 2, pp=2) + bias)
    want, got = _buffers(runs[0], "expert_bias"), _buffers(runs[-1], "expert_bias")
    assert want and sorted(got) == sorted(want)
    assert all(float(t.abs().max()) > 0 for t in want.values())  # the bias has moved
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < TOL


def test_fsdp_layouts_reshard_to_one_process_zero1_and_back(run_cli, tiny_config_file,
                                                            tmp_path):
    # FSDP saves its shards whole (the files of the same layout without FSDP), so FSDP DP2 ->
    # one process -> FSDP DP2 x EP2 -> ZeRO-1 EP2 -> FSDP DP2 each resume the others'
    # checkpoints (steps 3, 6 of one chain, then a second chain for the other pairs).
    fsdp = {"fsdp": True}
    cfg = tiny_config_file(str(tmp_path / "unused"))
    _chain(run_cli, cfg, tmp_path / "a", _layout(2, 1, **fsdp), _layout(1, 2),
           _layout(2, 1, ep=2, **fsdp))
    _chain(run_cli, cfg, tmp_path / "b", _layout(2, 1, ep=2, distributed_optimizer=True),
           _layout(2, 1, ep=2, **fsdp), _layout(2, 1, **fsdp))
