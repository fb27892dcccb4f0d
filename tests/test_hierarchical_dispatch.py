"""The hierarchical dispatcher on real gloo ranks: equal to alltoall (moeplug.testing.
dispatcher_parallel) at 2 nodes x 2 ranks, 4 nodes x 1, 1 node x 4, the launcher's
$LOCAL_WORLD_SIZE, on an EP subgroup, and at EP2; each token crosses the network once per
destination node; a bad node size fails before any process group exists.

Legend: T tokens, K top-k, E experts, N nodes, n EP ranks per node.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.testing.distributed import run_distributed

E, K = 8, 3


def _parity(rank: int, world: int, runs: list[tuple]) -> list[str]:
    """Each run: (dispatcher options, $LOCAL_WORLD_SIZE or None[, precision recipe]); returns
    what ran. Under a recipe with quantize_dispatch both dispatchers send FP8 rows + scales."""
    import contextlib
    import os

    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    from moeplug.quant import recipe_scope
    from moeplug.quant.wire import WIRE, reset_wire
    from moeplug.testing import tiny_model_config
    from moeplug.testing.dispatcher_parallel import _tokens, check_dispatcher_ep
    host = PluginHost.load()
    done = []
    for options, lws, *recipe in runs:
        if lws is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = lws
        scope = (recipe_scope(host.create("precision", recipe[0], {}).recipe) if recipe
                 else contextlib.nullcontext())
        reset_wire()
        with scope:  # D = 32: one MXFP8 block per row
            check_dispatcher_ep(host, "hierarchical", dist.group.WORLD, options=options,
                                model_cfg=tiny_model_config(num_experts=E, top_k=K,
                                                            hidden_size=32))
        # FP8 rows went out under the recipe (a rank without tokens sends none either way)
        assert (WIRE["rows"] > 0) == bool(recipe and _tokens(rank)), WIRE
        d = host.create("dispatcher", "hierarchical", options, _cfg(), dist.group.WORLD)
        from moeplug_plugins.dispatchers.intra_node import ShmIntraNode
        done.append(f"{d.split.num_nodes}x{d.split.node_size}"
                    f"{' shm' if isinstance(d.intra, ShmIntraNode) else ''}")
        # the subgroups time out with the EP group (run_distributed: 60 s), not torch's 30 min
        from moeplug_plugins.dispatchers._nodes import group_timeout
        for sub in (d.intra.group, d.inter):
            if sub is not None:
                assert group_timeout(sub) == group_timeout(dist.group.WORLD).__class__(seconds=60)
    return done


def _cfg():
    from moeplug.testing import tiny_model_config
    return tiny_model_config(num_experts=E, top_k=K)


def test_equals_alltoall_at_world4_every_node_split():
    runs = [({"node_size": 2}, None), ({"node_size": 1}, None), ({"node_size": 4}, None),
            ({}, None), ({}, "2"), ({"node_size": 2, "intra_node": "torch"}, None),
            ({"node_size": 4, "intra_node": "shm"}, None)]
    results = run_distributed(_parity, 4, runs, timeout=240)
    # the runs really had the splits they claim: 2 nodes of 2, 4 of 1, one of 4, none set
    # (no launcher: one node), and $LOCAL_WORLD_SIZE=2 (2 nodes of 2); inside a node of
    # several ranks the rows moved through the shared-memory heap unless intra_node=torch
    # (a node of one rank moves nothing)
    assert results == [["2x2 shm", "4x1", "1x4 shm", "1x4 shm", "2x2 shm", "2x2",
                        "1x4 shm"]] * 4


def test_equals_alltoall_at_world2():
    results = run_distributed(_parity, 2, [({"node_size": 1}, None), ({"node_size": 2}, None),
                                           ({"node_size": 1}, None, "mxfp8")], timeout=180)
    assert results == [["2x1", "1x2 shm", "2x1"]] * 2


def _subgroup_parity(rank: int, world: int) -> str:
    # EP groups {0, 2} and {1, 3} (strided, as with ETP2): the node subgroups are built from the
    # EP group's global ranks, and only by its members.
    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    from moeplug.testing.dispatcher_parallel import check_dispatcher_ep
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep = groups[rank % 2]
    check_dispatcher_ep(PluginHost.load(), "hierarchical", ep, options={"node_size": 1})
    return "ok"


def test_equals_alltoall_on_an_ep_subgroup():
    assert run_distributed(_subgroup_parity, 4, timeout=180) == ["ok"] * 4


def _network_rows(rank: int, world: int) -> dict:
    """Rows sent over the network by hierarchical vs rows alltoall sends to other nodes."""
    import torch.distributed as dist

    from moeplug.interfaces import RouterOutput
    from moeplug.plugin_host import PluginHost
    host = PluginHost.load()
    cfg = _cfg()
    hier = host.create("dispatcher", "hierarchical", {"node_size": 2}, cfg, dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank)
    T = 64
    ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    routing = RouterOutput(torch.rand(T, K, generator=gen), ids_TK, torch.zeros(()))
    d = hier.dispatch(torch.randn(T, 16, generator=gen), routing)
    node = rank // 2
    node_TK = ids_TK // (E // 2)               # 2 nodes of E/2 experts
    want = sum(len(set(row.tolist()) - {node}) for row in node_TK)  # distinct remote nodes
    flat = int((node_TK != node).sum())         # alltoall: one row per remote choice
    sent = d.meta.net.send_N
    return {"remote_rows": sent[1 - node], "local_rows": sent[node], "want": want, "flat": flat,
            "tokens_here": int((node_TK == node).any(dim=1).sum())}


def test_each_token_crosses_the_network_once_per_destination_node():
    for r in run_distributed(_network_rows, 4, timeout=120):
        assert r["remote_rows"] == r["want"]
        assert r["local_rows"] == r["tokens_here"]
        assert r["remote_rows"] < r["flat"]  # top-3 of 8 over 2 nodes: most tokens hit a node twice


# ---- the node split and its errors (no process group) -------------------------------------

def test_launcher_node_size_groups_ep_ranks_by_node():
    from moeplug_plugins.dispatchers._nodes import launcher_node_size, split
    assert launcher_node_size([0, 1, 2, 3], 2) == 2
    assert launcher_node_size([0, 2, 4, 6], 4) == 2      # ETP2: EP ranks strided by 2
    assert launcher_node_size([0, 1, 2, 3], 1) == 1
    assert launcher_node_size([4, 5, 6, 7], 8) == 4      # one node (the second one)
    s = split([0, 1, 2, 3, 4, 5], 4, 3)
    assert (s.num_nodes, s.node_size, s.node, s.local) == (2, 3, 1, 1)
    assert s.intra_ranks([0, 1, 2, 3, 4, 5]) == [3, 4, 5]
    assert s.inter_ranks([0, 1, 2, 3, 4, 5]) == [1, 4]


def test_launcher_node_size_refuses_uneven_nodes():
    from moeplug.config import ConfigError
    from moeplug_plugins.dispatchers._nodes import launcher_node_size
    with pytest.raises(ConfigError, match=r"\$LOCAL_WORLD_SIZE = 3: the EP group's ranks "
                                          r"\[0, 1, 2, 3\] fall on nodes \[0, 0, 0, 1\].*Fix: set "
                                          r"plugins.dispatcher_options.node_size"):
        launcher_node_size([0, 1, 2, 3], 3)
    with pytest.raises(ConfigError, match="not equal consecutive runs"):
        launcher_node_size([0, 4, 1, 5], 4)   # nodes 0, 1, 0, 1: interleaved


@pytest.mark.parametrize("node_size, ep, msg", [
    (3, 4, r"plugins.dispatcher_options.node_size = 3: does not divide parallel.ep = 4.*Fix: set "
           r"node_size to one of 1, 2, 4, or 0 to take \$LOCAL_WORLD_SIZE"),
    (2, 1, r"node_size = 2: does not divide parallel.ep = 1"),
    (-1, 4, r"node_size = -1: must be >= 0. Fix: set node_size"),
    ({"node_size": 2, "intra_node": "nvlink"}, 4,
     r"intra_node = 'nvlink': unknown. Fix: use 'auto', 'shm' or 'torch'"),
])
def test_bad_node_size_fails_before_any_process_group(node_size, ep, msg):
    import torch.distributed as dist

    from moeplug.cli import check_plugins
    from moeplug.config import config_from_dict
    from moeplug.plugin_host import PluginError, PluginHost
    options = node_size if isinstance(node_size, dict) else {"node_size": node_size}
    cfg = config_from_dict({"plugins": {"dispatcher": "hierarchical",
                                        "dispatcher_options": options},
                            "parallel": {"ep": ep}})
    with pytest.raises(PluginError, match=r"dispatcher 'hierarchical' \(from moeplug\).*" + msg):
        check_plugins(PluginHost.load(), cfg)
    assert not dist.is_initialized()


def test_good_node_size_passes_the_plugin_check():
    from moeplug.cli import check_plugins
    from moeplug.config import config_from_dict
    from moeplug.plugin_host import PluginHost
    cfg = config_from_dict({"plugins": {"dispatcher": "hierarchical",
                                        "dispatcher_options": {"node_size": 2}},
                            "parallel": {"ep": 4}})
    check_plugins(PluginHost.load(), cfg)


def test_cli_refuses_a_bad_node_size_before_launching_ranks(run_cli, tiny_config_file, tmp_path):
    cfg = tiny_config_file(str(tmp_path / "run"))
    proc = run_cli("train", "--config", cfg, "--nproc", "4", "--dispatcher", "hierarchical",
                   "--set", "parallel.ep=4", "--set", "plugins.dispatcher_options.node_size=3",
                   timeout=120)
    assert proc.returncode != 0
    assert "plugins.dispatcher_options.node_size = 3: does not divide parallel.ep = 4" \
        in proc.stderr, proc.stderr[-2000:]
    assert "torchrun" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_trains_2_nodes_x_2_ranks_like_alltoall(run_cli, tiny_config_file, tmp_path):
    # The whole path: the plugin check passes node_size 2 at parallel.ep 4, torchrun relaunches
    # 4 ranks, the dispatcher builds its node subgroups, and the logged losses are alltoall's.
    import json
    cfg = tiny_config_file(str(tmp_path / "unused"))
    common = ["--config", cfg, "--nproc", "4", "--steps", "3", "--set", "parallel.ep=4",
              "--set", "train.log_interval=1", "--set", "train.eval_interval=0"]
    losses = {}
    for name, extra in (("alltoall", []), ("hierarchical", [
            "--dispatcher", "hierarchical", "--set", "plugins.dispatcher_options.node_size=2"])):
        out = tmp_path / name
        proc = run_cli("train", *common, "--out", str(out), *extra, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses["alltoall"]) == 3
    assert max(abs(a - b) for a, b in zip(losses["alltoall"], losses["hierarchical"])) < 1e-5


def test_shm_intra_node_refuses_non_cpu_rows_naming_the_fix():
    """intra_node=shm moves CPU tensors only; rows elsewhere (here on the meta device, as CUDA
    rows would be) are refused before any heap op, naming the option to set."""
    from moeplug_plugins.dispatchers.intra_node import ShmIntraNode
    with pytest.raises(ValueError, match=r"moves CPU tensors; got rows on meta\. Fix: set "
                                         r"plugins\.dispatcher_options\.intra_node=torch"):
        ShmIntraNode(None, 1 << 20).move(torch.empty(2, 4, device="meta"), None, True)
