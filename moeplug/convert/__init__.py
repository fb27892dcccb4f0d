"""Hugging Face <-> moeplug checkpoints: ``moeplug convert import | export``.

    import_hf(hf_dir, out_dir)  config.json + *.safetensors -> out_dir/step_000000 (the trainer's
                                checkpoint format, written by moeplug.training.checkpoint)
    export_hf(ckpt, out_dir)    a moeplug checkpoint (step or run directory) -> config.json +
                                model.safetensors that transformers' from_pretrained loads

One module per family (mixtral, qwen3_moe, deepseek_v3), each with config_from_hf,
config_to_hf, state_from_hf, state_to_hf, and HF_DEFAULTS / HF_ALIASES (config.json read as
transformers reads it) and UNREAD_HINTS (which field to blame for an HF tensor no weight takes:
import refuses to drop one); the shared renames and safe file handling live in
moeplug.convert.common. Only safetensors and JSON are ever read. The HF bos/eos/pad token ids
travel in the checkpoint's meta.json ("hf" section) from import to export; the HF directory's
tokenizer files (tokenizer.json, tokenizer_config.json, ...) travel in the checkpoint's
``tokenizer/`` folder, which a resume, ``generate`` and every later checkpoint use, and which
export writes back. :func:`import_notes` says what an import trains with (tokenizer, aux-loss
convention), as ``convert import`` prints it.
"""

from __future__ import annotations

import os
from types import ModuleType


from moeplug.config import Problems, RootConfig, config_from_dict
from moeplug.convert import deepseek_v3, mixtral, qwen3_moe
from moeplug.convert.common import (
    TOKEN_ID_KEYS, ConvertError, ReadTracker, check_all_read, hf_weight_files,
    read_generation_token_ids, read_hf_config, read_hf_weights, token_ids, write_hf_dir)

FAMILIES: dict[str, ModuleType] = {f.MODEL_TYPE: f for f in (mixtral, qwen3_moe, deepseek_v3)}


def family(model_type: str | None, source: str = "config.json model_type") -> ModuleType:
    """The converter of ``model_type``; ``source`` names where the value came from (config.json,
    --family, a checkpoint's meta.json) in the refusal."""
    names = ", ".join(sorted(FAMILIES))
    if model_type is None and source == "config.json model_type":
        raise ConvertError(f"config.json has no model_type (transformers needs it too, to pick "
                           f"the model class). Fix: add \"model_type\": one of {names}")
    if model_type not in FAMILIES:
        raise ConvertError(f"{source} = {model_type!r}: no converter. Fix: use one of {names}")
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
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    return build_model(cfg, PluginHost.load(block=cfg.plugins.block), vocab_size)


def load_hf_into_moeplug(hf_dir: str, experts: str = "grouped"):
    """(RootConfig, MoETransformer with the HF weights, model_type)."""
    cfg, model, fam, _ = _load_hf(hf_dir, experts)
    return cfg, model, fam.MODEL_TYPE


def _load_hf(hf_dir: str, experts: str):
    """(RootConfig, model with the HF weights, family module, config.json as the family's
    transformers class reads it)."""
    raw = read_hf_config(hf_dir)
    fam = family(raw.get("model_type"))  # before reading (possibly many GB of) weights
    hf = fam.read_config(raw)
    cfg = root_config_from_hf(raw, (), experts)  # config errors before the weights, too
    hf_sd = ReadTracker(read_hf_weights(hf_dir))
    if fam is deepseek_v3:  # whether MTP weights are present decides mtp_num_layers
        cfg = root_config_from_hf(raw, hf_sd, experts)
    model = build_from_config(cfg, cfg.model.vocab_size)
    sd = fam.state_from_hf(hf_sd, cfg.model)
    check_all_read(fam.FAMILY, hf, hf_sd, cfg.model, fam.UNREAD_HINTS,
                   getattr(fam, "ignored_weight", None))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Tied heads have no key of their own; anything else missing is a converter bug.
    missing = [k for k in missing if not (k == "head.weight" and cfg.model.tie_embeddings)]
    if missing or unexpected:
        raise ConvertError(f"{hf_dir!r}: converted weights do not fit the model (missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}). Fix: report this "
                           f"with the config.json")
    return cfg, model, fam, hf


def check_import_out(out_dir: str, overwrite: bool) -> None:
    """Refuse an ``--out`` that holds another run (what ``moeplug train`` refuses there too,
    moeplug.training.run_dir) unless ``overwrite``."""
    from moeplug.training.run_dir import refuse_file, run_artifacts
    refuse_file(out_dir, "--out")
    used = run_artifacts(out_dir)
    if used and not overwrite:
        shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
        raise ConvertError(f"--out {out_dir!r} already holds a run ({shown}); importing there "
                           f"would mix the imported checkpoint with that run's checkpoints and "
                           f"metrics. Fix: pass another --out, or --overwrite to replace that run")


def _preflight(hf_dir: str, out_dir: str, overwrite: bool, experts: str) -> None:
    """The cheap checks of an import, every problem reported at once (the first once hid the
    rest): --out, --experts, config.json and that safetensors files exist, before any weight
    is read."""
    from moeplug.plugin_host import PluginHost
    problems = Problems()
    attempt = problems.attempt
    attempt(check_import_out, out_dir, overwrite)
    attempt(PluginHost.load().require, "experts", experts)
    raw = attempt(read_hf_config, hf_dir)
    cfg = None
    if raw is not None:
        cfg = attempt(root_config_from_hf, raw, (), experts)
    tok = attempt(hf_tokenizer, hf_dir)
    if cfg is not None and tok is not None:
        attempt(cfg.model_vocab_size, tok.vocab_size, f"--hf {hf_dir!r}'s tokenizer.json")
    attempt(hf_weight_files, hf_dir)
    problems.raise_all(ConvertError)


def hf_tokenizer(hf_dir: str):
    """The HF directory's tokenizer (moeplug.data.tokenizer.HFTokenizer), or None when it holds
    no tokenizer.json (an import of the model alone: the training run names a tokenizer)."""
    from moeplug.data.tokenizer import TOKENIZER_JSON, HFTokenizer
    if not os.path.isfile(os.path.join(hf_dir, TOKENIZER_JSON)):
        return None
    return HFTokenizer.load(hf_dir, field="--hf")


def import_hf(hf_dir: str, out_dir: str, experts: str = "grouped", overwrite: bool = False) -> str:
    """Write the HF model as a step-0 moeplug checkpoint in ``out_dir``; returns its path.

    An ``out_dir`` holding another run is refused unless ``overwrite``, which removes that run's
    checkpoints, ``latest`` and metrics (moeplug.training.run_dir.clear_run) once the model has
    been converted, so a failed import leaves it intact. The HF token ids (config.json, and
    generation_config.json where present) travel in meta.json's ``hf`` section for export."""
    from moeplug.training.run_dir import lock_run_dir, release_run_dirs
    _preflight(hf_dir, out_dir, overwrite, experts)
    if not os.path.isdir(out_dir):  # a new directory: no run can be live there
        return _import_into(hf_dir, out_dir, experts, overwrite)
    # a live training run there holds the lock: an --overwrite must not clear it underneath
    lock_run_dir(out_dir, "--out")
    try:
        return _import_into(hf_dir, out_dir, experts, overwrite)
    finally:
        release_run_dirs()


def _import_into(hf_dir: str, out_dir: str, experts: str, overwrite: bool) -> str:
    from moeplug.training.checkpoint import save_checkpoint
    from moeplug.training.optim import build_optimizer, lr_at
    from moeplug.training.run_dir import clear_run
    from moeplug.training.checkpoint import TOKENIZER_DIR, step_dir_name
    cfg, model, fam, hf = _load_hf(hf_dir, experts)
    tok = hf_tokenizer(hf_dir)
    generation = read_generation_token_ids(hf_dir)
    hf_meta = {"model_type": fam.MODEL_TYPE, "source": os.path.abspath(hf_dir),
               "token_ids": token_ids(hf)}
    if generation is not None:
        hf_meta["generation_token_ids"] = generation
    plugins = {k: getattr(cfg.plugins, k) for k in ("router", "dispatcher", "experts", "precision")}
    if overwrite:
        clear_run(out_dir)
    config = cfg.to_dict()
    extra = {}
    if tok is not None:  # the run resumed from here trains with it (moeplug.training.resume)
        config["data"]["tokenizer"] = os.path.abspath(
            os.path.join(out_dir, step_dir_name(0), TOKENIZER_DIR))
        extra["tokenizer"] = tok.fingerprint()
    # The trainer's own optimizer (empty state), so `train --resume` accepts the checkpoint.
    return save_checkpoint(out_dir, 0, model, build_optimizer(model, cfg.train), {
        "config": config, "plugins": plugins,
        "metrics": {"tokens_seen": 0, "train_seconds": 0.0},
        "scheduler": {"step": 0, "lr": lr_at(0, cfg.train)}, "hf": hf_meta,
        "model_vocab_size": cfg.model.vocab_size, **extra},
        tokenizer_files=tok.hf_files() if tok is not None else None)


def import_notes(hf_dir: str, ckpt: str) -> list[str]:
    """What an import trains with, one line each (``convert import`` prints them): its
    tokenizer, and the aux-loss convention, which is not transformers' (README "Fine-tuning
    an import")."""
    from moeplug.routing.pooled import HF_AUX_LOSS
    from moeplug.training.checkpoint import carried_tokenizer, read_meta, saved_config
    meta = read_meta(ckpt)
    cfg = saved_config(ckpt, meta)
    raw = read_hf_config(hf_dir)
    lines = []
    carried = carried_tokenizer(ckpt, meta)
    if carried is None:
        lines.append(f"tokenizer: none imported ({hf_dir} holds no tokenizer.json); name one "
                     f"when training: --set data.tokenizer=PATH (a Hugging Face tokenizer "
                     f"directory), or the model trains on moeplug's own BPE ids")
    else:
        from moeplug.data.tokenizer import HFTokenizer
        tok = HFTokenizer.load(carried)
        frame = (f"EOS id {tok.eos_id} appended to every document" if tok.eos_id is not None
                 else "no EOS: documents joined by a blank line")
        if tok.add_bos:
            frame += f", BOS id {tok.bos_id} before it"
        lines.append(f"tokenizer: imported ({tok.vocab_size} ids, {frame}); fine-tune with "
                     f"moeplug train --out {os.path.dirname(ckpt)} --resume auto --set "
                     f"data.corpus=DIR")
    opts = cfg.plugins.router_options
    types = opts.get("load_balancing_type", "aux_loss")
    types = [types] if isinstance(types, str) else list(types)
    moe_layers, k = sum(cfg.model.moe_layer_pattern), cfg.model.moe.top_k
    coeff = opts.get("aux_loss_coeff")
    coeff = cfg.model.moe.aux_loss_coeff if coeff is None else coeff
    if raw.get("model_type") == deepseek_v3.MODEL_TYPE:
        lines.append(f"aux loss: trains as DeepSeek-V3 was trained: the sequence-wise aux loss "
                     f"(seq_aux_loss, coefficient {coeff}) and the aux-loss-free expert-bias "
                     f"update (bias_update_rate {opts.get('bias_update_rate', 1e-3)}); "
                     f"transformers' DeepseekV3ForCausalLM trains with neither. Without them: "
                     f"--set plugins.router_options.load_balancing_type=none --set "
                     f"plugins.router_options.bias_update_rate=0")
    elif "aux_loss" in types and coeff:
        on = bool(raw.get("output_router_logits", False))
        lines.append(f"aux loss: Megatron's convention, one load-balancing loss per MoE layer "
                     f"summed over the {moe_layers} layers, coefficient {coeff} (config.json "
                     f"router_aux_loss_coef); transformers pools every layer into one loss, "
                     f"about top_k / layers = {k}/{moe_layers} of this sum, and applies it only "
                     f"with output_router_logits (config.json: {str(on).lower()}). To train as "
                     f"transformers does: --set plugins.router_options.load_balancing_type="
                     f"{HF_AUX_LOSS if on else 'none'}")
    return lines


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
    """Write ``ckpt`` (a step directory, or a run directory: its newest) as an HF directory.

    ``model_type`` (``--family``): the family to write; default the imported one, else guessed.
    The token ids an import recorded go to config.json and generation_config.json; a model
    trained here with a Hugging Face tokenizer takes that tokenizer's; one trained with
    moeplug's own has none, written as null (the family's defaults, e.g. Mixtral's eos 2, would
    belong to another tokenizer). The tokenizer files the checkpoint carries are written beside
    the weights, so AutoTokenizer.from_pretrained(out_dir) loads them too."""
    from moeplug.training.checkpoint_meta import HF_ORIGIN
    from moeplug.training.checkpoint import (LATEST, CheckpointError, META_FILE, carried_tokenizer,
                                             find_checkpoint,
                                             load_checkpoint, read_meta, saved_config)
    path = find_checkpoint(ckpt) if ckpt else None
    if path is None:
        raise CheckpointError(f"--ckpt {ckpt!r}: no checkpoint there (expected a directory with "
                              f"{META_FILE}, or a run directory with '{LATEST}' or step_* "
                              f"checkpoints). Fix: pass a checkpoint or run directory written by "
                              f"moeplug train or moeplug convert import")
    meta = read_meta(path)
    cfg = saved_config(path, meta)
    if cfg is None:
        raise CheckpointError(f"--ckpt {ckpt!r}: {META_FILE} stores no 'config', so the model "
                              f"cannot be rebuilt for export. Fix: export a checkpoint written by "
                              f"moeplug train or moeplug convert import")
    # an import's record, or (a run resumed from one) the one its checkpoints carry on
    hf_meta = meta.get("hf") or meta.get(HF_ORIGIN) or {}
    if model_type is not None:
        fam = family(model_type, "--family")
    elif hf_meta.get("model_type"):
        fam = family(hf_meta["model_type"], f"{os.path.join(path, META_FILE)} hf.model_type")
    else:
        fam = family(guess_model_type(cfg), "the guessed family")
    vocab = _vocab_size(path, meta)
    hf_config = fam.config_to_hf(cfg, vocab)  # refuses what the family cannot express, early
    # Token ids: an import's; none for a model trained here (null, not the family's defaults,
    # which belong to another tokenizer); an import older than this record: left to HF's
    # defaults, as before.
    carried = carried_tokenizer(path, meta)
    generation = None
    if "token_ids" in hf_meta or not hf_meta:
        ids = {k: (hf_meta.get("token_ids") or {}).get(k) for k in TOKEN_ID_KEYS}
        if not hf_meta and carried is not None:  # trained here with an HF tokenizer: its ids
            from moeplug.data.tokenizer import HFTokenizer
            tok = HFTokenizer.load(carried)
            ids.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
        hf_config.update(ids)
        generation = hf_meta.get("generation_token_ids") or ids
    model = build_from_config(cfg, vocab)
    load_checkpoint(path, model, optimizer=None, restore_rng=False)
    sd = {k: v for k, v in model.state_dict().items()}
    write_hf_dir(out_dir, hf_config, fam.state_to_hf(sd, cfg.model), generation)
    write_tokenizer_files(out_dir, carried)
    return out_dir


def write_tokenizer_files(out_dir: str, carried: str | None) -> None:
    """The checkpoint's tokenizer files into ``out_dir``; tokenizer files an earlier export left
    there and this one lacks are removed (AutoTokenizer would load a stale tokenizer)."""
    import shutil
    from moeplug.data.tokenizer import TOKENIZER_FILES
    names = set(os.listdir(carried)) if carried is not None else set()
    for name in TOKENIZER_FILES:
        target = os.path.join(out_dir, name)
        if name in names:
            shutil.copyfile(os.path.join(carried, name), target)
        elif os.path.isfile(target):
            os.remove(target)


__all__ = ["ConvertError", "FAMILIES", "export_hf", "import_hf", "load_hf_into_moeplug",
           "root_config_from_hf"]
