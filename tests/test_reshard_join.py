"""The join of moeplug.training.reshard against the rules that cut the shards: a one-process
state dict cut for every rank of a TP2 x EP2 x ETP2 layout (moeplug.parallel.sharding, the rules
a parallel model is built with), written to real safetensors files with their manifests, is put
back together bit for bit — experts over EP and ETP (gate and up rows halved separately), TP
splits along their dim, replicas read once."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _full_state():
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.parallel.experts import expert_param_names
    from moeplug.plugin_host import PluginHost
    cfg = config_from_dict({"model": {"hidden_size": 16, "num_layers": 2, "num_heads": 2,
                                      "num_kv_heads": 2, "max_seq_len": 16, "first_k_dense": 1,
                                      "dense_ffn_hidden_size": 16,
                                      "moe": {"num_experts": 4, "ffn_hidden_size": 8}},
                            "train": {"seq_len": 8}})
    torch.manual_seed(0)
    model = build_model(cfg, PluginHost.load(), 32)
    return {k: v.clone() for k, v in model.state_dict().items()}, expert_param_names(model)


def test_tp2_ep2_etp2_shards_join_back_to_the_one_process_tensors(tmp_path):
    from moeplug.config import ParallelConfig
    from moeplug.parallel.expert_tp import etp_slice
    from moeplug.parallel.experts import local_expert_ids
    from moeplug.parallel.layout import layout_rank_groups
    from moeplug.parallel.sharding import tp_slice
    from moeplug.training.reshard import MANIFEST, SavedRanks

    full, experts = _full_state()
    assert {n.rpartition(".")[2] for n in experts} == {"gate_up_proj", "down_proj"}
    gate_up = next(n for n in experts if n.endswith("gate_up_proj"))
    assert full[gate_up].shape[1] == 2 * 8  # gated: the gate and up halves are cut apart
    tp_dims = {"embed.weight": 0, "head.weight": 0, "blocks.0.ffn.down_proj.weight": 1}
    assert set(tp_dims) <= set(full)
    world = 8
    layout = {"world_size": world, "tp": 2, "cp": 1, "dp": 4, "pp": 1, "ep": 2, "etp": 2,
              "order": "tp-cp-ep-dp-pp", "sequence_parallel": True}
    pc = ParallelConfig(tp=2, ep=2, etp=2, sequence_parallel=True).resolve(world)
    tables = layout_rank_groups(pc)

    def index(kind: str, r: int) -> int:
        return next(g.index(r) for g in tables[kind] if r in g)

    files = []
    for r in range(world):
        shard = {}
        for name, t in full.items():
            if name in experts:
                ids = local_expert_ids(t.shape[0], 2, index("ep", r))
                t = etp_slice(name, t[ids.start:ids.stop], full, index("etp", r), 2)
            elif name in tp_dims:
                t = tp_slice(t, tp_dims[name], index("tp", r), 2)
            shard[name] = t.contiguous()
        files.append(f"model_rank{r}.safetensors")
        save_file(shard, str(tmp_path / files[-1]), metadata={MANIFEST: json.dumps(
            {"experts": sorted(experts), "tp_dims": tp_dims})})
    handles = {f: safe_open(str(tmp_path / f), framework="pt") for f in files}
    saved = SavedRanks(layout, files, files, handles.__getitem__)
    for name, t in full.items():
        assert torch.equal(saved.model_tensor(name), t), name
    assert saved.model_tensor("no.such.tensor") is None
