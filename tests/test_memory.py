"""Memory: the permuted copy is never kept weighted, unpermute keeps no rows, and the train
records carry each rank's measured memory (weights, grads, optimizer state, activations, RSS).
"""

from __future__ import annotations

import os

import torch

from moeplug.modules import MoELayer
from moeplug.training.memory import ActivationMeter
from moeplug.training.metrics import read_metrics

from test_recompute import model_for


def _saved_during(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_permuted_rows_are_kept_unweighted_and_unpermute_keeps_no_rows():
    """Memory-efficient permutation (Megatron --moe-permute-fusion / weighted activation): the
    routing weight multiplies the activation inside the experts, so the one permuted copy kept
    for backward is the plain x_SD, never p * x_SD, and combine keeps no [S, D] rows."""
    model = model_for(None)
    layer = next(b.ffn for b in model.blocks if isinstance(b.ffn, MoELayer))
    x_TD = torch.randn(32, 32, requires_grad=True)
    with torch.no_grad():  # the same dispatch, to know the permuted rows and their weights
        d = layer.dispatcher.dispatch(x_TD, layer.router_and_preprocess(x_TD, 1))
        y_SD = layer.experts(d.x_SD, d.probs_S, d.counts_L)
    saved = _saved_during(lambda: layer(x_TD))
    rows = [t for t in saved if t.shape == d.x_SD.shape]
    assert any(torch.equal(t, d.x_SD) for t in rows)  # the experts keep the permuted input
    weighted = d.x_SD * d.probs_S.unsqueeze(-1)
    assert not any(torch.allclose(t, weighted) for t in rows)
    assert not any(torch.allclose(t, y_SD) for t in rows)  # the experts' output is not kept


def test_meter_counts_storage_once_and_frees_after_backward():
    model = model_for(None)
    meter = ActivationMeter(model)
    x = torch.randn(64, 64, requires_grad=True)
    with meter.active():
        # Each exp saves its output, and mul saves both again: two storages, each counted once.
        y = (x.exp() * x.exp()).sum()
        held = meter.current
        y.backward()
    assert held == 2 * 64 * 64 * 4
    assert meter.current == 0 and meter.peak == held


def test_train_records_carry_each_ranks_measured_memory(run_cli, tiny_config_file, tmp_path):
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(out), "--steps", "5",
                   "--set", "train.optimizer_dtype=bf16", "--set", "train.memory_stats=true",
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(read_metrics(os.path.join(out, "metrics.jsonl")))
    num_params = next(r for r in records if r["kind"] == "run")["num_params"]
    train = [r for r in records if r["kind"] == "train"]
    [mem] = train[-1]["memory"]  # one rank
    assert mem["weights"] == 4 * num_params  # fp32 parameters
    assert mem["grads"] == mem["weights"]
    assert mem["optimizer"] == 2 * 2 * num_params  # two bf16 moments per parameter
    assert 0 < mem["activations_peak"] < mem["rss_peak"]


def test_memory_record_without_memory_stats_has_no_meter(run_cli, tiny_config_file, tmp_path):
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(out), "--steps", "5", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(read_metrics(os.path.join(out, "metrics.jsonl")))
    num_params = next(r for r in records if r["kind"] == "run")["num_params"]
    [mem] = [r for r in records if r["kind"] == "train"][-1]["memory"]
    assert mem.keys() == {"weights", "grads", "optimizer", "rss_peak"}
    assert mem["optimizer"] == 2 * 4 * num_params  # two fp32 AdamW moments


def test_two_ranks_each_report_their_memory(run_cli, tiny_config_file, tmp_path):
    """EP2: each rank holds half the experts, so the two entries are each rank's own."""
    out = str(tmp_path / "run")
    proc = run_cli("train", "--config", tiny_config_file(out), "--steps", "2", "--nproc", "2",
                   "--set", "parallel.ep=2", "--set", "train.log_interval=1", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = list(read_metrics(os.path.join(out, "metrics.jsonl")))
    mems = [r for r in records if r["kind"] == "train"][-1]["memory"]
    assert len(mems) == 2 and all(m["weights"] > 0 and m["rss_peak"] > 0 for m in mems)


def test_unpermute_frees_the_expert_rows_and_weighting_adds_no_saved_copy():
    """Memory-efficient permutation, measured: (1) after the MoE layer's forward nothing keeps
    the experts' output rows y_SD [S, D] (combine keeps only row_map): the workspace hands the
    very same buffer out again; (2) the bytes held for backward do not grow when the routing
    weights are applied (weighted activation) compared with the same layer without weights,
    except the weights themselves: no weighted copy of any [S, .] tensor is kept."""
    from moeplug.runtime import workspace
    model = model_for(None)
    layer = next(b.ffn for b in model.blocks if isinstance(b.ffn, MoELayer))
    old_min = workspace.MIN_BYTES
    workspace.MIN_BYTES = 0  # the tiny test layer's buffers go through the cache too
    try:
        workspace.clear()
        seen = {}
        hook = layer.experts.register_forward_hook(
            lambda m, a, out: seen.update(ptr=out.data_ptr(), shape=tuple(out.shape),
                                          dtype=out.dtype))
        x_TD = torch.randn(32, 32, requires_grad=True)
        y = layer(x_TD)[0]
        hook.remove()
        with workspace.arena_scope(layer.workspace):  # the layer's model runtime's workspace
            again = workspace.empty(seen["shape"], seen["dtype"])
        assert again.data_ptr() == seen["ptr"]  # y_SD's buffer is free before backward
        y.sum().backward()
    finally:
        workspace.MIN_BYTES = old_min
        workspace.clear()

    def held(weighted: bool) -> int:
        x = torch.randn(32, 32, requires_grad=True)
        with torch.no_grad():
            d = layer.dispatcher.dispatch(x, layer.router_and_preprocess(x, 1))
        x_SD = d.x_SD.clone().requires_grad_()
        probs = d.probs_S.clone().requires_grad_() if weighted else None
        meter = ActivationMeter(model)
        with meter.active():
            layer.experts(x_SD, probs, d.counts_L).sum().backward()
        return meter.peak
    S = 32 * layer.router.top_k
    assert held(True) - held(False) == S * 4  # only the fp32 weights [S] themselves
