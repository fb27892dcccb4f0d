"""Per-layer MoE metrics (layer_stats), the per-stage time breakdown (timing), the plots
(heatmap, curves: matplotlib) and the TensorBoard mirror of a run.

Legend: T tokens, K top-k, E experts, D hidden, R logged steps, Y layer x expert rows.
References are computed by hand or with plain torch next to each check. Figures are checked as
objects (titles, labels, the drawn data); written images are decoded with Pillow (which
matplotlib installs); TensorBoard files are read back with TensorBoard's own reader.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from moeplug.config import ConfigError, ModelConfig, MoEConfig
from moeplug.interfaces import Router, RouterOutput
from moeplug.modules import MoELayer
from moeplug.observability import RunDirError, add_micro_batch, moe_metrics, plot_load
from moeplug.observability.layer_stats import load_stats
from moeplug.observability.timing import STAGES, add_times, measure_stages, stage
from moeplug.plugin_host import PluginHost

HOST = PluginHost.load()


# --------------------------------------------------------------------------------------------
# Load statistics, by hand
# --------------------------------------------------------------------------------------------

def test_load_stats_by_hand():
    # n = [6, 0, 2, 0]: mean 2, deviations (4, -2, 0, -2), variance 24 / 4 = 6.
    s = load_stats(torch.tensor([6, 0, 2, 0]))
    assert s["tokens_min"] == 0 and s["tokens_mean"] == 2 and s["tokens_max"] == 6
    assert s["max_violation"] == pytest.approx(6 / 2 - 1)
    assert s["cv"] == pytest.approx(math.sqrt(6) / 2)
    balanced = load_stats(torch.tensor([5, 5, 5]))
    assert balanced["max_violation"] == 0 and balanced["cv"] == 0
    collapsed = load_stats(torch.tensor([0, 0, 0, 0, 0, 0, 0, 40]))  # all on one expert
    assert collapsed["max_violation"] == pytest.approx(7.0)
    assert collapsed["cv"] == pytest.approx(math.sqrt(8 - 1))
    empty = load_stats(torch.tensor([0, 0]))  # nothing routed: nothing to balance
    assert empty["max_violation"] == 0 and empty["cv"] == 0 and empty["tokens_mean"] == 0


# --------------------------------------------------------------------------------------------
# Forced routing through a real MoE layer (real dispatcher and experts plugins)
# --------------------------------------------------------------------------------------------

class _ForcedRouter(Router):
    """Routes token t to the fixed ids_TK[t] and reports fixed losses (the routing is config,
    not per-call state)."""

    def __init__(self, ids_TK: torch.Tensor, losses: dict, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, ids_TK.shape[1]
        self.ids_TK, self.losses = ids_TK, losses

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        T, K = self.ids_TK.shape
        return RouterOutput(probs_TK=torch.full((T, K), 1.0 / K), ids_TK=self.ids_TK,
                            aux_loss=torch.zeros(()), losses=dict(self.losses))


def _forced_layer(ids_TK, losses, E=4, D=8) -> MoELayer:
    cfg = ModelConfig(hidden_size=D, num_heads=2, num_kv_heads=2,
                      moe=MoEConfig(num_experts=E, top_k=ids_TK.shape[1], ffn_hidden_size=8))
    d = HOST.create("dispatcher", "alltoall", {}, cfg, None)
    return MoELayer(_ForcedRouter(ids_TK, losses, E), d,
                    HOST.create("experts", "grouped", {}, cfg, d.num_local_experts))


def test_forced_routing_metrics_over_two_micro_batches():
    # Micro-batch 1 (T=3, K=2): experts 0,1 | 0,2 | 0,1 -> n = [3, 2, 1, 0]
    # Micro-batch 2 (T=3, K=2): experts 3,0 | 3,1 | 3,2 -> n = [1, 1, 1, 3]
    # Step: n = [4, 3, 2, 3]: min 2, mean 3, max 4, max_violation 1/3,
    #       cv = sqrt(((1)^2 + 0 + (-1)^2 + 0) / 4) / 3 = sqrt(0.5) / 3.
    layer1 = _forced_layer(torch.tensor([[0, 1], [0, 2], [0, 1]]),
                           {"aux_loss": torch.tensor(1.5), "z_loss": torch.tensor(0.25)})
    layer2 = _forced_layer(torch.tensor([[3, 0], [3, 1], [3, 2]]),
                           {"aux_loss": torch.tensor(2.5), "dropped_fraction": torch.tensor(0.5)})
    acc = None
    for layer in (layer1, layer2):
        y, aux, counts_E = out = layer(torch.randn(1, 3, 8))  # still unpacks as a triple
        assert y.shape == (1, 3, 8) and float(aux) == 0.0
        acc = add_micro_batch(acc, [counts_E], [out.router_losses])
    m = moe_metrics(acc)
    assert m["tokens"] == [[4, 3, 2, 3]]
    assert (m["tokens_min"], m["tokens_mean"], m["tokens_max"]) == ([2.0], [3.0], [4.0])
    assert m["max_violation"] == [pytest.approx(1 / 3)]
    assert m["cv"] == [pytest.approx(math.sqrt(0.5) / 3)]
    # Losses: means over the micro-batches that reported them (z_loss: only micro-batch 1).
    # Dropped: micro-batch 1 reports none, i.e. dropped nothing -> (0 + 0.5) / 2.
    assert m["router_losses"] == {"aux_loss": [pytest.approx(2.0)], "z_loss": [0.25]}
    assert m["dropped_fraction"] == [0.25]
    json.dumps(m)  # the record must be plain JSON


def test_layers_that_report_nothing_get_none_and_zero_dropped():
    acc = add_micro_batch(None, [torch.tensor([1, 1]), torch.tensor([2, 0])],
                          [{"z_loss": torch.tensor(3.0)}])  # layer 2 reported no losses
    m = moe_metrics(acc)
    assert m["router_losses"] == {"z_loss": [3.0, None]}
    assert m["dropped_fraction"] == [0.0, 0.0]
    assert moe_metrics(None)["tokens"] == []
    # Counts summed over ranks replace the local ones; a layer with no local values reports none.
    m = moe_metrics(acc, counts=[torch.tensor([3, 1]), torch.tensor([2, 2]), torch.tensor([4, 0])])
    assert m["tokens"] == [[3, 1], [2, 2], [4, 0]] and m["max_violation"] == [0.5, 0.0, 1.0]
    assert m["router_losses"] == {"z_loss": [3.0, None, None]}
    assert moe_metrics(None, counts=[torch.tensor([1, 3])])["dropped_fraction"] == [0.0]


def test_micro_batches_of_different_models_are_refused():
    acc = add_micro_batch(None, [torch.tensor([1, 1])])
    with pytest.raises(ValueError, match=r"has 2 MoE layers but the step so far has 1.*Fix: "):
        add_micro_batch(acc, [torch.tensor([1, 1]), torch.tensor([1, 1])])


def test_real_model_carries_each_layers_router_losses(tiny_cfg):
    """ModelOutput.router_losses holds, per MoE layer, what that layer's router returned; the
    z-loss matches ST-MoE's formula on the router's own input, the dropped fraction the counts,
    and coeff-weighted losses add up to the model's aux_loss."""
    from moeplug.build import build_model
    cfg = tiny_cfg("model.first_k_dense=0",
                   "plugins.router_options={z_loss_coeff: 0.1, capacity_factor: 0.5, "
                   "load_balancing_type: [aux_loss, seq_aux_loss]}")
    torch.manual_seed(0)
    model = build_model(cfg, HOST, 64)
    seen: list = []
    routers = [b.ffn.router for b in model.blocks]
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
             for r in routers]
    tokens_BS = torch.randint(0, 64, (2, 16))
    out = model(tokens_BS, torch.randint(0, 64, (2, 16)))
    for h in hooks:
        h.remove()
    assert len(out.router_losses) == len(out.expert_counts) == len(routers) == 2
    total = torch.zeros(())
    for router, (x_TD, routed), losses, counts_E in zip(routers, seen, out.router_losses,
                                                         out.expert_counts):
        assert set(losses) == {"aux_loss", "seq_aux_loss", "z_loss", "dropped_fraction"}
        for k, v in routed.losses.items():
            assert float(losses[k]) == float(v)
        z_ref = torch.logsumexp(x_TD.detach().float() @ router.weight.detach().float().t(),
                                -1).square().mean()
        assert float(losses["z_loss"]) == pytest.approx(float(z_ref), rel=1e-5)
        T, K = x_TD.shape[0], cfg.model.moe.top_k
        assert 0 < float(losses["dropped_fraction"]) < 1  # capacity 0.5 must drop something
        assert float(losses["dropped_fraction"]) == pytest.approx(1 - int(counts_E.sum()) / (T * K))
        coeff = cfg.model.moe.aux_loss_coeff
        total += coeff * (losses["aux_loss"] + losses["seq_aux_loss"]) + 0.1 * losses["z_loss"]
    assert float(out.aux_loss.detach()) == pytest.approx(float(total), rel=1e-5)


# --------------------------------------------------------------------------------------------
# A real training run writes the metrics into metrics.jsonl
# --------------------------------------------------------------------------------------------

@pytest.fixture
def trained_run(tiny_cfg, tmp_path):
    """3 steps of 2 micro-batches, logged every step, validated and checkpointed at steps 2 and
    3; z-loss on so two loss types appear; TensorBoard on."""
    from moeplug.cli import check_plugins
    from moeplug.data import prepare_corpus
    from moeplug.build import build_model
    from moeplug.training.trainer import seed_everything, train
    out_dir = str(tmp_path / "run")
    cfg = tiny_cfg("train.steps=3", "train.warmup_steps=0", "train.micro_batch_size=4",
                   "train.grad_accum_steps=2", "train.log_interval=1", "train.eval_batches=1",
                   "train.eval_interval=2", "train.tensorboard=true", "train.ckpt_interval=2",
                   "plugins.router_options={z_loss_coeff: 0.01}", out_dir=out_dir)
    precision = check_plugins(HOST, cfg)
    corpus = prepare_corpus(cfg.data)
    seed_everything(cfg.train.seed)
    model = build_model(cfg, HOST, corpus.vocab_size)
    train(cfg, model, corpus, precision, {}, log=lambda _: None, use_bar=False)
    return cfg, out_dir


def test_training_run_logs_per_layer_metrics(trained_run):
    cfg, out_dir = trained_run
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    tc, moe = cfg.train, cfg.model.moe
    for r in train:
        m = r["moe"]
        [n_E] = m["tokens"]  # one MoE layer (the tiny model's first layer is dense)
        # Dropless: every token of both micro-batches picks top_k experts.
        assert len(n_E) == moe.num_experts
        assert sum(n_E) == tc.micro_batch_size * tc.seq_len * tc.grad_accum_steps * moe.top_k
        mean = sum(n_E) / len(n_E)
        assert m["tokens_min"] == [min(n_E)] and m["tokens_max"] == [max(n_E)]
        assert m["tokens_mean"] == [pytest.approx(mean)]
        assert m["max_violation"] == [pytest.approx(max(n_E) / mean - 1)]
        std = math.sqrt(sum((n - mean) ** 2 for n in n_E) / len(n_E))
        assert m["cv"] == [pytest.approx(std / mean)]
        assert m["dropped_fraction"] == [0.0]
        # The logged (scaled) aux_loss is the micro-batch mean of coeff * aux + z_coeff * z, so
        # the per-type means must reproduce it.
        losses = m["router_losses"]
        assert set(losses) == {"aux_loss", "z_loss"}
        assert r["aux_loss"] == pytest.approx(moe.aux_loss_coeff * losses["aux_loss"][0]
                                              + 0.01 * losses["z_loss"][0], rel=1e-5)
        assert losses["aux_loss"][0] >= 1.0 - 1e-6  # Switch aux loss is >= 1 (1 = balanced)


# --------------------------------------------------------------------------------------------
# Per-stage time breakdown (moeplug.observability.timing)
# --------------------------------------------------------------------------------------------

def test_stages_count_once_and_only_inside_a_measured_block():
    with stage("router"):  # no active clock: a no-op, nothing to report to
        pass
    with measure_stages() as times:
        assert times == {}  # filled when the block exits
        with stage("router"):
            time.sleep(0.02)
            with stage("dispatch"):  # nested: its time belongs to the open outer stage
                time.sleep(0.01)
        with stage("optimizer"):
            time.sleep(0.01)
        time.sleep(0.01)  # no stage: "other"
    assert set(times) == {*STAGES, "step", "other"}
    assert times["router"] >= 0.03 and times["optimizer"] >= 0.01 and times["other"] >= 0.01
    assert times["dispatch"] == 0.0 and times["attention"] == 0.0
    assert sum(times[s] for s in STAGES) + times["other"] == pytest.approx(times["step"])
    with measure_stages(enabled=False) as off:
        with stage("router"):
            pass
    assert off == {}
    assert add_times({"a": 1.0, "b": 2.0}, {"b": 0.5, "c": 3.0}) == {"a": 1.0, "b": 2.5, "c": 3.0}


def test_stage_markers_keep_torch_compile_graphs_whole():
    """A block (its attention is a marked stage) compiles with fullgraph=True, i.e. without a
    graph break, inside a measured step, and gives eager's output and gradients."""
    from moeplug.modules.mlp import SwiGLUMLP
    from moeplug.modules.rope import RotaryEmbedding
    from moeplug.modules.transformer import TransformerBlock
    cfg = ModelConfig(hidden_size=16, num_heads=2, num_kv_heads=2, max_seq_len=8,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=8))
    torch.manual_seed(0)
    block = TransformerBlock(cfg, RotaryEmbedding(cfg.head_dim, 8, cfg.rope_theta),
                             SwiGLUMLP(16, 32))
    x_BSD = torch.randn(2, 8, 16)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (block, compiled):
        block.zero_grad()
        with measure_stages() as times:
            y_BSD = fn(x_BSD)[0]
            y_BSD.square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
        assert times["step"] > 0
    torch.testing.assert_close(grads[0], grads[1])


def test_training_run_logs_a_time_breakdown(trained_run):
    cfg, out_dir = trained_run
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.seq_len * cfg.train.grad_accum_steps
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    for r in train:
        t = r["time_breakdown"]
        assert list(t) == [*STAGES, "step", "other"]
        assert all(v >= 0 for v in t.values()), t
        assert sum(t[s] for s in STAGES) + t["other"] == pytest.approx(t["step"])
        # every stage of a one-process MoE step ran; nothing waited on another rank
        for s in ("attention", "router", "dispatch", "experts", "combine", "backward",
                  "optimizer"):
            assert t[s] > 0, (s, t)
        assert t["comm_wait"] < 0.01 * t["step"]
        # the measured step is train_step; the throughput's step also samples the batch
        assert t["step"] <= tokens_per_step / r["tokens_per_s"] * (1 + 1e-6)


def test_time_breakdown_can_be_switched_off(tiny_cfg, tmp_path):
    from moeplug.data import prepare_corpus
    from moeplug.build import build_model
    from moeplug.training.trainer import train
    cfg = tiny_cfg("train.steps=2", "train.warmup_steps=0", "train.log_interval=1",
                   "train.eval_batches=1", "train.time_breakdown=false",
                   out_dir=str(tmp_path / "off"))
    corpus = prepare_corpus(cfg.data)
    model = build_model(cfg, HOST, corpus.vocab_size)
    train(cfg, model, corpus, HOST.create("precision", "fp32", {}), {}, log=lambda _: None,
          use_bar=False)
    with open(tmp_path / "off" / "metrics.jsonl", encoding="utf-8") as f:
        train_records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(train_records) == 2 and all("time_breakdown" not in r for r in train_records)
    with pytest.raises(ConfigError, match=r"TrainConfig.time_breakdown = 'yes': must be a "
                                          r"boolean \(true or false\)\. Fix: write time_breakdown: "
                                          r"true or false"):
        tiny_cfg("train.time_breakdown='yes'")


# --------------------------------------------------------------------------------------------
# Plots (matplotlib): the figure objects carry the labels and the data; the files decode
# --------------------------------------------------------------------------------------------

def _write_metrics(run_dir, records) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _decoded(path) -> tuple[tuple[int, int], int]:
    """(width, height) and the number of distinct colours of the image at ``path``."""
    from PIL import Image
    with Image.open(path) as img:
        rgb = img.convert("RGB")
        return rgb.size, len(rgb.getcolors(maxcolors=1 << 24))


# 2 layers x 3 experts, 3 logged steps; a resumed run logged step 20 twice (the later wins).
LOADS = {10: [[6, 3, 3], [4, 4, 4]], 20: [[2, 2, 8], [0, 0, 0]], 30: [[1, 10, 1], [3, 6, 3]]}


@pytest.fixture
def synthetic_run(tmp_path) -> str:
    run = str(tmp_path / "synthetic")
    _write_metrics(run, [
        {"kind": "run"},
        {"kind": "train", "step": 20, "loss": 9.0, "mfu": 0.9,
         "moe": {"tokens": [[12, 0, 0], [1, 1, 1]], "max_violation": [9.0, 9.0]}},
        *({"kind": "train", "step": s, "loss": 5.0 - s / 10, "mfu": s / 1000,
           "moe": {"tokens": t, "max_violation": [max(n) / (sum(n) / 3) - 1 if sum(n) else 0
                                                  for n in t]}}
          for s, t in sorted(LOADS.items())),
        {"kind": "val", "step": 30, "val_loss": 2.5}])
    with open(os.path.join(run, "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"kind": "train", "step": 40, "mo')  # a crash mid-write: the line is skipped
    return run


def test_heat_map_labels_and_data(synthetic_run, tmp_path):
    plot = plot_load(synthetic_run, str(tmp_path / "maps" / "load.png"))
    assert plot.steps == [10, 20, 30] and plot.experts_per_layer == [3, 3]
    assert plot.max_share == pytest.approx(10 / 12)
    ax, bar_ax = plot.figure.axes
    assert "Expert load" in ax.get_title() and synthetic_run in ax.get_title()
    assert ax.get_xlabel() == "training step"
    assert ax.get_ylabel() == "MoE layer × expert (expert 0 at the top of each layer)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["MoE layer 0\n(3 experts)",
                                                            "MoE layer 1\n(3 experts)"]
    assert len(ax.yaxis.get_minor_locator()()) == 6  # a tick per expert row
    assert bar_ax.get_ylabel() == "share of the layer's routed tokens (red: balanced, 1/3)"
    assert [line.get_ydata()[0] for line in bar_ax.lines] == [pytest.approx(1 / 3)]
    # cells span halfway between logged steps; one separator line between the two layers
    assert ax.get_xlim() == (5.0, 35.0)
    assert [tuple(line.get_ydata()) for line in ax.lines] == [(3, 3)]
    # the drawn values: rows top to bottom = layer 0 experts 0..2, layer 1 experts 0..2
    [mesh] = ax.collections
    drawn_YR = mesh.get_array().reshape(6, 3)[::-1]
    for r, s in enumerate(sorted(LOADS)):
        for li, n_E in enumerate(LOADS[s]):
            for e, n in enumerate(n_E):
                want = n / sum(n_E) if sum(n_E) else 0.0  # a layer with no tokens: share 0
                assert drawn_YR[li * 3 + e, r] == pytest.approx(want)
    assert mesh.get_clim() == (0.0, pytest.approx(10 / 12))
    (w, h), colours = _decoded(plot.path)
    assert w >= 900 and h >= 300 and colours > 50


def test_heat_map_labels_of_a_deep_model_do_not_pile_up():
    from moeplug.observability.heatmap import LoadHistory, load_figure
    history = LoadHistory(steps=[1, 2], tokens=[[[1] * 10 for _ in range(50)]] * 2)
    ax = load_figure(history).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"MoE layer {i}" for i in range(0, 50, 3)]  # every 3rd: <= 24 labels
    assert len(ax.yaxis.get_minor_locator()()) == 0  # 500 expert rows: no per-expert ticks
    assert len(ax.lines) == 49  # still a separator between every two layers


def test_loss_mfu_and_maxvio_figures(synthetic_run, tmp_path):
    from moeplug.observability.curves import plot_curves
    other = str(tmp_path / "other")
    _write_metrics(other, [{"kind": "train", "step": 5, "loss": 4.0, "mfu": 0.25},
                           {"kind": "train", "step": 15, "loss": 3.0, "mfu": 0.5}])
    loss = plot_curves("loss", [synthetic_run, other], str(tmp_path / "loss.png")).figure
    [ax] = loss.axes
    assert ax.get_xlabel() == "training step" and ax.get_ylabel() == "loss (nats/token)"
    assert ax.get_title() == "Loss (train: solid, validation: dashed)"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {f"{synthetic_run} train", f"{synthetic_run} val", f"{other} train"}
    assert list(lines[f"{synthetic_run} train"].get_xdata()) == [10, 20, 30]
    assert list(lines[f"{synthetic_run} train"].get_ydata()) == pytest.approx([4.0, 3.0, 2.0])
    assert list(lines[f"{synthetic_run} val"].get_ydata()) == [2.5]
    assert lines[f"{synthetic_run} val"].get_linestyle() == "--"
    assert lines[f"{synthetic_run} val"].get_color() == lines[f"{synthetic_run} train"].get_color()
    assert lines[f"{other} train"].get_color() != lines[f"{synthetic_run} train"].get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)

    [ax] = plot_curves("mfu", [synthetic_run, other], str(tmp_path / "mfu.png")).figure.axes
    assert ax.get_ylabel() == "MFU (% of the measured dense-GEMM peak)"
    assert list(ax.get_lines()[1].get_ydata()) == pytest.approx([25.0, 50.0])

    plot = plot_curves("maxvio", [synthetic_run])
    assert plot.path == os.path.join(synthetic_run, "maxvio.png")
    [ax] = plot.figure.axes
    assert "MaxVio" in ax.get_ylabel() and synthetic_run in ax.get_title()
    assert [line.get_label() for line in ax.get_lines()] == ["MoE layer 0", "MoE layer 1"]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([0.5, 1.0, 1.5])
    for name in ("loss.png", "mfu.png"):
        (w, h), colours = _decoded(tmp_path / name)
        assert w >= 800 and h >= 400 and colours > 20
    _write_metrics(str(tmp_path / "empty"), [{"kind": "run"}])
    with pytest.raises(RunDirError, match=r"has no train record with 'mfu'\. Fix: train past"):
        plot_curves("mfu", [str(tmp_path / "empty")])
    with pytest.raises(RunDirError, match=r"maxvio draws one run, got 2.*Fix: pass one RUN_DIR"):
        plot_curves("maxvio", [synthetic_run, other])


@pytest.mark.parametrize("argv", [["plot", "load"], ["plot-load"]])
def test_plot_load_cli_on_a_real_run(trained_run, run_cli, tmp_path, argv):
    _, out_dir = trained_run
    out = str(tmp_path / "load.png")
    proc = run_cli(*argv, out_dir, "--out", out, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"wrote {out}: x = 3 logged steps 1..3, y = experts of 1 MoE "
                                  f"layers [4]; colour = share of the layer's routed tokens")
    (w, h), colours = _decoded(out)
    assert w >= 900 and h >= 300 and colours > 50


def test_plot_curves_cli_on_real_runs(trained_run, run_cli, tmp_path):
    _, out_dir = trained_run
    for argv in (["loss", out_dir, out_dir], ["mfu", out_dir], ["maxvio", out_dir]):
        out = str(tmp_path / f"{argv[0]}.svg")  # the format follows the extension
        proc = run_cli("plot", *argv, "--out", out, timeout=120)
        assert proc.returncode == 0 and proc.stdout == f"wrote {out}\n", proc.stderr[-2000:]
        with open(out, encoding="utf-8") as f:
            assert "training step" in f.read()
    proc = run_cli("plot", "maxvio", out_dir, out_dir, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


_WITHOUT = ("import sys; sys.modules[{name!r}] = None; from moeplug.cli import main; "
            "sys.exit(main(sys.argv[1:]))")


def test_missing_matplotlib_names_the_extra(trained_run, cli_env, tmp_path):
    _, out_dir = trained_run
    proc = subprocess.run([sys.executable, "-c", _WITHOUT.format(name="matplotlib"), "plot",
                           "load", out_dir, "--out", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=120, env=cli_env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("moeplug: configuration error: plotting needs matplotlib")
    assert 'Fix: pip install "moeplug[plot]"' in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.png").exists()


def test_missing_tensorboard_names_the_extra_before_any_work(tiny_config_file, cli_env,
                                                             tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _WITHOUT.format(name="tensorboard"), "train",
                           "--config", tiny_config_file(str(out)), "--tensorboard"],
                          capture_output=True, text=True, timeout=120, env=cli_env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.tensorboard = True needs the tensorboard and matplotlib packages" in proc.stderr
    assert 'Fix: pip install "moeplug[tensorboard]"' in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


# --------------------------------------------------------------------------------------------
# TensorBoard: read back with TensorBoard's own reader
# --------------------------------------------------------------------------------------------

def _events(tb_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_events_mirror_the_records(trained_run):
    _, out_dir = trained_run
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = list(map(json.loads, f))
    train = [r for r in records if r["kind"] == "train"]
    acc = _events(os.path.join(out_dir, "tb"))
    scalars = set(acc.Tags()["scalars"])
    for key, tag in (("loss", "loss/train"), ("lm_loss", "loss/lm"), ("aux_loss", "loss/aux"),
                     ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "perf/tokens_per_s"), ("tflops", "perf/tflops"),
                     ("mfu", "perf/mfu")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3], tag
        assert [e.value for e in events] == pytest.approx([r[key] for r in train], rel=1e-6)
    z = [e.value for e in acc.Scalars("loss/z")]
    assert z == pytest.approx([r["moe"]["router_losses"]["z_loss"][0] for r in train], rel=1e-6)
    for name in ("max_violation", "dropped_fraction"):
        got = [e.value for e in acc.Scalars(f"moe/{name}/layer_0")]
        assert got == pytest.approx([r["moe"][name][0] for r in train], rel=1e-6, abs=1e-12)
    assert {f"time/{s}" for s in (*STAGES, "step", "other")} <= scalars
    val = acc.Scalars("loss/val")
    assert [(e.step, e.value) for e in val] == [
        (r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in records if r["kind"] == "val"]
    images = acc.Images("moe/expert_load")
    assert [e.step for e in images] == [2, 3]
    from io import BytesIO
    from PIL import Image
    with Image.open(BytesIO(images[-1].encoded_image_string)) as img:
        assert img.size == (images[-1].width, images[-1].height) and img.size[0] >= 900
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 24)) > 50


def test_resumed_run_replaces_the_tensorboard_steps_it_logs_again(trained_run):
    """Resuming from step 2 logs step 3 again: TensorBoard shows each step once, the new one."""
    from moeplug.config import apply_overrides, config_from_dict
    from moeplug.data import prepare_corpus
    from moeplug.build import build_model
    from moeplug.training.trainer import seed_everything, train
    cfg, out_dir = trained_run
    cfg = config_from_dict(apply_overrides(cfg.to_dict(), [
        f"train.resume={os.path.join(out_dir, 'step_000002')}"]))
    corpus = prepare_corpus(cfg.data)
    seed_everything(cfg.train.seed)
    resumed_at = time.time()
    train(cfg, build_model(cfg, HOST, corpus.vocab_size), corpus, HOST.create("precision",
          "fp32", {}), {}, log=lambda _: None, use_bar=False)
    acc = _events(os.path.join(out_dir, "tb"))
    events = acc.Scalars("loss/train")
    assert [e.step for e in events] == [1, 2, 3]
    assert events[1].wall_time < resumed_at <= events[2].wall_time
    assert [e.step for e in acc.Images("moe/expert_load")] == [2, 3]


def _train_two_ranks(rank: int, world: int, cfg_dict: dict) -> int:
    from moeplug.config import config_from_dict
    from moeplug.data import prepare_corpus
    from moeplug.parallel import ParallelGroups
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import seed_everything, train
    cfg = config_from_dict(cfg_dict)
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    corpus = prepare_corpus(cfg.data)  # the parent prepared the cache: read only
    seed_everything(cfg.train.seed)
    model = build_rank_model(cfg, HOST, corpus.vocab_size, groups)
    train(cfg, model, corpus, HOST.create("precision", "fp32", {}), {}, log=lambda _: None,
          use_bar=False, groups=groups)
    return os.getpid()


def test_only_rank_0_writes_tensorboard_events(tiny_cfg, tmp_path):
    """PP2: rank 0 holds the dense first layer, rank 1 the MoE layer and the head."""
    from moeplug.data import prepare_corpus
    from moeplug.testing.distributed import run_distributed
    out_dir = str(tmp_path / "pp2")
    cfg = tiny_cfg("train.steps=2", "train.warmup_steps=0", "train.log_interval=1",
                   "train.eval_batches=1", "train.tensorboard=true", "parallel.pp=2",
                   "train.grad_accum_steps=2", out_dir=out_dir)
    prepare_corpus(cfg.data)
    pids = run_distributed(_train_two_ranks, 2, cfg.to_dict(), timeout=300)
    files = os.listdir(os.path.join(out_dir, "tb"))
    assert len(files) == 1 and files[0].startswith("events.out.tfevents.")
    assert files[0].split(".")[-2] == str(pids[0])  # the name ends in .<pid>.<index>
    acc = _events(os.path.join(out_dir, "tb"))
    assert [e.step for e in acc.Scalars("loss/train")] == [1, 2]
    # rank 0's own stages through the pipeline schedule: its attention and backward, and the
    # waits for rank 1's gradients; the MoE stages run on rank 1
    for stage_name, ran in (("attention", True), ("backward", True), ("comm_wait", True),
                            ("router", False), ("experts", False)):
        assert all((e.value > 0) == ran for e in acc.Scalars(f"time/{stage_name}")), stage_name


# --------------------------------------------------------------------------------------------
# Errors name the path and the fix
# --------------------------------------------------------------------------------------------

def test_missing_run_dir(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(RunDirError, match=r"run directory '.*nope' does not exist\. Fix: pass "
                                          r"the train.out_dir"):
        plot_load(missing)
    assert issubclass(RunDirError, ConfigError)  # so the CLI reports it as exit 2


def test_run_dir_without_metrics(tmp_path):
    with pytest.raises(RunDirError, match=r"has no metrics.jsonl\. Fix: pass the train.out_dir"):
        plot_load(str(tmp_path))


def test_metrics_without_loads(tmp_path):
    _write_metrics(str(tmp_path), [{"kind": "run"}, {"kind": "train", "step": 1, "loss": 2.0},
                                   {"kind": "train", "step": 2, "moe": {"tokens": []}}])
    with pytest.raises(RunDirError, match=r"no train record with per-expert loads \(key "
                                          r"moe.tokens\)\. Fix: train past the first logging"):
        plot_load(str(tmp_path))


def test_broken_line_and_mixed_models(tmp_path):
    good = {"kind": "train", "step": 1, "moe": {"tokens": [[1, 2]]}}
    with open(tmp_path / "metrics.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps(good) + "\n{oops\n" + json.dumps(good) + "\n")
    with pytest.raises(RunDirError, match=r"line 2 is not valid JSON\. Fix: delete or repair"):
        plot_load(str(tmp_path))
    wider = {"kind": "train", "step": 2, "moe": {"tokens": [[1, 2, 3]]}}
    _write_metrics(str(tmp_path), [good, wider])
    with pytest.raises(RunDirError, match=r"step 2 logs experts per layer \[3\] but step 1 logs "
                                          r"\[2\].*Fix: give each model its own train.out_dir"):
        plot_load(str(tmp_path))


def test_cli_reports_a_missing_run_dir_with_exit_2(run_cli, tmp_path):
    proc = run_cli("plot", "loss", str(tmp_path / "nope"), timeout=120)
    assert proc.returncode == 2
    assert "does not exist. Fix: pass the train.out_dir" in proc.stderr
    assert "Traceback" not in proc.stderr
