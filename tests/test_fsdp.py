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
