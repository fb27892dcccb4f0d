"""Per-layer MoE metrics (moeplug.observability.layer_stats) and the load heat map (heatmap, png).

Legend: T tokens, K top-k, E experts, D hidden, R logged steps (rows), C map columns.
References are computed by hand or with plain torch/zlib next to each check; the PNG is parsed
back here with zlib + struct, independently of the encoder.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch

from moeplug.config import ConfigError, ModelConfig, MoEConfig
from moeplug.interfaces import Router, RouterOutput
from moeplug.modules import MoELayer
from moeplug.observability import RunDirError, add_micro_batch, encode_png, moe_metrics, plot_load
from moeplug.observability.layer_stats import load_stats
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
    from moeplug.modules import build_model
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
    """3 steps of 2 micro-batches, logged every step; z-loss on so two loss types appear."""
    from moeplug.cli import check_plugins
    from moeplug.data import prepare_corpus
    from moeplug.modules import build_model
    from moeplug.training.trainer import seed_everything, train
    out_dir = str(tmp_path / "run")
    cfg = tiny_cfg("train.steps=3", "train.warmup_steps=0", "train.micro_batch_size=4",
                   "train.grad_accum_steps=2", "train.log_interval=1", "train.eval_batches=1",
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
# The PNG, parsed back independently
# --------------------------------------------------------------------------------------------

def _decode_png(data: bytes) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """(width, height, rows of RGB pixels) of an 8-bit RGB, filter-0 PNG; checks every CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, colour, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = []
    for y in range(h):
        line = raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)]
        assert line[0] == 0  # filter type 0 (none)
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(w)])
    return w, h, rows


def _write_metrics(run_dir, records) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_encoder_round_trip_by_hand():
    rgb = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30, 40, 50, 60, 70, 80, 90])
    w, h, rows = _decode_png(encode_png(3, 2, rgb))
    assert (w, h) == (3, 2)
    assert rows == [[(255, 0, 0), (0, 255, 0), (0, 0, 255)],
                    [(10, 20, 30), (40, 50, 60), (70, 80, 90)]]


def test_encoder_rejects_a_wrong_pixel_count():
    with pytest.raises(ValueError, match=r"got 5 bytes.*2x1 RGB image needs .* = 6\. Fix: pass 3"):
        encode_png(2, 1, b"\x00" * 5)
    with pytest.raises(ValueError, match=r"0x3 must be at least 1x1\. Fix:"):
        encode_png(0, 3, b"")


def test_heat_map_pixels_follow_the_loads(tmp_path):
    # 2 layers x 3 experts, 3 logged steps; a resumed run logged step 20 twice (the later wins).
    loads = {10: [[6, 3, 3], [4, 4, 4]], 20: [[2, 2, 8], [0, 0, 0]], 30: [[1, 10, 1], [3, 6, 3]]}
    run = str(tmp_path / "run")
    _write_metrics(run, [{"kind": "run"},
                         {"kind": "train", "step": 20, "moe": {"tokens": [[12, 0, 0], [1, 1, 1]]}},
                         *({"kind": "train", "step": s, "moe": {"tokens": t}}
                           for s, t in sorted(loads.items())),
                         {"kind": "val", "step": 30, "val_loss": 1.0}])
    with open(os.path.join(run, "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"kind": "train", "step": 40, "mo')  # a crash mid-write: the line is skipped
    out = str(tmp_path / "maps" / "load.png")
    plot = plot_load(run, out, cell_width=5, cell_height=4)
    w, h, rows = _decode_png(Path(out).read_bytes())
    # C = 3 + 1 gap + 3 columns of 5 px; R = 3 rows of 4 px.
    assert (w, h) == (plot.width, plot.height) == (7 * 5, 3 * 4)
    assert plot.steps == [10, 20, 30] and plot.experts_per_layer == [3, 3]

    def cell(r: int, c: int) -> tuple[int, int, int]:
        return rows[r * 4 + 2][c * 5 + 2]

    shares = {}
    for r, s in enumerate(sorted(loads)):
        for li, n_E in enumerate(loads[s]):
            for e, n in enumerate(n_E):
                shares[(r, li * 4 + e)] = n / sum(n_E) if sum(n_E) else 0.0
        assert cell(r, 3) == (255, 255, 255)  # gap column between the layers
    hottest = max(shares, key=shares.get)
    assert hottest == (2, 1) and plot.max_share == pytest.approx(10 / 12)
    assert cell(*hottest) == (253, 231, 37)  # the top of the viridis scale
    assert cell(1, 4) == (68, 1, 84)  # a layer with no tokens: share 0, the bottom of the scale
    # Brightness rises with the share (viridis is monotonic in lightness): sort by share.
    ordered = sorted(shares, key=shares.get)
    for a, b in zip(ordered, ordered[1:]):
        if shares[b] > shares[a] + 1e-9:
            assert sum(cell(*b)) > sum(cell(*a)), (a, b)
        else:
            assert cell(*a) == cell(*b)
    # Every pixel of a cell has the cell's colour.
    assert all(rows[y][x] == cell(0, 0) for y in range(4) for x in range(5))


def test_plot_load_cli_on_a_real_run(trained_run, run_cli, tmp_path):
    _, out_dir = trained_run
    out = str(tmp_path / "load.png")
    proc = run_cli("plot-load", out_dir, "--out", out, "--cell", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rows = 3 logged steps 1..3" in proc.stdout
    w, h, rows = _decode_png(Path(out).read_bytes())
    assert w == 4 * 3 and h % 3 == 0 and h >= 3  # 4 experts x 3 px; 3 steps of equal height
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        last = [r for r in map(json.loads, f) if r["kind"] == "train"][-1]["moe"]["tokens"][0]
    row = rows[h - 1]  # the last step's cells: the busiest expert is the brightest
    brightness = [sum(row[e * 3 + 1]) for e in range(4)]
    assert brightness.index(max(brightness)) == last.index(max(last))


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


def test_bad_cell_size(tmp_path):
    with pytest.raises(RunDirError, match=r"cell_width = 0 must be a whole number of pixels >= 1"
                                          r"\. Fix: pass e.g. cell_width=8"):
        plot_load(str(tmp_path), cell_width=0)


def test_cli_reports_a_missing_run_dir_with_exit_2(run_cli, tmp_path):
    proc = run_cli("plot-load", str(tmp_path / "nope"), timeout=120)
    assert proc.returncode == 2
    assert "does not exist. Fix: pass the train.out_dir" in proc.stderr
    assert "Traceback" not in proc.stderr
