"""Megatron's pipeline layouts (moeplug.config.pipeline_layout, ParallelConfig.layer_layout)
against megatron-core 0.16.1's own code, which runs on the CPU:
  * the layout string grammar: ``PipelineParallelLayerLayout.parse_str_to_list`` on fixed and
    generated strings (both accept with the same stages, or both refuse);
  * placement: ``PipelineParallelLayerLayout`` + ``validate_layer_layout`` +
    ``get_layer_id_list`` (which layers, MTP blocks, embedding and loss each (rank, chunk)
    holds) on fixed and generated layouts;
  * the count rules: ``TransformerConfig`` (uneven first / last stages, the embedding / loss
    accounted in the split, VPP) + ``get_num_layers_to_build`` / ``get_transformer_layer_offset``
    over a grid;
  * the published P26 / PF rows' splits, as moeplug train loads them.
Where moeplug is stricter than Megatron it says so (an empty stage before the embedding or
after the loss: Megatron's flattened-order check lets it through, but builds the embedding and
loss on the first and last stage regardless). Then what the model split does with a layout
(single process), and the one-line errors at config load (exit 2).
"""

from __future__ import annotations


import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moeplug.config import ConfigError, ParallelConfig  # noqa: E402
from moeplug.config.pipeline_layout import (LayoutError, balanced_sizes,  # noqa: E402
                                            from_stage_sizes, layout_of_string, parse_layout)

mlayout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout",
                              reason="megatron-core (the test extra) is the reference")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.enums import LayerType  # noqa: E402

PPL = mlayout.PipelineParallelLayerLayout
LETTER = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m",
          LayerType.loss: "L"}
REFUSED = (AssertionError, ValueError, IndexError, KeyError, TypeError)

# The published layouts (megatron_moe.md; Megatron-MoE-ModelZoo best-practice/DeepSeekV3/run.sh)
PUBLISHED = [("Et*3|(tt|)*29m|L", 8, 61, 1), ("Et*3|(tt|)*29,m|L", 16, 61, 1),
             ("Et|(tt|)*30mL", 8, 61, 1), ("Et*4|(tttt|)*14tmL", 4, 61, 1),
             ("Et*2|(tt|)*22t|(tt|)*7mL", 8, 61, 1)]


@pytest.fixture(autouse=True)
def _megatron_vpp_world():
    yield  # get_layer_id_list reads the virtual pipeline size from parallel_state
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _megatron_parse(text: str):
    try:
        return [[LETTER[x] for x in stage] for stage in PPL.parse_str_to_list(text)]
    except REFUSED:
        return None


def _ours_parse(text: str):
    try:
        return [[c for c, _ in stage if c != "|"] for stage in parse_layout(text)]
    except LayoutError as e:
        assert "column" in e.rule and e.fix  # the refusal names where, and what to write
        return None


@pytest.mark.parametrize("text", [
    *(p[0] for p in PUBLISHED), "E|ttt|t|L", "Ett||tt|L", "(t)*2*3", "t**3", "|*3", "x*0Et",
    "E(t|)*0L", "Ett,t|t*1,2L", "((t|)*2)*3", "(tt)", "t*", "*3t", "E(tt|t", "Etx|tL", "",
    "E|t*10|L", "(E|t)*2L", "E(t,t|)*3L", "E)t(L", "3t"])
def test_parse_equals_megatron(text):
    assert _ours_parse(text) == _megatron_parse(text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="EtmL|()*,0123x", max_size=14))
def test_parse_equals_megatron_on_generated_strings(text):
    # (a run of 3+ digits would ask either parser for huge strings)
    assume(all(len(run) < 3 for run in "".join(c if c.isdigit() else " " for c in text).split()))
    assert _ours_parse(text) == _megatron_parse(text)


def _megatron_placement(text: str, pp: int, num_layers: int, mtp: int):
    """{(rank, chunk): (embedding, layer ids, MTP blocks, loss)} as Megatron builds them, or
    None when Megatron refuses the layout."""
    try:
        lay = PPL(text, pp)
        lay.validate_layer_layout(num_layers=num_layers, mtp_num_layers=mtp)
    except REFUSED:
        return None
    vpp = lay.virtual_pipeline_model_parallel_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    return {(r, c): (LayerType.embedding in lay.layout[r][c],
                     lay.get_layer_id_list(LayerType.decoder, vp_stage=c, pp_rank=r),
                     lay.layout[r][c].count(LayerType.mtp), LayerType.loss in lay.layout[r][c])
            for r in range(pp) for c in range(vpp)}


def _ours_placement(text: str, pp: int, num_layers: int, mtp: int):
    try:
        lay = layout_of_string(text, pp, num_layers=num_layers, mtp_num_layers=mtp)
    except LayoutError as e:
        assert e.fix
        return None
    return {(r, c): (s.embedding, list(s.layers), s.mtp, s.loss)
            for r in range(pp) for c, s in enumerate(lay.rank_stages(r))}


def _stricter_than_megatron(text: str) -> bool:
    """Megatron checks that the flattened layout starts with E and ends with L; moeplug also
    wants them in the first / last stage (where Megatron builds them anyway)."""
    stages = _megatron_parse(text)
    return not stages[0] or not stages[-1]


def _check_placement(text, pp, num_layers, mtp):
    want, got = _megatron_placement(text, pp, num_layers, mtp), \
        _ours_placement(text, pp, num_layers, mtp)
    if want is not None and got is None:
        assert _stricter_than_megatron(text), (text, pp, num_layers, mtp)
    else:
        assert got == want, (text, pp, num_layers, mtp)
    return got


@pytest.mark.parametrize("text,pp,num_layers,mtp", [
    *PUBLISHED, ("E|ttt|t|L", 2, 4, 0), ("E|ttt|t|L", 4, 4, 0), ("Ett|tt|m|L", 2, 4, 1),
    ("Et|ttt|m|L", 4, 4, 1), ("Ett||tt|L", 4, 4, 0), ("EttttmL", 1, 4, 1),
    # refusals: layer counts, MTP placement, stage count vs PP, E / L placement
    ("Et|t|t|L", 2, 4, 0), ("Ett|tt|m|L", 2, 4, 0), ("Ett|tm|t|L", 2, 4, 1),
    ("Et|tm|tt|L", 2, 4, 1), ("Ett|L|", 2, 3, 0), ("Ett|ttL", 3, 4, 0), ("tE|tttL", 2, 4, 0),
    ("EtLt|tt", 2, 4, 0), ("Et|tmm|t|tL", 2, 4, 2), ("Em|tt|m|ttL", 2, 4, 2)])
def test_placement_equals_megatron(text, pp, num_layers, mtp):
    _check_placement(text, pp, num_layers, mtp)


@st.composite
def _layouts(draw):
    pp, vpp = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    n = pp * vpp + draw(st.sampled_from([0, 0, 0, 1, -1]))
    stages = [draw(st.text(alphabet="tttm", max_size=3)) for _ in range(max(n, 1))]
    if draw(st.booleans()) or draw(st.booleans()):
        stages[0] = "E" + stages[0]
    if draw(st.booleans()) or draw(st.booleans()):
        stages[-1] += "L"
    text = "|".join(stages)
    return text, pp, text.count("t") + draw(st.sampled_from([0, 0, 0, 1])), \
        text.count("m") + draw(st.sampled_from([0, 0, 0, 1]))


@settings(max_examples=400, deadline=None)
@given(_layouts())
def test_placement_equals_megatron_on_generated_layouts(case):
    _check_placement(*case)


def test_layout_text_round_trips_through_megatrons_parser():
    """PipelineLayout.text() (what the planner and the errors print) parses, in Megatron, to
    the same stages."""
    layouts = [layout_of_string(t, pp, num_layers=n, mtp_num_layers=m)
               for t, pp, n, m in PUBLISHED]
    for n, mtp, pp, vpp in ((94, 0, 8, 4), (61, 1, 4, 4), (61, 1, 8, 4), (32, 0, 4, 3),
                            (5, 1, 2, 3), (3, 0, 4, 1)):
        layouts.append(from_stage_sizes(balanced_sizes(n, mtp, pp * vpp), pp, mtp))
    for lay in layouts:
        assert _megatron_parse(lay.text()) == [list(s.letters) for s in lay.stages], lay.text()
    assert layouts[0].text() == "Ettt|(tt|)*29m|L"


def test_balanced_sizes_fill_every_stage_and_count_the_mtp_blocks():
    assert balanced_sizes(94, 0, 32) == [2] + [3] * 30 + [2]
    assert balanced_sizes(61, 1, 16) == [3] + [4] * 14 + [2]     # last: 2 t + the MTP block
    assert balanced_sizes(4, 2, 4) == [1, 2, 1, 0]                # MTP heavier than its share
    for n, mtp, v in ((7, 0, 3), (61, 1, 32), (10, 3, 4), (1, 1, 2)):
        sizes = balanced_sizes(n, mtp, v)
        assert sum(sizes) == n and min(sizes) >= 0


# ------------------------------------------------------------------ the count rules

def _megatron_counts(num_layers, pp, vpp, first, last, emb, loss):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    try:
        cfg = TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=2,
            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
        out = {}
        for r in range(pp):
            for c in range(vpp):
                vp = c if vpp > 1 else None
                start = get_transformer_layer_offset(cfg, vp, r)
                n = get_num_layers_to_build(cfg, vp, r)
                assert n >= 0
                out[(r, c)] = list(range(start, start + n))
    except ZeroDivisionError:
        # get_transformer_layer_offset divides by the number of middle stages, which is 0
        # with first and last both set at PP2 and VPP: Megatron crashes on a split it accepted
        return "crash"
    except REFUSED:
        return None
    # Megatron does not check that the blocks tile the layers; a split that does not cannot run.
    ids = sorted(i for v in out.values() for i in v)
    return out if ids == list(range(num_layers)) else None


def _ours_counts(num_layers, pp, vpp, first, last, emb, loss):
    try:
        lay = ParallelConfig(pp=pp, vpp=vpp, num_layers_in_first_stage=first,
                             num_layers_in_last_stage=last,
                             account_for_embedding_in_pipeline_split=emb,
                             account_for_loss_in_pipeline_split=loss).layer_layout(num_layers)
    except ConfigError as e:
        assert "Fix:" in str(e) and len(e.errors) == 1
        return None
    return {(r, c): list(s.layers) for r in range(pp) for c, s in enumerate(lay.rank_stages(r))}


def test_count_rules_equal_megatron_over_a_grid():
    """Every split of num_layers_in_first/last_stage and account_for_embedding/loss_in_
    pipeline_split, with and without VPP, that Megatron's TransformerConfig accepts moeplug
    accepts with the same layers per (rank, chunk), and the other way round (moeplug also takes
    a first / last stage of 0 layers, which Megatron refuses: not in the grid, and the other
    ranks may be left with none)."""
    cases = checked = 0
    for n in (4, 5, 6, 7, 8, 12, 61, 94):
        for pp in (2, 3, 4, 8):
            for vpp in (1, 2, 3, 4):
                splits = [(f, la, False, False) for f in (None, 1, 2, 4) for la in (None, 1, 2, 4)]
                splits += [(None, None, True, False), (None, None, False, True),
                           (None, None, True, True), (2, None, True, False)]
                for split in splits:
                    want = _megatron_counts(n, pp, vpp, *split)
                    got = _ours_counts(n, pp, vpp, *split)
                    if want == "crash":
                        assert pp == 2 and vpp > 1 and None not in split[:2], (n, pp, vpp, split)
                        assert sorted(i for v in got.values() for i in v) == list(range(n))
                        continue
                    if want is None and got is not None:
                        # moeplug lets the ranks without a first / last count hold 0 layers
                        # (as a layout's empty stage); Megatron's count rules refuse that
                        assert [] in got.values() and split[2:] == (False, False), (n, pp, split)
                        continue
                    assert got == want, (n, pp, vpp, split, got, want)
                    cases += 1
                    checked += want is not None
    assert checked > 200 and cases - checked > 200  # both outcomes are well represented


# ------------------------------------------------------------------ config rules and errors

@pytest.mark.parametrize("kwargs,match", [
    ({"pp": 2, "pipeline_layout": "Et|tL", "num_layers_in_first_stage": 1},
     r"pipeline_layout = 'Et\|tL': says what every virtual stage holds, so "
     r"num_layers_in_first_stage cannot be set with it. Fix: unset"),
    ({"pp": 2, "pipeline_layout": "Et|tL", "account_for_loss_in_pipeline_split": True},
     r"so account_for_loss_in_pipeline_split cannot be set"),
    ({"pp": 2, "num_layers_in_last_stage": 1, "account_for_embedding_in_pipeline_split": True},
     r"account_for_embedding_in_pipeline_split = True: counts the embedding / loss in an even "
     r"split, which num_layers_in_last_stage replaces. Fix"),
    ({"pp": 2, "vpp": 2, "pipeline_layout": "Et|t|tL"},
     r"has 3 virtual stages \(2 '\|', the last from the '\|' at column 5\), but parallel.pp = 2 "
     r"x parallel.vpp = 2 needs 4. Fix: write 4 stages"),
    ({"pp": 1, "pipeline_layout": "Et|tL"}, r"need pipeline parallelism \(pp = 1\). Fix"),
    ({"pp": 2, "pipeline_layout": "Et|(tt|)*x|L"}, r"column 4 \('\('\): a parenthesised group"),
    # a typo'd count: Megatron's parser would build the string; refused, naming the count
    ({"pp": 2, "pipeline_layout": "Et|t*99999999999L"},
     r"column 6: the count 99999999999 repeats to more than 100,000 letters. Fix"),
])
def test_parallel_section_split_rules(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


def test_layout_sets_vpp_and_survives_resolve():
    pc = ParallelConfig(pp=8, pipeline_layout="Et*3|(tt|)*29m|L")
    assert pc.vpp == 4 and pc.resolve(256).vpp == 4  # resolve re-runs the checks on a copy
    assert ParallelConfig(pp=8, vpp=4, pipeline_layout="Et*3|(tt|)*29m|L").vpp == 4
    lay = pc.layer_layout(61, 1)
    assert lay.rank_layer_counts() == [9, 8, 8, 8, 8, 8, 6, 6]
    assert lay.mtp_stage == 30 and lay.embedding_ranks(tied=False) == [0, 6]
    assert pc.rank_layer_counts(61) == [9, 8, 8, 8, 8, 8, 6, 6]


def _train(run_cli, tmp_path, *sets: str):
    args = ["train", "--preset", "mixtral_tiny", "--out", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, timeout=120)


@pytest.mark.parametrize("sets,where", [
    # an unknown letter: its column
    (["parallel.pp=2", "parallel.pipeline_layout=Ett|tx|L"],
     "'Ett|tx|L': column 6 ('x'): 'x' is not a layer letter"),
    # the wrong number of layers (mixtral_tiny has 4): where the string ends, how many to add
    (["parallel.pp=2", "parallel.pipeline_layout=Ett|tL"],
     "has 3 transformer layers 't' but model.num_layers = 4. Fix: add 1 't' (the string ends "
     "at column 6)"),
    # stages that are not PP x VPP: the last boundary's column
    (["parallel.pp=2", "parallel.pipeline_layout=Et|t|ttL"],
     "has 3 virtual stages (2 '|', the last from the '|' at column 5), but parallel.pp = 2 "
     "needs a multiple of 2"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=Et|t|t|t|L",
      "train.grad_accum_steps=2"],
     "parallel.pp = 2 x parallel.vpp = 2 needs 4. Fix: write 4 stages"),
    # an MTP block the model does not have, and one after a layer
    (["parallel.pp=2", "parallel.pipeline_layout=Ett|ttmL"],
     "has 1 MTP blocks 'm' but model.mtp_num_layers = 0"),
    (["parallel.pp=2", "parallel.pipeline_layout=Ett|mttL", "model.mtp_num_layers=1"],
     "column 6: a transformer layer 't' after the MTP block at column 5"),
])
def test_malformed_layout_is_one_line_at_config_load(run_cli, tmp_path, sets, where):
    r = _train(run_cli, tmp_path, *sets)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.startswith("moeplug: configuration error: ParallelConfig.pipeline_layout = ")
    assert where in line and "Fix:" in line, line
    assert not (tmp_path / "run").exists()  # refused at config load: nothing written


# ------------------------------------------------------------------ the model split

def _model_cfg(**model):
    from moeplug.config import config_from_dict
    return config_from_dict({"model": {
        "hidden_size": 16, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1,
        "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
        "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}, **model},
        "train": {"seq_len": 8}})


@pytest.mark.parametrize("layout,pp,model,want", [
    # per rank, per chunk: (embedding?, layers, MTP blocks?, norm + head?)
    ("E|ttt|t|L", 2, {}, [[(1, [], 0, 0), (0, [3], 0, 0)], [(0, [0, 1, 2], 0, 0), (0, [], 0, 1)]]),
    ("Ett|tt|m|L", 2, {"mtp_num_layers": 1},
     [[(1, [0, 1], 0, 0), (1, [], 1, 0)], [(0, [2, 3], 0, 0), (0, [], 0, 1)]]),
    ("Ett|tt|m|L", 2, {"mtp_num_layers": 1, "tie_embeddings": True},
     [[(1, [0, 1], 0, 0), (1, [], 1, 0)], [(0, [2, 3], 0, 0), (1, [], 0, 1)]]),
    ("Et|ttt|m|L", 4, {"mtp_num_layers": 1},
     [[(1, [0], 0, 0)], [(0, [1, 2, 3], 0, 0)], [(1, [], 1, 0)], [(0, [], 0, 1)]]),
    ("Ett||tt|L", 4, {}, [[(1, [0, 1], 0, 0)], [(0, [], 0, 0)], [(0, [2, 3], 0, 0)],
                          [(0, [], 0, 1)]]),
])
def test_split_model_chunks_hold_what_the_layout_says(layout, pp, model, want):
    from moeplug.build import build_model
    from moeplug.parallelize.pipeline import split_model
    from moeplug.plugin_host import PluginHost
    cfg = _model_cfg(**model)
    pipe = ParallelConfig(pp=pp, pipeline_layout=layout)
    for rank in range(pp):
        chunks = split_model(build_model(cfg, PluginHost.load(), 64), pipe, pp, rank)
        got = [(int(hasattr(c, "embed")), [int(k) for k in c.blocks], int(len(c.mtp) > 0)
                if hasattr(c, "mtp") else 0, int(hasattr(c, "head"))) for c in chunks]
        assert got == want[rank], (rank, got)
        for c in chunks:  # a copy of the embedding away from rank 0 is counted once
            if hasattr(c, "embed"):
                assert getattr(c.embed.weight, "pipeline_copy", False) == (rank != 0)


def test_standalone_mtp_stage_hands_the_loss_stage_its_hidden_states():
    """One process, the PP4 layout Et|ttt|m|L run stage by stage: the MTP stage sends the main
    hidden state and the depth's normed hidden state along S, and the loss stage's losses are
    the whole model's."""
    from moeplug.build import build_model
    from moeplug.parallelize.pipeline import split_model
    from moeplug.plugin_host import PluginHost
    cfg = _model_cfg(mtp_num_layers=2)
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), 64)
    pipe = ParallelConfig(pp=4, pipeline_layout="Et|ttt|mm|L")
    chunks = [split_model(model, pipe, 4, r)[0] for r in range(4)]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 9), generator=g)
    tokens, targets = ids[:, :-1], ids[:, 1:]
    x = tokens
    for c in chunks[:3]:
        x = c(x, targets, tokens).x_BSD
    # the main hidden state and each depth's, all of the whole sequence (Megatron's rolled MTP)
    assert x.shape == (2, 8 * 3, 16) == chunks[3].activation_shape(tokens)
    out, want = chunks[3](x, targets, tokens), model(tokens, targets)
    torch.testing.assert_close(out.lm_loss, want.lm_loss, rtol=0, atol=0)
    torch.testing.assert_close(out.mtp_loss, want.mtp_loss, rtol=0, atol=0)


# ------------------------------------------------------------------ the published rows

def _row_config(row):
    """The row as a moeplug train config: the model, the published mapping and split."""
    from moeplug.config import config_from_dict
    from moeplug.plan.models import PLAN_MODELS
    from moeplug.config.presets import preset
    base = PLAN_MODELS[row.model] if row.model in PLAN_MODELS else preset(row.model)
    par = {"tp": row.tp, "pp": row.pp, "ep": row.ep, "vpp": row.vpp, "cp": row.cp,
           "sequence_parallel": row.tp > 1, **row.split}
    return config_from_dict({**{k: v for k, v in base.items() if k != "parallel"},
                             "parallel": par,
                             "train": {"seq_len": row.seq, "micro_batch_size": row.mbs,
                                       "grad_accum_steps": row.pp}})


def _rows():
    from moeplug.plan.models import P26_ROWS, PF_ROWS
    return [r for r in P26_ROWS + PF_ROWS if "not published" not in r.note]


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r.label)
def test_published_rows_load_as_train_configs_with_megatrons_split(row):
    """Every P26 row and PF's Mixtral row, with its published split (the DeepSeek-V3 layouts;
    Qwen3-235B's --account-for-embedding/loss-in-pipeline-split, Megatron-MoE-ModelZoo's
    model config), loads as a moeplug train config and resolves on its GPU count; the layers
    each (rank, chunk) holds are Megatron's. DeepSeek-V3 on H100 runs TP2 (+SP) with its MTP
    block: accepted, as MTP is tensor-parallel (tests/test_parallel_train.py's *_mtp rows)."""
    cfg = _row_config(row)
    assert cfg.parallel.tp == row.tp
    assert cfg.parallel.resolve(row.gpus).vpp == row.vpp
    m = cfg.model
    lay = cfg.parallel.layer_layout(m.num_layers, m.mtp_num_layers)
    got = {(r, c): list(s.layers) for r in range(row.pp) for c, s in enumerate(lay.rank_stages(r))}
    split = row.split
    if "pipeline_layout" in split:
        want = {k: v[1] for k, v in _megatron_placement(split["pipeline_layout"], row.pp,
                                                        m.num_layers, m.mtp_num_layers).items()}
    else:
        want = _megatron_counts(m.num_layers, row.pp, row.vpp, None, None,
                                split.get("account_for_embedding_in_pipeline_split", False),
                                split.get("account_for_loss_in_pipeline_split", False))
    assert got == want
