"""Parallel layout: config validation, rank-group math (golden tables + invariants), real groups."""

from __future__ import annotations

import itertools
import math

import pytest

from moeplug.config import ConfigError
from moeplug.parallel import (GROUP_KINDS, ParallelConfig, ParallelGroups, layout_rank_groups,
                              rank_groups, validate_model)
from moeplug.testing.distributed import run_distributed

# --- golden tables, computed by hand from rank = sum idx_d * stride_d -------------------------

GOLDEN = [
    # world 8, TP2 EP4: dense rank = tp + 2·dp; expert rank = ep + 4·edp
    ("tp2-ep4", 8, dict(tp=2, ep=4, sequence_parallel=True), {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "cp": [[r] for r in range(8)],
        "pp": [[r] for r in range(8)],
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_dp_cp": [list(range(8))],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "etp": [[r] for r in range(8)],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep_etp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    }),
    # world 8, TP2 PP2 EP2: dense rank = tp + 2·dp + 4·pp; expert rank = ep + 2·edp + 4·pp
    ("tp2-pp2-ep2", 8, dict(tp=2, pp=2, ep=2, sequence_parallel=True), {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "ep_etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }),
    # world 8, CP2 EP2: dense rank = cp + 2·dp; expert rank = ep + 2·edp. The EP groups are the
    # CP groups: attention splits the sequence over the same ranks that split the experts.
    ("cp2-ep2", 8, dict(cp=2, ep=2), {
        "tp": [[r] for r in range(8)],
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp_cp": [list(range(8))],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }),
    # world 8, ETP2 EP2 (TP1): expert rank = etp + 2·ep + 4·edp
    ("etp2-ep2", 8, dict(etp=2, ep=2), {
        "tp": [[r] for r in range(8)],
        "dp": [list(range(8))],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "ep_etp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }),
]


@pytest.mark.parametrize("name, world, kw, golden", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_tables(name, world, kw, golden):
    tables = layout_rank_groups(ParallelConfig(**kw).resolve(world))
    for kind, want in golden.items():
        assert tables[kind] == want, kind


def test_rank_groups_matches_megatron_docstring_examples():
    # The two worked examples in Megatron's generate_masked_orthogonal_rank_groups docstring.
    assert rank_groups({"tp": 2, "pp": 2, "dp": 2}, "tp-pp-dp", ["dp"]) == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    groups = rank_groups({"tp": 2, "dp": 3, "pp": 4}, "tp-dp-pp", ["dp"])
    assert len(groups) == 8 and groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5]
    assert groups[7] == [19, 21, 23]


# --- invariants over every layout of small worlds ----------------------------------------------

def _layouts():
    for world in (1, 2, 4, 6, 8, 12, 16):
        divs = [d for d in range(1, world + 1) if world % d == 0]
        for tp, cp, pp, ep, etp in itertools.product(divs, repeat=5):
            if world % (tp * cp * pp) or world % (etp * ep * pp):
                continue
            try:
                yield world, ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp,
                                            sequence_parallel=True).resolve(world)
            except ConfigError:
                pass  # e.g. grids that disagree on PP: covered by its own test


def _coords(rank: int, sizes: dict, order: str) -> dict:
    """Independent reference: mixed-radix digits of `rank`, first name of `order` fastest."""
    out = {}
    for name in order.split("-"):
        rank, out[name] = divmod(rank, sizes[name])
    return out


def test_invariants_over_all_small_layouts():
    n = 0
    for world, p in _layouts():
        n += 1
        grids = {"dense": {"tp": p.tp, "cp": p.cp, "ep": 1, "dp": p.dp, "pp": p.pp},
                 "expert": {"tp": p.etp, "cp": 1, "ep": p.ep, "dp": p.edp, "pp": p.pp}}
        tables = layout_rank_groups(p)
        assert tables["pp"] == rank_groups(grids["expert"], p.order, ["pp"])
        for kind, (grid, mask) in GROUP_KINDS.items():
            groups = tables[kind]
            size = math.prod(grids[grid][m] for m in mask)
            # partition: every rank exactly once, all groups the same size
            assert sorted(r for g in groups for r in g) == list(range(world)), (p, kind)
            assert all(len(g) == size for g in groups), (p, kind)
            # same group <=> same coordinates on every dim outside the mask
            key = {}
            for g in groups:
                for r in g:
                    c = _coords(r, grids[grid], p.order)
                    key[r] = tuple(c[d] for d in c if d not in mask)
                assert len({key[r] for r in g}) == 1, (p, kind, g)
            assert len(set(key.values())) == len(groups), (p, kind)
    assert n > 100  # the sweep really covered many layouts


# --- validation errors -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, world, words", [
    (dict(tp=2, dp=3), 4, ["ParallelConfig.dp = 3", "TP·CP·DP·PP = 2·1·3·1 = 6 ≠ world size 4",
                           "Fix"]),
    (dict(etp=2, ep=4), 4, ["ParallelConfig.ep = 4", "ETP·EP·PP = 2·4·1 = 8 does not divide world "
                            "size 4", "Fix"]),
    (dict(tp=3), 4, ["cannot derive dp", "TP·CP·PP = 3·1·1 = 3 does not divide world size 4", "Fix"]),
    (dict(tp=2, ep=2), 4, ["ParallelConfig.sequence_parallel = False", "tp = 2 and ep = 2",
                           "Fix: set sequence_parallel: true"]),
    (dict(tp=2, pp=2, ep=4, sequence_parallel=True, order="tp-cp-ep-pp-dp"), 8,
     ["ParallelConfig.order = 'tp-cp-ep-pp-dp'", "different pipeline groups", "put 'pp' last"]),
])
def test_resolve_errors_print_the_failing_product(kw, world, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**kw).resolve(world)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("kw, words", [
    (dict(tp=0), ["ParallelConfig.tp = 0", "positive integer", "Fix"]),
    (dict(ep=True), ["ParallelConfig.ep = True", "Fix"]),
    (dict(dp=-1), ["ParallelConfig.dp = -1", "set dp to 0"]),
    (dict(order="tp-ep-dp-pp"), ["ParallelConfig.order = 'tp-ep-dp-pp'", "exactly once", "Fix"]),
    (dict(order="tp-cp-ep-dp-dp"), ["ParallelConfig.order", "exactly once"]),
    (dict(sequence_parallel="yes"), ["ParallelConfig.sequence_parallel = 'yes'", "bool"]),
])
def test_field_errors(kw, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**kw)
    for w in words:
        assert w in str(e.value)


def test_resolve_fills_derived_degrees_and_keeps_the_original():
    p = ParallelConfig(tp=2, pp=2, ep=4, sequence_parallel=True)
    r = p.resolve(16)
    assert (r.dp, r.edp, r.world_size) == (4, 2, 16)
    assert (p.dp, p.edp) == (0, 0)  # resolve returns a copy
    assert ParallelConfig(dp=4).resolve(4).dp == 4
    with pytest.raises(ConfigError, match="call pcfg.resolve"):
        layout_rank_groups(p)
    with pytest.raises(ConfigError, match="world size 0"):
        p.resolve(0)


_MODEL = dict(num_experts=8, num_heads=8, num_kv_heads=4, num_layers=4)


@pytest.mark.parametrize("pkw, mkw, words", [
    (dict(ep=4), dict(num_experts=6), ["num_experts 6 not divisible by EP 4", "ParallelConfig.ep",
                                       "Fix"]),
    (dict(tp=3), dict(num_heads=8), ["num_heads 8 not divisible by TP 3", "Fix"]),
    (dict(tp=8), dict(num_heads=8), ["num_kv_heads 4 not divisible by TP 8", "Fix"]),
    (dict(pp=2), dict(num_layers=4, vpp=4), ["num_layers 4 not divisible by PP·VPP = 2·4 = 8",
                                             "Fix"]),
    (dict(pp=3), dict(num_layers=4), ["num_layers 4 not divisible by PP·VPP = 3·1 = 3"]),
    (dict(etp=2), dict(ffn_hidden_size=7), ["ffn_hidden_size 7 not divisible by ETP 2"]),
    (dict(cp=2), dict(seq_len=6), ["seq_len 6 not divisible by 2·CP = 4", "Fix"]),
    (dict(cp=2, tp=2, sequence_parallel=True), dict(seq_len=12),
     ["seq_len 12 not divisible by 2·CP·TP = 8"]),
    (dict(), dict(vpp=0), ["vpp 0", "Fix"]),
])
def test_validate_model_errors(pkw, mkw, words):
    with pytest.raises(ConfigError) as e:
        validate_model(ParallelConfig(**pkw), **{**_MODEL, **mkw})
    for w in words:
        assert w in str(e.value)


def test_validate_model_accepts_even_splits():
    validate_model(ParallelConfig(tp=2, cp=2, pp=2, ep=4, etp=2, sequence_parallel=True),
                   **_MODEL, ffn_hidden_size=8, seq_len=16)


# --- real process groups ----------------------------------------------------------------------

def test_world_one_without_process_group_is_all_none():
    g = ParallelGroups.build(ParallelConfig(), world_size=1, rank=0)
    for kind in GROUP_KINDS:
        assert g.group(kind) is None and g.size(kind) == 1 and g.rank_in(kind) == 0
    assert g.config.dp == 1 and g.config.edp == 1


def test_build_errors_before_any_group():
    with pytest.raises(ConfigError, match="torch.distributed is not initialised.*Fix"):
        ParallelGroups.build(ParallelConfig(), world_size=2, rank=0)
    with pytest.raises(ConfigError, match="rank 2 is outside world size 2"):
        ParallelGroups.build(ParallelConfig(), world_size=2, rank=2)
    with pytest.raises(ConfigError, match="num_experts|ETP·EP·PP = 1·3·1 = 3"):
        ParallelGroups.build(ParallelConfig(ep=3), world_size=4, rank=0)
    with pytest.raises(KeyError, match="unknown group kind 'tpx'; known: tp, cp"):
        ParallelGroups.build(ParallelConfig(), world_size=1, rank=0).group("tpx")


_REAL_LAYOUTS = [dict(tp=2, ep=2, sequence_parallel=True), dict(cp=2, etp=2), dict(pp=2, ep=2)]


def _build_and_probe(rank, world):
    """Build each layout's groups, then ask every real group who is in it (an all_gather of
    global ranks), so the check does not trust the tables the groups were built from."""
    import torch
    import torch.distributed as dist
    seen = []
    for kw in _REAL_LAYOUTS:
        g = ParallelGroups.build(ParallelConfig(**kw), world, dist.get_rank())
        found = {}
        for kind in GROUP_KINDS:
            pg = g.group(kind)
            if pg is None:
                found[kind] = (rank,)
                continue
            out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(out, torch.tensor([rank]), group=pg)
            found[kind] = tuple(int(t) for t in out)
            assert dist.get_rank(pg) == g.rank_in(kind)
        seen.append(found)
    return seen


def test_real_groups_on_four_ranks_match_the_tables():
    got = run_distributed(_build_and_probe, 4, timeout=120)
    for i, kw in enumerate(_REAL_LAYOUTS):
        tables = layout_rank_groups(ParallelConfig(**kw).resolve(4))
        for rank in range(4):
            for kind in GROUP_KINDS:
                want = next(tuple(gr) for gr in tables[kind] if rank in gr)
                assert got[rank][i][kind] == want, (kw, rank, kind)
