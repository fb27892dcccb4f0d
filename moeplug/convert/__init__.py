"""Hugging Face <-> moeplug checkpoints: ``moeplug convert import | export``.

    import_hf(hf_dir, out_dir)  config.json + *.safetensors -> out_dir/step_000000 (the trainer's
                                checkpoint format, written by moeplug.training.checkpoint)
    export_hf(ckpt, out_dir)    a moeplug checkpoint (step or run directory) -> config.json +
                                model.safetensors that transformers' from_pretrained loads

One module per family (mixtral, qwen3_moe, deepseek_v3), each with config_from_hf,
config_to_hf, state_from_hf, state_to_hf; the shared renames and safe file handling live in
moeplug.convert.common. Only safetensors and JSON are ever read.
"""

from __future__ import annotations

import os
from types import ModuleType


from moeplug.config import RootConfig, config_from_dict
from moeplug.convert import deepseek_v3, mixtral, qwen3_moe
from moeplug.convert.common import ConvertError, read_hf_config, read_hf_weights, write_hf_dir

FAMILIES: dict[str, ModuleType] = {f.MODEL_TYPE: f for f in (mixtral, qwen3_moe, deepseek_v3)}


def family(model_type: str) -> ModuleType:
    if model_type not in FAMILIES:
        raise ConvertError(f"config.json model_type = {model_type!r}: no converter. Fix: use one "
                           f"of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def root_config_from_hf(hf: dict, hf_sd=(), experts: str = "grouped") -> RootConfig:
    """The RootConfig an imported model trains with (defaults for data/train)."""
    fam = family(hf.get("model_type"))
    args = (hf, hf_sd) if fam is deepseek_v3 else (hf,)
    data = fam.config_from_hf(*args)
    data["plugins"]["experts"] = experts
    data.setdefault("train", {})
    # An imported model's max_seq_len may be shorter than the trainer's default seq_len.
    data["train"]["seq_len"] = min(data["model"]["max_seq_len"], 128)
    data["train"].setdefault("warmup_steps", 0)
    return config_from_dict(data)


def build_from_config(cfg: RootConfig, vocab_size: int):
    from moeplug.modules import build_model
    from moeplug.plugin_host import PluginHost
    return build_model(cfg, PluginHost.load(block=cfg.plugins.block), vocab_size)


def load_hf_into_moeplug(hf_dir: str, experts: str = "grouped"):
    """(RootConfig, MoETransformer with the HF weights, model_type)."""
    hf = read_hf_config(hf_dir)
    fam = family(hf.get("model_type"))  # before reading (possibly many GB of) weights
    hf_sd = read_hf_weights(hf_dir)
    cfg = root_config_from_hf(hf, hf_sd, experts)
    model = build_from_config(cfg, cfg.model.vocab_size)
    sd = fam.state_from_hf(hf_sd, cfg.model)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Tied heads have no key of their own; anything else missing is a converter bug.
    missing = [k for k in missing if not (k == "head.weight" and cfg.model.tie_embeddings)]
    if missing or unexpected:
        raise ConvertError(f"{hf_dir!r}: converted weights do not fit the model (missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}). Fix: report this "
                           f"with the config.json")
    return cfg, model, fam.MODEL_TYPE


def import_hf(hf_dir: str, out_dir: str, experts: str = "grouped") -> str:
    """Write the HF model as a step-0 moeplug checkpoint in ``out_dir``; returns its path."""
    from moeplug.training.checkpoint import save_checkpoint
    from moeplug.training.optim import build_optimizer, lr_at
    cfg, model, model_type = load_hf_into_moeplug(hf_dir, experts)
    plugins = {k: getattr(cfg.plugins, k) for k in ("router", "dispatcher", "experts", "precision")}
    # The trainer's own optimizer (empty state), so `train --resume` accepts the checkpoint.
    return save_checkpoint(out_dir, 0, model, build_optimizer(model, cfg.train), {
        "config": cfg.to_dict(), "plugins": plugins,
        "metrics": {"tokens_seen": 0, "train_seconds": 0.0},
        "scheduler": {"step": 0, "lr": lr_at(0, cfg.train)},
        "hf": {"model_type": model_type, "source": os.path.abspath(hf_dir)}})


def _vocab_size(ckpt: str, meta: dict) -> int:
    """The embedding's rows, from a one-process checkpoint or the shards of any layout (a
    multi-process run writes no model.safetensors: export once died on it)."""
    from moeplug.training.checkpoint import saved_model_shape
    return saved_model_shape(ckpt, meta, "embed.weight")[0]


def guess_model_type(cfg: RootConfig) -> str:
    """The HF family a natively trained model fits best."""
    m = cfg.model
    if m.attention == "mla":
        return deepseek_v3.MODEL_TYPE
    if m.qk_norm:
        return qwen3_moe.MODEL_TYPE
    return mixtral.MODEL_TYPE


def export_hf(ckpt: str, out_dir: str, model_type: str | None = None) -> str:
    """Write ``ckpt`` (a step directory, or a run directory: its newest) as an HF directory."""
    from moeplug.training.checkpoint import (CheckpointError, META_FILE, load_checkpoint,
                                             read_meta, resolve_resume, saved_config)
    path = resolve_resume(ckpt, "")
    meta = read_meta(path)
    cfg = saved_config(path, meta)
    if cfg is None:
        raise CheckpointError(f"--ckpt {ckpt!r}: {META_FILE} stores no 'config', so the model "
                              f"cannot be rebuilt for export. Fix: export a checkpoint written by "
                              f"moeplug train or moeplug convert import")
    model_type = model_type or (meta.get("hf") or {}).get("model_type") or guess_model_type(cfg)
    fam = family(model_type)
    vocab = _vocab_size(path, meta)
    hf_config = fam.config_to_hf(cfg, vocab)  # refuses what the family cannot express, early
    model = build_from_config(cfg, vocab)
    load_checkpoint(path, model, optimizer=None, restore_rng=False)
    sd = {k: v for k, v in model.state_dict().items()}
    write_hf_dir(out_dir, hf_config, fam.state_to_hf(sd, cfg.model))
    return out_dir


__all__ = ["ConvertError", "FAMILIES", "export_hf", "import_hf", "load_hf_into_moeplug",
           "root_config_from_hf"]
