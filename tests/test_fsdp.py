"""FSDP2 (``parallel.fsdp``, moeplug.parallel.fsdp): what it refuses before any process group
exists, and what it leaves on each rank. The layouts' equality with one process is proven in
tests/test_parallel_train.py (the ``fsdp_*`` rows)."""

from __future__ import annotations

import pytest

from moeplug.config import ConfigError, config_from_dict

TINY_MODEL = {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
              "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}}


def _cfg(parallel: dict, **sections):
    model = {**TINY_MODEL, **sections.pop("model", {})}
    train = {"seq_len": 8, **sections.pop("train", {})}
    return config_from_dict({"model": model, "train": train, "parallel": parallel, **sections})


# (parallel section, other sections, what the one-line error must name)
REFUSED = {
    "zero1": ({"fsdp": True, "distributed_optimizer": True}, {}, "distributed_optimizer"),
    "ep_overlap": ({"fsdp": True, "overlap_moe_expert_parallel_comm": True},
                   {"train": {"grad_accum_steps": 2}},
                   "overlap_moe_expert_parallel_comm"),
    "bf16_params": ({"fsdp": True}, {"train": {"param_dtype": "bf16"},
                                     "plugins": {"precision": "bf16"}}, "param_dtype"),
    "bf16_moments": ({"fsdp": True}, {"train": {"optimizer_dtype": "bf16"}}, "optimizer_dtype"),
    "sync_free": ({"fsdp": True}, {"runtime": {"sync_free": True}}, "runtime.sync_free"),
    "stash": ({"fsdp": True}, {"runtime": {"stash": True}}, "runtime.stash"),
    "delay_wgrad": ({"fsdp": True}, {"model": {"moe": {**TINY_MODEL["moe"],
                                                       "delay_wgrad_compute": True}},
                                     "plugins": {"experts": "grouped"}}, "delay_wgrad_compute"),
    "pp_tied": ({"fsdp": True, "pp": 2}, {"model": {"tie_embeddings": True}}, "tie_embeddings"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_fsdp_refuses_what_it_cannot_hold_in_one_line(name):
    parallel, sections, names = REFUSED[name]
    with pytest.raises(ConfigError) as e:
        _cfg(parallel, **sections)
    msg = str(e.value)
    assert msg.startswith("ParallelConfig.fsdp = True: "), msg
    assert "\n" not in msg and names in msg and "Fix: " in msg, msg


def test_fsdp_needs_data_parallel_ranks_to_shard_over():
    cfg = _cfg({"fsdp": True, "tp": 2})
    with pytest.raises(ConfigError, match=r"^ParallelConfig.fsdp = True: shards over DP·CP"):
        cfg.parallel.resolve(2)
    assert cfg.parallel.resolve(4).dp == 2  # DP2 x TP2 holds


def test_reshard_after_forward_alone_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"fsdp_reshard_after_forward = False: acts only with"):
        _cfg({"fsdp_reshard_after_forward": False})
    assert _cfg({"fsdp": True, "fsdp_reshard_after_forward": False}).parallel.fsdp


def test_fsdp_flags_must_be_booleans():
    with pytest.raises(ConfigError, match=r"ParallelConfig.fsdp = 'yes': must be a boolean"):
        _cfg({"fsdp": "yes"})


def test_cli_refuses_fsdp_with_zero1_before_launching(run_cli, tiny_config_file):
    r = run_cli("train", "--config", tiny_config_file(), "--set", "parallel.fsdp=true",
                "--set", "parallel.distributed_optimizer=true", "--nproc", "2", timeout=120)
    assert r.returncode == 2, r.stderr
    assert "ParallelConfig.fsdp = True: shards the AdamW state itself" in r.stderr
    assert "Traceback" not in r.stderr


def _bf16_runs(rank: int, world: int, parallel: dict) -> dict:
    """3 steps of the same bf16 run with and without FSDP: the losses, and the dtypes FSDP
    gathers and reduces in."""
    import numpy as np

    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)

    host = PluginHost.load()
    ids = np.random.default_rng(3).integers(0, 64, 2048).astype(np.int64)
    out = {}
    for name, extra in {"fsdp": {"fsdp": True}, "plain": {}}.items():
        cfg = _cfg({**parallel, **extra}, plugins={"precision": "bf16"},
                   train={"steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2,
                          "lr": 1e-2, "warmup_steps": 1, "seed": 7})
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        precision = host.create("precision", "bf16", {})
        seed_everything(7)
        model = build_rank_model(cfg, host, 64, groups)
        opt = build_rank_optimizer(model, cfg, groups)
        losses = [train_step(model, opt, step_batches(ids, cfg.train, s, groups), cfg.train,
                             precision, groups).loss for s in range(3)]
        policies = {str((m._get_fsdp_state()._mp_policy.param_dtype,
                         m._get_fsdp_state()._mp_policy.reduce_dtype))
                    for m in model.modules() if hasattr(m, "_get_fsdp_state")}
        out[name] = {"losses": losses, "policies": policies,
                     "param_dtypes": {str(p.dtype) for p in model.parameters()}}
    return out


@pytest.mark.parametrize("parallel", [{}, {"pp": 2}], ids=["dp2", "pp2"])
def test_bf16_recipe_gathers_bf16_reduces_fp32_and_trains_like_without_fsdp(parallel):
    from moeplug.testing.distributed import run_distributed
    world = 2 * parallel.get("pp", 1)
    for rank, r in enumerate(run_distributed(_bf16_runs, world, parallel, timeout=300)):
        assert r["fsdp"]["policies"] == {"(torch.bfloat16, torch.float32)"}, r
        assert r["fsdp"]["param_dtypes"] == {"torch.float32"}  # the shards: fp32 masters
        gap = max(abs(a - b) for a, b in zip(r["fsdp"]["losses"], r["plain"]["losses"]))
        # bf16 parameters in every op (norms too) against fp32 ones under autocast
        assert gap < 2e-2, (rank, r["fsdp"]["losses"], r["plain"]["losses"])


# 4-rank layouts whose checkpoint files FSDP must write as the same layout without FSDP does
FILE_LAYOUTS = {"dp2_tp2": {"tp": 2},
                "dp2_tp2_sp_ep2_etp2": {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 2},
                "pp2_dp2": {"pp": 2}}


def _checkpoint_files(rank: int, world: int, layouts: dict) -> dict:
    """Per layout: FSDP's and the plain run's model / optimizer tensors and manifests after 2
    steps of the same training, and whether an FSDP model loading FSDP's tensors holds them."""
    import numpy as np

    from moeplug.parallel import ParallelGroups
    from moeplug.parallel.fsdp import is_sharded
    from moeplug.plugin_host import PluginHost
    from moeplug.training import reshard
    from moeplug.training.checkpoint import (_load_model_state, _load_optimizer_state,
                                             _model_tensors, _optimizer_payload)
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.trainer import (build_rank_optimizer, seed_everything, step_batches,
                                          train_step)

    host = PluginHost.load()
    ids = np.random.default_rng(3).integers(0, 64, 2048).astype(np.int64)
    out = {}
    for name, parallel in layouts.items():
        saved = {}
        for kind, extra in (("fsdp", {"fsdp": True}), ("plain", {})):
            cfg = _cfg({**parallel, **extra}, train={"steps": 2, "micro_batch_size": 2,
                                                     "grad_accum_steps": 2, "lr": 1e-2,
                                                     "warmup_steps": 1, "seed": 7})
            groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
            precision = host.create("precision", "fp32", {})
            seed_everything(7)
            model = build_rank_model(cfg, host, 64, groups)
            opt = build_rank_optimizer(model, cfg, groups)
            for s in range(2):
                train_step(model, opt, step_batches(ids, cfg.train, s, groups), cfg.train,
                           precision, groups)
            tensors, param_groups = _optimizer_payload(opt)
            saved[kind] = {"model": _model_tensors(model), "optim": tensors,
                           "manifests": (reshard.model_manifest(model),
                                         reshard.optimizer_manifest(model, opt, groups))}
            if kind == "fsdp":  # load them into a fresh FSDP model and optimizer
                seed_everything(8)
                fresh = build_rank_model(cfg, host, 64, groups)
                fresh_opt = build_rank_optimizer(fresh, cfg, groups)
                _load_model_state("mem", fresh, saved[kind]["model"])
                _load_optimizer_state("mem", fresh_opt, tensors, param_groups, "mem")
                again, _ = _optimizer_payload(fresh_opt)
                model_back = _model_tensors(fresh)
                saved[kind]["round_trip"] = max(
                    [float((model_back[k] - v).abs().max()) for k, v in
                     saved[kind]["model"].items()]
                    + [float((again[k] - v).abs().max()) for k, v in tensors.items()])
                saved[kind]["sharded"] = sum(is_sharded(p) for p in fresh.parameters())
        out[name] = saved
    return out


def test_fsdp_checkpoint_files_are_those_of_the_same_layout_without_fsdp():
    from moeplug.testing.distributed import run_distributed
    for rank, per in enumerate(run_distributed(_checkpoint_files, 4, FILE_LAYOUTS,
                                               timeout=400)):
        for name, s in per.items():
            fsdp, plain = s["fsdp"], s["plain"]
            assert fsdp["manifests"] == plain["manifests"], (name, rank)
            for part in ("model", "optim"):
                assert fsdp[part].keys() == plain[part].keys(), (name, rank, part)
                for k, v in plain[part].items():
                    got = fsdp[part][k]
                    assert got.shape == v.shape and got.dtype == v.dtype, (name, k)
                    # the same training: equal up to the reduction order
                    assert float((got - v).abs().max()) < 2e-5, (name, rank, k)
            assert fsdp["sharded"] > 0 and fsdp["round_trip"] == 0.0, (name, rank, fsdp)
