"""moeplug plan: the performance and memory model against published rows, its search, its CLI,
and against moeplug's own measured CPU runs (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from moeplug.config import ConfigError
from moeplug.modules.flops import flops_per_token
from moeplug.plan import perf
from moeplug.plan.calibrate import BOUNDS, fit, predict, row_inputs, target
from moeplug.plan.cluster import get_cluster
from moeplug.plan.memory import GB, Mapping, Options, check_model, peak_memory, stage_memory
from moeplug.plan.models import (DSV3_MEMORY_GB, DSV3_MEMORY_ROW, P26_ROWS, PF_ROWS,
                                 model_config)
from moeplug.plan.search import search

# Rows the model misses by more than 15 % with the one global fit, and why (README "Planning a
# run" repeats this). The test below fails if one of them starts to hold, so the list stays true.
KNOWN_MISSES = {
    # A miss in time (+16 % TFLOP/s; its memory fits): the one row without CUDA graphs (P26
    # Appendix B.2), the one Hopper FP8 (blockwise) row, and EP64 x TP2 over 16 nodes, whose
    # 10.9 s inter-node all-to-all the 1F1B overlap hides at 93 %. A per-layer host cost of
    # 4.0 ms, an FP8 speed-up of 0.9 or 75 % hidden would each close it, fitted to this row
    # alone (docs/planning.md, "It misses, and says why").
    "deepseek_v3 H100 1024 fp8 TP2 PP8 EP64 VPP4",
    # PF's Qwen2-57B mapping is not in our sources; the planner's best mapping (GBS 256
    # assumed) is compared with the paper's MFU.
    "qwen2_57b H100 64 bf16 TP1 PP1 EP1 VPP1",
}


def predicted_tflops(row) -> float:
    if "not published" in row.note:  # compare the planner's best mapping
        cfg, mp, opt, c = row_inputs(row)
        return search(cfg, opt, c, gbs=row.gbs, seq=row.seq)[0].step.tflops_per_gpu
    return predict(row).tflops_per_gpu


@pytest.mark.parametrize("row", P26_ROWS + PF_ROWS, ids=lambda r: r.label)
def test_published_row_within_15_percent_unless_a_stated_miss(row):
    err = predicted_tflops(row) / target(row) - 1
    if row.label in KNOWN_MISSES:
        assert abs(err) > 0.15, f"{row.label} now holds ({err:+.1%}): drop it from KNOWN_MISSES"
    else:
        assert abs(err) <= 0.15, f"{row.label}: predicted {err:+.1%} vs published"


def test_most_headline_rows_hold():
    assert sum(r.label not in KNOWN_MISSES for r in P26_ROWS) >= 5


def test_stored_constants_are_one_global_fit_over_all_rows():
    # Refit from the middle of every bound: the stored constants are what the fit over all
    # rows together gives (no per-row constants, no hand tuning after the fit).
    start = {k: (lo + hi) / 2 for k, (lo, hi) in BOUNDS.items()}
    got = fit(P26_ROWS + PF_ROWS[:1], start=start)
    for name, value in perf.CONSTANTS.items():
        assert got[name] == pytest.approx(value, rel=0.05), name


@pytest.mark.parametrize("name,gflops", [("qwen3_235b", 148.0), ("mixtral_8x22b", 242.2),
                                         ("qwen2_57b", 84.7), ("deepseek_v3", 260.0)])
def test_planner_models_have_the_reference_flops(name, gflops):
    cfg = model_config(name)
    assert flops_per_token(cfg, cfg.vocab_size, 4096) / 1e9 == pytest.approx(gflops, abs=0.05)


def test_deepseek_v3_memory_breakdown_within_10_percent_per_part():
    cfg, mp, opt, _ = row_inputs(DSV3_MEMORY_ROW)
    # Stage 1 of the published layout Et*4|(tttt|)*14tmL: 16 MoE layers, none dense. Table
    # 3's 36.4 GB of weights are 15 MoE layers' worth (the row's stage reads 39.3 GB, 2.46 GB
    # a layer): within 10 %, not 1 % as with the even split of old, whose stage held 15.
    mem = stage_memory(cfg, mp, opt, 1)
    got = {"weights_grads": mem.weights_grads / GB, "optimizer": mem.optimizer / GB,
           "activations": mem.activations_total / GB}
    for part, want in DSV3_MEMORY_GB.items():
        assert got[part] == pytest.approx(want, rel=0.10), (part, got[part])


def test_recompute_offload_and_sharding_move_the_right_bytes():
    cfg = model_config("deepseek_v3")
    mp = Mapping(world=256, pp=4, ep=64, vpp=4, gbs=8192)
    base = stage_memory(cfg, mp, Options(), 1)
    rc = stage_memory(cfg, mp, Options(recompute=("mla_up_proj",)), 1)
    assert "mla_up_proj" not in rc.activations
    assert base.activations_total - rc.activations_total == \
        pytest.approx(base.activations["mla_up_proj"])
    off = stage_memory(cfg, mp, Options(offload=("expert_fc1",)), 1)
    assert off.activations["expert_fc1"] < base.activations["expert_fc1"] / 10
    # ZeRO-1: twice the expert-DP degree halves the expert optimizer state.
    wide = Mapping(world=512, pp=4, ep=64, vpp=4, gbs=8192)
    assert stage_memory(cfg, wide, Options(), 1).optimizer < 0.6 * base.optimizer
    # FP8 keeps linear-layer inputs in one byte.
    assert stage_memory(cfg, mp, Options(precision="fp8"), 1).activations_total < \
        base.activations_total


def test_sync_free_keeps_and_sends_every_budget_slot():
    """runtime.sync_free: the static region keeps FC1's input and output for every budget slot
    (padding included) and never the activation, and exchanges every slot; a GPU's batched
    experts compute the padding too, a CPU's only the routed rows."""
    cfg = model_config("deepseek_v3")
    mp = Mapping(world=256, pp=4, ep=64, vpp=4, gbs=8192)
    base, sf = Options(), Options(token_budget=1.5)
    a, b = stage_memory(cfg, mp, base, 1), stage_memory(cfg, mp, sf, 1)
    for name in ("expert_fc1", "moe_fc1_out"):
        assert b.activations[name] == pytest.approx(1.5 * a.activations[name])
    assert "moe_act" in a.activations and "moe_act" not in b.activations
    assert b.comm_buffers == pytest.approx(1.5 * a.comm_buffers)
    h100 = get_cluster("h100", 256)
    assert perf.a2a_seconds(cfg, mp, sf, h100) > perf.a2a_seconds(cfg, mp, base, h100)
    assert perf.stage_seconds(cfg, mp, sf, h100, 1)["gemm"] > \
        perf.stage_seconds(cfg, mp, base, h100, 1)["gemm"]
    with pytest.raises(Exception, match="token_budget -1.*Fix"):
        Options(token_budget=-1)


def test_plan_of_a_config_takes_its_memory_levers(tmp_path, tiny_corpus, cache_dir):
    """``moeplug plan --config`` planned the config's model and layout but none of its
    levers: a run with recompute, offload, EP overlap or sync-free was planned as if it had
    none. Now they come from the config (a flag given replaces the config's list)."""
    import yaml

    from conftest import tiny_config_dict
    from moeplug.plan.cli import config_inputs
    d = tiny_config_dict(tiny_corpus, str(tmp_path / "run"), cache_dir)
    d["model"].update(recompute={"granularity": "selective", "modules": ["moe_act"]},
                      offload=["expert_fc1"])
    d["parallel"] = {"ep": 2, "overlap_moe_expert_parallel_comm": True}
    d["train"]["grad_accum_steps"] = 2
    d["runtime"] = {"sync_free": True, "token_budget": 1.25}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(d))
    _, _, opts, _ = config_inputs(str(path))
    assert opts["recompute"] == ("moe_act",) and opts["offload"] == ("expert_fc1",)
    assert opts["a2a_overlap"] is True and opts["token_budget"] == 1.25
    d["model"]["recompute"] = {"granularity": "full"}
    d["model"]["offload"] = []
    path.write_text(yaml.safe_dump(d))
    _, _, opts, _ = config_inputs(str(path))
    assert opts["recompute"] == ("full",)


def test_full_recompute_keeps_each_blocks_input_and_reruns_its_forward():
    """Megatron's granularity full: a block keeps its input; in backward one block at a time
    holds its tensors again, and every block's forward runs twice (its all-to-all too)."""
    cfg = model_config("deepseek_v3")
    mp = Mapping(world=256, pp=4, ep=64, vpp=4, gbs=8192)
    base, full = Options(), Options(recompute=("full",))
    a, b = stage_memory(cfg, mp, base, 1), stage_memory(cfg, mp, full, 1)
    assert set(b.activations) == {"block_input", "rebuilt_block"}
    assert b.activations_total < 0.2 * a.activations_total
    h100 = get_cluster("h100", 256)
    sa, sb = perf.stage_seconds(cfg, mp, base, h100, 1), perf.stage_seconds(cfg, mp, full, h100, 1)
    assert sb["gemm"] > 1.2 * sa["gemm"] and sb["attention"] > sa["attention"]
    assert sb["all_to_all"] == pytest.approx(1.5 * sa["all_to_all"])
    with pytest.raises(Exception, match="full recomputes whole blocks"):
        Options(recompute=("full", "moe_act"))


def test_search_returns_valid_mappings_best_first_under_the_memory_limit():
    cfg, c = model_config("qwen3_235b"), get_cluster("h100", 256)
    cands = search(cfg, Options(), c, gbs=2048, seq=4096)
    fitting = [k for k in cands if k.fits]
    assert fitting and cands[0] is fitting[0]
    assert fitting[0].step.tflops_per_gpu == max(k.step.tflops_per_gpu for k in fitting)
    for k in cands:
        check_model(cfg, k.mapping)  # moeplug's own layout rules accept every candidate
        assert k.fits == (peak_memory(cfg, k.mapping, Options()).total <= 0.9 * 80 * GB)
    assert any(not k.fits for k in cands)  # the limit really filters


def test_search_tries_fsdp_where_train_accepts_it_and_it_fits_what_zero1_cannot():
    """--search ranks FSDP (fsdp=1) beside each ZeRO-1 mapping: every FSDP candidate passes
    moeplug train's rules, never plans more bytes than its ZeRO-1 twin, and some fit only with
    it; the combined 1F1B, which train refuses beside FSDP, is searched without it."""
    cfg, c = model_config("qwen3_235b"), get_cluster("h100", 256)
    cands = search(cfg, Options(), c, gbs=2048, seq=4096)
    twins = {}
    for k in cands:
        twins.setdefault(dataclasses.replace(k.mapping, fsdp=0), {})[k.mapping.fsdp] = k
    pairs = [d for d in twins.values() if 0 in d and 1 in d]
    assert pairs
    for d in pairs:
        check_model(cfg, d[1].mapping)
        assert d[1].memory.total <= d[0].memory.total
    assert any(d[1].fits and not d[0].fits for d in pairs)
    assert not any(k.mapping.fsdp for k in search(cfg, Options(a2a_overlap=True), c, gbs=2048,
                                                    seq=4096))


@pytest.mark.parametrize("mapping, tied, match", [
    (dict(world=8, tp=2, pp=4, ep=2), False, r"DP x CP = 1 x 1 = 1.*Fix: fsdp=0, or lower tp/pp"),
    (dict(world=8, tp=1, pp=2, ep=2), True,
     r"tied embedding split over pipeline stages.*Fix: fsdp=0, or pp=1"),
])
def test_plan_refuses_fsdp_where_train_does(mapping, tied, match):
    cfg = dataclasses.replace(model_config("mixtral_tiny"), tie_embeddings=tied)
    with pytest.raises(ConfigError, match=match) as err:
        check_model(cfg, Mapping(**mapping, fsdp=1, seq=256))
    assert str(err.value).startswith("--mapping fsdp=1")  # names the field the user gave
    check_model(cfg, Mapping(**mapping, seq=256))  # the same mapping without FSDP is valid


@pytest.mark.parametrize("world, degrees", [
    (8, dict(tp=2, pp=4, ep=2)),   # DP x CP = 1
    (8, dict(tp=1, pp=2, ep=2)),   # DP 4 over PP2
    (8, dict(tp=2, pp=1, cp=2, ep=2)),
    (4, dict(tp=2, cp=2)),         # DP 1, CP 2: shards over CP
    (2, dict(tp=2)),               # DP x CP = 1, one stage
    (8, dict(tp=1, pp=1, ep=8)),
])
@pytest.mark.parametrize("tied", [False, True])
def test_plan_fsdp_verdicts_are_trains(world, degrees, tied):
    """The planner's FSDP rules (memory.check_fsdp) twin two of moeplug train's
    (ParallelConfig.resolve's DP x CP > 1, config.modes.fsdp's tied embedding over PP): the
    same mappings go to both, so that the twins cannot drift apart."""
    from moeplug.plan.dry_run import run_config
    cfg = dataclasses.replace(model_config("mixtral_tiny"), tie_embeddings=tied)
    mp = Mapping(world=world, **degrees, seq=256)
    check_model(cfg, mp)  # valid without FSDP on both sides
    # fp32 weights: FSDP refuses bf16 parameters (its own mixed precision), a rule on options
    root = run_config("mixtral_tiny", None, mp,
                      Options(precision="fp32", distributed_optimizer=False))
    root.parallel.resolve(world)

    def verdict(check) -> bool:
        try:
            check()
        except ConfigError:
            return False
        return True

    def train():
        fsdp = dataclasses.replace(
            root, model=dataclasses.replace(root.model, tie_embeddings=tied),
            parallel=dataclasses.replace(root.parallel, fsdp=True))
        fsdp.parallel.resolve(world)

    assert verdict(lambda: check_model(cfg, dataclasses.replace(mp, fsdp=1))) == verdict(train)


def test_cli_search_prints_the_table_and_writes_the_png(run_cli, tmp_path):
    pytest.importorskip("matplotlib")  # the optional plot extra
    png = tmp_path / "search.png"
    r = run_cli("plan", "--preset", "qwen3_235b", "--cluster", "h100", "--gpus", "256",
                "--gbs", "2048", "--search", "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert "valid mappings fit the memory limit" in r.stdout
    assert "TFLOP/s" in r.stdout and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_mapping_prints_memory_and_step_breakdown(run_cli):
    # PP4 without VPP: moeplug train cannot split DeepSeek-V3's 61 layers into 4 x 4 chunks
    # of whole multiples (test_cli_plans_only_layer_splits_train_accepts).
    r = run_cli("plan", "--preset", "deepseek_v3", "--cluster", "gb300", "--gpus", "256",
                "--mapping", "tp=1,ep=64,pp=4", "--gbs", "8192", "--precision", "fp8",
                "--a2a-overlap")
    assert r.returncode == 0, r.stderr
    for word in ("weights + grads", "optimizer", "activations", "mla_up_proj", "all_to_all",
                 "pp_bubble", "TFLOP/s per GPU", "MFU"):
        assert word in r.stdout, word


def test_cli_token_budget_plans_sync_free_and_says_so(run_cli):
    args = ("plan", "--preset", "deepseek_v3", "--cluster", "h100", "--gpus", "256",
            "--mapping", "tp=1,ep=64,pp=4", "--gbs", "8192")
    plain, sf = run_cli(*args), run_cli(*args, "--token-budget", "1.25")
    assert plain.returncode == sf.returncode == 0, sf.stderr
    assert "levers: sync-free, token budget 1.25" in sf.stdout and "levers" not in plain.stdout

    def gb(out: str, part: str) -> float:
        return float(next(ln.split()[-1] for ln in out.splitlines()
                          if ln.strip().startswith(part)))
    # both printed to 0.1 GB: rounding moves the ratio's sides by up to 0.05 + 1.25 x 0.05
    assert gb(sf.stdout, "moe_fc1_out") == pytest.approx(1.25 * gb(plain.stdout, "moe_fc1_out"),
                                                         abs=0.115)


@pytest.mark.slow  # ~40 s alone: every op of four units is replayed and timed
def test_cli_config_on_cpu_calibrates_this_machine(run_cli, tiny_corpus, cache_dir, tmp_path):
    import yaml

    from conftest import tiny_config_dict
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tiny_corpus, str(tmp_path / "run"),
                                                    cache_dir)))
    r = run_cli("plan", "--config", str(path), "--cluster", "cpu")
    assert r.returncode == 0, r.stderr
    assert "calibrated cpu: peak" in r.stdout and "GEMM efficiency at the run's shapes" in r.stdout
    # a CPU's rate in GFLOP/s (it once read "TFLOP/s per GPU 0.0"), its MFU under 100 %
    import re
    rate, mfu = re.search(r"GFLOP/s per GPU (\S+)\s+MFU (\S+)%", r.stdout).groups()
    assert float(rate) > 0 and 0 < float(mfu) <= 100
    effs = re.search(r"GEMM efficiency at the run's shapes: (.*)", r.stdout).group(1)
    assert all(float(e.split()[1]) <= 1.0 for e in effs.split(", "))
    for part in ("gemm", "elementwise", "host", "optimizer", "unit moe", "unit head"):
        assert part in r.stdout, part


@pytest.mark.parametrize("args,field", [
    (["--cluster", "tpu"], "--cluster 'tpu'"),
    (["--mapping", "tp=two"], "--mapping"),
    (["--mapping", "tp=3"], "tp·cp·pp = 3"),
    (["--mapping", "ep=3"], "ep=3"),
    (["--mapping", "cp=0"], "(each >= 1)"),  # was a ZeroDivisionError traceback
    (["--preset", "nope"], "--preset 'nope'"),
    (["--recompute", "everything"], "--recompute everything"),
    (["--gpus", "0"], "--gpus 0"),
    (["--out", "x.png"], "--out x.png"),
    (["--precision", "fp4"], "--precision 'fp4'"),
    (["--token-budget", "-1"], "token_budget -1.0"),
    # Non-positive batch, sequence and device counts were planned (GBS -4 with a negative
    # MFU) or silently replaced by the defaults (0); a GBS that DP x MBS does not divide was
    # planned as "GBS 3 (1 micro-batches per DP rank)".
    (["--preset", "mixtral", "--gpus", "8", "--gbs", "-4"], "--gbs -4"),
    (["--preset", "mixtral", "--gpus", "8", "--gbs", "0"], "--gbs 0"),
    (["--preset", "mixtral", "--gpus", "8", "--seq", "0"], "--seq 0"),
    (["--preset", "mixtral", "--gpus", "8", "--seq", "-5"], "--seq -5"),
    (["--preset", "mixtral", "--gpus", "-1"], "--gpus -1"),
    (["--preset", "mixtral", "--gpus", "8", "--gbs", "-4", "--search"], "--gbs -4"),
    (["--preset", "mixtral", "--gpus", "8", "--gbs", "3"], "--gbs 3"),
    # 32 layers cannot fill PP4 x VPP9 = 36 virtual stages.
    (["--preset", "mixtral", "--gpus", "8", "--mapping", "pp=4,vpp=9"],
     "--mapping pp=4,vpp=9"),
    (["--preset", "mixtral", "--gpus", "8", "--mapping", "pp=2,layout=Etx|tL"],
     "--mapping layout=Etx|tL: column 3 ('x')"),
])
def test_cli_bad_input_exits_2_naming_the_field_and_fix(run_cli, args, field):
    r = run_cli("plan", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert field in r.stderr and "Fix:" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_bad_batch_and_sequence_say_which_values_work(run_cli):
    r = run_cli("plan", "--preset", "mixtral", "--gpus", "8", "--gbs", "12")
    assert r.returncode == 2 and "DP x micro-batch size = 8 x 1 = 8" in r.stderr
    assert "--gbs 8 or --gbs 16" in r.stderr
    r = run_cli("plan", "--preset", "mixtral", "--gpus", "8", "--mapping", "pp=2,mbs=2",
                "--gbs", "6")
    assert r.returncode == 2 and "= 4 x 2 = 8" in r.stderr and "--gbs 8" in r.stderr
    # --seq is its own flag: the line named "mapping seq=-5" and a --mapping fix
    r = run_cli("plan", "--preset", "mixtral", "--gpus", "8", "--seq", "-5")
    assert r.returncode == 2 and "--mapping" not in r.stderr and "e.g. --seq 4096" in r.stderr
    ok = run_cli("plan", "--preset", "mixtral", "--gpus", "8", "--gbs", "16")
    assert ok.returncode == 0, ok.stderr
    assert "GBS 16 (2 micro-batches per DP rank)" in ok.stdout


def test_plan_plans_every_split_train_runs_and_names_the_setting():
    """The plan once refused what moeplug train could not split with uneven first / last
    stages (Qwen3-235B's published PP8 x VPP4 among them). With Megatron's layouts train runs
    any pp·vpp <= num_layers: the plan proposes the even split, else uneven first / last
    stages, else a balanced layout string, and that setting, given to train's
    ParallelConfig, splits the layers as the plan planned them."""
    from moeplug.config import ConfigError, ParallelConfig
    from moeplug.plan.split import plan_layout
    for name in ("mixtral", "deepseek_v3", "qwen3_235b"):
        cfg = model_config(name)
        for pp in (1, 2, 3, 4, 8):
            for vpp in (1, 2, 3, 4, 5, 12):
                if pp == 1 and vpp > 1:
                    continue
                mp = Mapping(world=8 * pp, pp=pp, vpp=vpp)
                if pp * vpp > cfg.num_layers:
                    with pytest.raises(ConfigError, match="exceeds num_layers.*Fix"):
                        check_model(cfg, mp)
                    continue
                check_model(cfg, mp)
                layout, needs = plan_layout(cfg, mp)
                train = ParallelConfig(pp=pp, vpp=vpp if "pipeline_layout" not in needs else 1,
                                       **needs).layer_layout(cfg.num_layers, cfg.mtp_num_layers)
                assert train == layout, (name, pp, vpp, needs)
                assert layout.vpp == vpp and sum(layout.rank_layer_counts()) == cfg.num_layers
                if not needs:  # the even split, as Megatron makes it
                    assert len({len(s.layers) for s in layout.stages}) == 1


@pytest.mark.parametrize("row", [r for r in P26_ROWS + PF_ROWS if "not published" not in r.note],
                         ids=lambda r: r.label)
def test_every_published_mapping_is_planned_with_and_without_its_split(row):
    """`moeplug plan --mapping` takes every P26 and PF row's mapping, VPP included (the VPP
    rows were refused: no uneven first / last stage splits them), given its published split
    or not: then the plan proposes one train accepts (test above)."""
    from moeplug.plan.search import evaluate
    from moeplug.plan.split import plan_layout
    cfg, mp, opt, c = row_inputs(row)
    for m in (mp, dataclasses.replace(mp, layout=None)):
        cand = evaluate(cfg, m, opt, c)
        layout, needs = plan_layout(cfg, m)
        assert layout.vpp == row.vpp and cand.step.tflops_per_gpu > 0
        assert bool(needs) == (m.layout is None and cfg.num_layers % (row.pp * row.vpp) > 0)


def test_cli_uneven_layers_name_the_train_setting(run_cli):
    # 32 layers over PP4 x VPP3: no first / last stage split works, a layout does
    r = run_cli("plan", "--preset", "mixtral", "--gpus", "8", "--mapping", "pp=4,vpp=3")
    assert r.returncode == 0, r.stderr
    assert "pipeline layout Ett|(ttt|)*8tt|tt|ttL (layers per pipeline rank [8, 8, 8, 8])" \
        in r.stdout and "moeplug train needs parallel.pipeline_layout=Ett|(ttt|)*8tt|tt|ttL" \
        in r.stdout
    r = run_cli("plan", "--preset", "deepseek_v3", "--gpus", "256", "--mapping",
                "tp=1,ep=64,pp=4", "--gbs", "8192")
    assert r.returncode == 0, r.stderr
    assert "moeplug train needs parallel.num_layers_in_first_stage=16, " \
        "parallel.num_layers_in_last_stage=15" in r.stdout
    # the refusal: Qwen3-235B's published H100 mapping
    r = run_cli("plan", "--preset", "qwen3_235b", "--gpus", "256", "--mapping",
                "tp=2,pp=8,ep=32,vpp=4", "--gbs", "2048")
    assert r.returncode == 0, r.stderr
    assert "pipeline layout Ett|(ttt|)*30ttL (layers per pipeline rank [11, 12, 12, 12, 12, " \
        "12, 12, 11])" in r.stdout
    assert "moeplug train needs parallel.pipeline_layout=Ett|(ttt|)*30ttL" in r.stdout


def test_cli_plans_a_megatron_layout(run_cli):
    """--mapping ...,layout=STRING (last: Megatron's strings may hold commas) plans the stages
    the layout gives; its vpp is the layout's."""
    args = ("plan", "--preset", "deepseek_v3", "--cluster", "h100", "--gpus", "1024",
            "--precision", "fp8", "--gbs", "8192")
    r = run_cli(*args, "--mapping", "tp=1,pp=8,ep=64,layout=Et*3|(tt|)*29,m|L")
    assert r.returncode == 0, r.stderr
    assert "TP1 EP64 PP8 VPP4" in r.stdout and "moeplug train needs" not in r.stdout
    assert "pipeline layout Ettt|(tt|)*29m|L (layers per pipeline rank [9, 8, 8, 8, 8, 8, 6, " \
        "6])" in r.stdout
    bad = run_cli(*args, "--mapping", "tp=1,pp=8,ep=64,layout=Et*3|(tt|)*28m|L")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--mapping layout=Et*3|(tt|)*28m|L: has 31 virtual stages" in bad.stderr
    assert "Fix:" in bad.stderr
    bad = run_cli(*args, "--mapping", "tp=1,pp=8,ep=64,layout=Et*3|(tt|)*29t|L")
    assert bad.returncode == 2 and "has 62 transformer layers 't' but model.num_layers = " \
        "61" in bad.stderr
    bad = run_cli(*args, "--mapping", "layout=Et|tL,pp=2")
    assert bad.returncode == 2 and "layout=STRING as the last item" not in bad.stderr  # eaten
    bad = run_cli(*args, "--mapping", "pp=2,xlayout=Et|tL")
    assert bad.returncode == 2 and "as the last item" in bad.stderr


def test_layout_moves_the_embedding_loss_and_mtp_bytes_to_their_ranks():
    """A layout's stages are the planner's: the embedding-only first stage holds the
    embedding and no layer, the loss stage the head and the logits, the MTP stage its blocks,
    an embedding copy and no logits."""
    from moeplug.plan.split import rank_parts
    cfg = model_config("deepseek_v3")
    h, V = cfg.hidden_size, cfg.vocab_size
    mp = Mapping(world=256, pp=4, ep=64, gbs=8192, layout="E|t*30|t*31m|L")
    parts = rank_parts(cfg, mp)
    assert [len(p.layers) for p in parts] == [0, 30, 32, 0] and parts[2].mtp == 1
    assert [p.embedding for p in parts] == [True, False, True, False]
    weights = [stage_memory(cfg, mp, Options(), r) for r in range(4)]
    assert weights[0].weights_grads == pytest.approx(V * h * 6)   # bf16 weight + fp32 grad
    assert weights[3].weights_grads == pytest.approx((V * h + h) * 6)
    assert "logits" in weights[3].activations and "logits" not in weights[2].activations
    assert not weights[0].activations and not weights[3].activations.keys() - {"logits"}
    h100 = get_cluster("h100", 256)
    t = [perf.stage_seconds(cfg, mp, Options(), h100, r) for r in range(4)]
    assert t[0]["gemm"] == 0 and t[3]["gemm"] > 0 and t[2]["gemm"] > t[1]["gemm"]


def test_cli_search_png_without_matplotlib_exits_2_before_the_search(run_cli, cli_env,
                                                                     tmp_path):
    """--out without the plot extra ran the whole search, then exited 0 saying the PNG was
    skipped. Now it stops first, with the line `moeplug plot` gives for the missing extra."""
    site = tmp_path / "no_matplotlib_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    env = dict(cli_env, PYTHONPATH=str(site) + os.pathsep + cli_env.get("PYTHONPATH", ""))
    out = tmp_path / "x" / "y.png"
    r = run_cli("plan", "--preset", "mixtral", "--gpus", "8", "--search", "--out", str(out),
                env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "search:" not in r.stdout and not out.exists()
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert line.startswith(f"moeplug: configuration error: --out {out}: plotting needs "
                           "matplotlib") and 'Fix: pip install "moeplug[plot]"' in line


# ------------------------------------------------------------------ MFU on "this CPU"

TINY_MODELS = [
    dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64,
         first_k_dense=1, dense_ffn_hidden_size=64,
         moe=dict(num_experts=4, top_k=2, ffn_hidden_size=32)),
    dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=64,
         first_k_dense=1, dense_ffn_hidden_size=128,
         moe=dict(num_experts=8, top_k=3, ffn_hidden_size=48, shared_expert_ffn_hidden_size=64))]


def _tiny_units(model: dict, vocab: int = 256, shape=(8, 32)):
    """(config, {unit: GEMM FLOPs one forward + backward of it traced}) at ``shape``."""
    import torch

    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plan import calibrate_cpu as C
    from moeplug.plugin_host import PluginHost
    root = config_from_dict({"model": {**model, "vocab_size": vocab},
                             "train": {"seq_len": shape[1], "micro_batch_size": shape[0]}})
    host = PluginHost.load()
    torch.manual_seed(0)
    units = C._unit_fns(build_model(root, host, vocab), root,
                        host.create("precision", "fp32", {}), 1)
    flops = {}
    for name, make in units.items():
        fn = make(shape)
        fn()
        flops[name] = C._gemm_flops(C._run_traced(fn)[0])
    return root.model, flops


@pytest.mark.parametrize("model", TINY_MODELS)
def test_counted_flops_are_the_gemms_that_run(model):
    """The model FLOPs behind TFLOP/s and MFU (Megatron's count, moeplug.modules.flops) are
    the GEMMs a step runs, as the calibration traces them -- never more: an MFU above 100 %
    cannot come from the count. Apart from the attention core (timed as SDPA, not GEMMs) the
    count is the traced GEMMs less the router's (Megatron does not count it)."""
    from moeplug.modules.flops import attention_macs
    cfg, flops = _tiny_units(model)
    B, S = 8, 32
    traced = sum(flops["attn"] + flops["moe" if moe else "mlp"]
                 for moe in cfg.moe_layer_pattern) + flops["head"]
    core = 6 * cfg.num_layers * S * attention_macs(cfg)[1] * B * S
    counted = flops_per_token(cfg, cfg.vocab_size, S) * B * S - core
    router = 6 * sum(cfg.moe_layer_pattern) * cfg.hidden_size * cfg.moe.num_experts * B * S
    assert counted == pytest.approx(traced - router, rel=1e-9)


def test_cpu_peak_is_the_best_gemm_rate_measured_so_mfu_stays_under_100():
    """The finding: `moeplug plan --config SMALL.yaml --cluster cpu` printed MFU 118 %. Its
    peak was the 512^2 matmul alone, and the tiny model's own GEMMs, timed the same way, ran
    1.4-1.7x faster than it (on two threads, in process CPU time: the 512^2 matmul pays its
    threads' synchronisation, a small GEMM runs on one). The peak is now the best GEMM rate
    the calibration measured, so no unit's GEMMs beat it; the count being right (above), the
    MFU stays under 100 %. Here a unit's GEMMs at 1.6x the matmul, as measured then."""
    from moeplug.plan.calibrate_cpu import CpuCosts, UnitCost, bounded_peak
    from moeplug.plan.cluster import Cluster
    cfg, flops = _tiny_units(TINY_MODELS[0])
    matmul, fast = 60e9, 96e9  # FLOP/s per CPU second
    units = {n: UnitCost(gemm=f / fast, gemm_flops=f, elementwise=1e-5)
             for n, f in flops.items()}
    mp = Mapping(world=1, mbs=8, seq=32, gbs=8)

    def mfu(peak: float) -> float:
        costs = CpuCosts(units=units, links={}, collectives=[], optimizer_s_per_param=0.0,
                         peak_tflops=peak, matmul_tflops=matmul / 1e12)
        c = Cluster(name="cpu", peak_tflops={"fp32": peak}, hbm_gb=1, hbm_tbps=0.01,
                    nvlink_gbps=1, inter_gbps=1, nvlink_domain=1, gpus_per_node=1,
                    num_gpus=1, latency_us=1, generation="cpu", costs=costs)
        return perf.step_time(cfg, mp, Options(precision="fp32", param_bytes=4), c).mfu
    assert mfu(matmul / 1e12) > 1.05  # the old peak: the reported > 100 %
    peak = bounded_peak(matmul / 1e12, units)
    assert peak == pytest.approx(fast / 1e12)
    assert 0.5 < mfu(peak) <= 1.0
    both = CpuCosts(units=units, links={}, collectives=[], optimizer_s_per_param=0.0,
                    peak_tflops=peak, matmul_tflops=matmul / 1e12)
    assert all(both.mean(both).gemm_efficiency(u) <= 1 + 1e-9 for u in units)


def test_rates_print_at_a_scale_that_shows_them():
    from moeplug.plan import report
    from moeplug.plan.perf import StepTime
    cpu = report.step_text(StepTime(parts={"gemm": 1.0}, tflops_per_gpu=0.01234, mfu=0.2))
    assert "GFLOP/s per GPU 12.3   MFU 20.0%" in cpu and "TFLOP/s" not in cpu
    gpu = report.step_text(StepTime(parts={"gemm": 1.0}, tflops_per_gpu=368.04, mfu=0.37))
    assert "TFLOP/s per GPU 368.0" in gpu


# ------------------------------------------------------------------ moeplug's own CPU runs

CPU_MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
             "max_seq_len": 256, "first_k_dense": 1, "dense_ffn_hidden_size": 512,
             "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 256}}
FULL = {"granularity": "full"}
SELECTIVE = {"granularity": "selective", "modules": ["core_attn", "moe_act", "layernorm"]}
# name -> (ranks, parallel section, micro-batch, model.recompute). moeplug has no activation
# offload on CPU, so offload is not in the matrix.
CPU_MATRIX = {"single": (1, {}, 8, None),
              "single_recompute_full": (1, {}, 8, FULL),
              "single_recompute_selective": (1, {}, 8, SELECTIVE),
              "ep2_gloo": (2, {"ep": 2}, 8, None),
              "ep2_gloo_recompute_moe": (2, {"ep": 2}, 8, {"granularity": "selective",
                                                           "modules": ["moe"]}),
              "tp2_gloo": (2, {"tp": 2}, 8, None)}
# Two-rank layouts were under-predicted until 2026-11-23 (predicted/measured step time 0.78-0.94,
# they xfailed): the units were timed only at ep=1 / tp=1 shapes, and what the parallel wrappers
# run on top was not counted. Profiled on one rank of a real EP2 step (every aten op traced and
# replayed, against the units' ops x layers): +28 ms of the EP dispatcher's re-sort of received
# rows (index_select forward, index_add + new_zeros backward), +30-35 ms of the gradient sync's
# flatten / copy-back and the per-shard global norm (cat, copy_, _to_copy, pow, sum), and the
# dispatcher's Python. The plan now times the units on the rank's own parallel modules (their
# bytes still from the ep=1 / tp=1 units) and replays the grad sync's ops
# (moeplug.plan.calibrate_cpu._rank_unit_fns, _grad_sync_seconds). Measured after (max over
# ranks; one run of moeplug.plan.measure on these configs, then three of this test):
# EP2 0.91 / 0.89 / 0.93 / 1.00, EP2 + moe recompute 0.90 / 0.83 / 0.85 / 0.82, TP2 1.02 / 0.94
# / 0.91 / 0.92; one process in the same test runs 0.93 / 0.93, full recompute 0.92 / 0.94,
# selective 0.95 / 0.96. Every layout is now asserted at 20 %. Left under 1 (EP2 + moe
# recompute the lowest, 0.82-0.90, the closest to the bound): not ops -- the
# step's ops replayed now match the units' op for op, plus grad sync and optimizer -- nor
# collectives (their calls cost a rank 0.007-0.04 s CPU per step, measured inside a step; the
# links predict ~0.02-0.03). On one rank of that layout the step (0.85-0.90 s) exceeds its ops,
# kernels and the units' host by 0.13-0.21 s, and spends 0.28-0.41 s in system time (os.times;
# the mmap threshold is pinned, so every tensor from 128 KiB is a fresh mapping). Not located
# further (2026-11-23).


MEM_TOL = 0.10  # issue 12's target


def _unit_ops_local_and_on_rank(rank: int, world: int, data: dict) -> dict:
    """One rank of an EP2 layout: the aten ops of the MoE unit built alone at ep=1 shapes (what
    sizes the plan's bytes) and of the same unit on this rank's own modules (what times it)."""
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.parallel import ParallelGroups
    from moeplug.plan import calibrate_cpu as C
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    cfg = config_from_dict(data)
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    local = C._local_root(cfg, 1, 2)
    vocab = 256
    shape = (cfg.train.micro_batch_size, cfg.train.seq_len)

    def traced(fn):
        fn()
        with C._timed_kernels() as core:
            trace, _ = C._run_traced(fn)
        names = {f.overloadpacket.__name__ for f, *_ in trace.ops.values()}
        return names, core.calls.get("move_row_chunks", 0), trace.collectives
    local_ops, local_sorts, local_coll = traced(
        C._unit_fns(build_model(local, host, vocab), local, precision, 1)["moe"](shape))
    model = build_rank_model(cfg, host, vocab, groups)
    rank_ops, rank_sorts, rank_coll = traced(
        C._rank_unit_fns(model, cfg, precision, vocab, groups)["moe"](shape))
    _, grad_sync = C._step_collectives(cfg, model, vocab, groups, precision)
    return {"local": local_ops, "rank": rank_ops, "local_sorts": local_sorts,
            "rank_sorts": rank_sorts, "local_coll": local_coll,
            "rank_coll": [k for k, _ in rank_coll], "grad_sync": grad_sync}


def test_two_rank_units_are_timed_with_the_wrappers_work(tiny_corpus, cache_dir, tmp_path):
    """The two-rank gap of issue 12, located: the EP dispatcher re-sorts the rows it received
    (the runtime's move_row_chunks, forward and backward), which the ep=1 unit never runs; the
    unit the plan times on the rank's own modules runs it (and times it as a kernel), and its
    all-to-alls are left to the links."""
    from conftest import tiny_config_dict
    from moeplug.testing.distributed import run_distributed
    data = dict(tiny_config_dict(tiny_corpus, str(tmp_path / "run"), cache_dir),
                parallel={"ep": 2})
    for got in run_distributed(_unit_ops_local_and_on_rank, 2, data, timeout=300):
        # sort and unsort of the rows and their probs, forward and backward
        assert got["local_sorts"] == 0 and got["rank_sorts"] >= 4, (got["local_sorts"],
                                                                     got["rank_sorts"])
        assert not got["local_coll"] and "all_to_all" in got["rank_coll"]
        assert got["grad_sync"] > 0


def _measure_against_the_plan(name, world, par, mbs, recompute, tiny_corpus, cache_dir, run_dir,
                              cli_env) -> float:
    """One ``moeplug.plan.measure`` run of CPU_MATRIX[name] into ``run_dir``: asserts the peak
    memory and returns predicted / measured step time (max over ranks)."""
    import yaml
    out = run_dir
    model = dict(CPU_MODEL, **({"recompute": recompute} if recompute else {}))
    cfg = {"model": model, "data": {"corpus": tiny_corpus, "tokenizer": "bytes",
                                    "val_works": ["val_text"], "cache_dir": cache_dir},
           # lr 3e-4: at the default 3e-3 this model's routers collapse onto one expert within
           # eight steps (max/mean load 4.0), and the plan, like every estimator, assumes
           # routing near balance (moeplug.plan.memory; README "Planning a run").
           "train": {"steps": 12, "micro_batch_size": mbs, "seq_len": 256, "warmup_steps": 2,
                     "lr": 3e-4, "min_lr": 3e-5,
                     # one validation batch at the end: the comparison reads train steps only
                     "eval_interval": 0, "eval_batches": 1, "log_interval": 4,
                     "out_dir": str(out), "threads": 1,
                     "time_breakdown": False},
           "parallel": par}
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}"] if world > 1 else [sys.executable]
    env = dict(cli_env, OMP_NUM_THREADS="1")
    r = subprocess.run([*head, "-m", "moeplug.plan.measure", str(path)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [json.loads((out / f"measured_rank{k}.json").read_text()) for k in range(world)]
    for rank, g in enumerate(got):
        print(f"{name} rank {rank}: predicted/measured step time "
              f"{g['predicted_step_s'] / g['step_s']:.2f} ({g['predicted_step_s']:.3f} / "
              f"{g['step_s']:.3f} s), peak memory {g['predicted_memory'] / g['rss_delta']:.2f} "
              f"({g['predicted_memory'] / 1e6:.0f} / {g['rss_delta'] / 1e6:.0f} MB)")
    # Each rank predicted with its own calibration: the prediction of the slowest / fullest.
    time_ratio = max(g["predicted_step_s"] for g in got) / max(g["step_s"] for g in got)
    mem_ratio = max(g["predicted_memory"] for g in got) / max(g["rss_delta"] for g in got)
    print(f"{name}: step time {time_ratio:.2f}, peak memory {mem_ratio:.2f} (max over ranks)")
    # Issue 12 asks for 10 %. After the merge of the runtime branches this read 0.67-0.92:
    # the ops' workspace cache (moeplug.runtime.workspace, from 256 KiB) kept every buffer a step
    # freed, keyed by exact size, resident to the step's end, and the calibration's traced
    # peak missed the cache's buffers (handed out warm, never allocated under the trace).
    # The cache now never grows while it holds free bytes, and the plan counts its buffers
    # and what it keeps between units; measured after: 0.92-1.00 (README "Planning a run").
    assert abs(mem_ratio - 1) <= MEM_TOL, f"{name}: predicted/measured memory {mem_ratio:.2f}"
    return time_ratio


@pytest.mark.slow
@pytest.mark.serial  # predicted vs measured step time: nothing else may share the cores
@pytest.mark.parametrize("name", list(CPU_MATRIX))
def test_cpu_run_matches_the_calibrated_plan(name, tiny_corpus, cache_dir, tmp_path, cli_env):
    """Predicted step time within 20 % and peak memory within 10 % of a measured moeplug CPU
    run (moeplug.plan.measure), "this CPU" calibrated in the same processes just before and
    after the run (moeplug.plan.calibrate_cpu), from units, kernels, links and the optimizer
    timed alone -- never from the run's own step. The plan predicts balanced routing, i.e.
    the step of the slowest rank and the peak of the fullest one (the one that decides whether
    a mapping fits), so the largest measured value over the ranks is compared; every rank is
    printed."""
    world, par, mbs, recompute = CPU_MATRIX[name]
    for attempt in (1, 2):
        time_ratio = _measure_against_the_plan(name, world, par, mbs, recompute, tiny_corpus,
                                               cache_dir, tmp_path / f"{name}_{attempt}",
                                               cli_env)
        if abs(time_ratio - 1) <= 0.20:
            break
        # This host's speed drifts within minutes (shared cores): a calibration pair taken at
        # one speed and a run at another misses by that drift, not by the model. Measured
        # again once, both attempts printed; two misses in a row fail.
        print(f"{name}: attempt {attempt}: step time {time_ratio:.2f} outside 0.80-1.20")
    assert abs(time_ratio - 1) <= 0.20, f"{name}: predicted/measured step time {time_ratio:.2f}"


def test_measure_refuses_too_few_steps_before_any_run(tiny_corpus, cache_dir, tmp_path, cli_env):
    """plan.measure needs a memory half and a timed half of at least three steps each: fewer
    steps fail at once, naming the file, the field, its value and the fix, before any process
    group, warm-up or output exists."""
    import yaml
    from conftest import tiny_config_dict
    data = tiny_config_dict(tiny_corpus, str(tmp_path / "run"), cache_dir)
    data["train"]["steps"] = 4
    path = tmp_path / "few.yaml"
    path.write_text(yaml.safe_dump(data))
    r = subprocess.run([sys.executable, "-m", "moeplug.plan.measure", str(path)], env=cli_env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"{path}: train.steps is 4; set it to at least 6" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()
