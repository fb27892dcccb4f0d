"""What a resume continues: the model and tokenizer a checkpoint was trained with.

``moeplug train --resume auto --out RUN`` (and ``--resume DIR``) takes what no ``--config``,
``--preset`` or ``--set`` gives from the checkpoint (:func:`from_checkpoint`): the model
section, the router and its options, the tokenizer (the checkpoint's own copy of a Hugging Face
tokenizer) and ``train.seq_len`` — so fine-tuning an import is one command,
``moeplug train --out IMPORT_DIR --resume auto --set data.corpus=...``. Whatever is given is
compared with the checkpoint (moeplug.training.checkpoint.check_resume, config.model_differences);
the tokenizer by what it encodes (:func:`check_tokenizer`): a resume whose tokenizer gives other
ids than the one the embedding was trained with, or more ids than it has rows, is refused
naming both, before any process group exists.
"""

from __future__ import annotations

import os
from typing import Any

from moeplug.config import RootConfig
from moeplug.training.checkpoint import META_FILE, CheckpointError, config_dict

# Taken from the checkpoint unless given: what defines the model (config.MODEL_DEFINING) and the
# context it was trained on (an import's may be shorter than the packaged default's).
TAKEN = ("model", "plugins.router", "plugins.router_options", "data.tokenizer",
         "data.vocab_size", "train.seq_len")
# meta.json: the embedding's rows (the padded vocabulary), recorded by the trainer
MODEL_VOCAB = "model_vocab_size"


def _get(data: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _put(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def from_checkpoint(path: str, meta: dict) -> dict:
    """The config fields a resume from checkpoint ``path`` takes from it (a nested mapping to
    merge *under* what the command gives). An import without a tokenizer of its own (its HF
    directory held no tokenizer.json) gives none: the run's data config names one."""
    saved = config_dict(path, meta)
    if saved is None:
        return {}
    out: dict = {}
    no_tokenizer = meta.get("hf") is not None and _get(saved, "data.tokenizer") in ("bpe", "bytes")
    for dotted in TAKEN:
        if no_tokenizer and dotted.startswith("data."):
            continue
        value = _get(saved, dotted)
        if value is not None:
            _put(out, dotted, value)
    rows = meta.get(MODEL_VOCAB)
    if isinstance(out.get("model"), dict) and not out["model"].get("vocab_size") and rows:
        # The rows the embedding has, whatever padding rule made them (a resume under another
        # make_vocab_size_divisible_by or TP keeps the model's shape).
        out["model"]["vocab_size"] = rows
    return out


def check_tokenizer(path: str, meta: dict, cfg: RootConfig, tokenizer: Any) -> None:
    """Refuse (CheckpointError naming both) a tokenizer other than the one checkpoint ``path``
    was trained with, or one with more ids than its embedding has rows."""
    want = meta.get("tokenizer")
    saved = config_dict(path, meta) or {}
    if want is not None and tokenizer.fingerprint() != want:
        raise CheckpointError(_mismatch(path, saved, cfg))
    rows = meta.get(MODEL_VOCAB) or _get(saved, "model.vocab_size")
    if not rows:
        return  # an older checkpoint: its embedding's shape is checked when it loads
    if tokenizer.vocab_size > rows:
        raise CheckpointError(
            f"DataConfig.tokenizer = {cfg.data.tokenizer!r}: its {tokenizer.vocab_size} token "
            f"ids exceed the {rows} embedding rows of checkpoint {path!r}, so ids >= {rows} "
            f"would have no row. Fix: resume with the tokenizer the model was trained with "
            f"(leave data.tokenizer out: a resume takes the checkpoint's), or start a new run "
            f"in another --out")
    built = cfg.model_vocab_size(tokenizer.vocab_size)
    if built != rows:
        raise CheckpointError(
            f"ModelConfig.vocab_size = {cfg.model.vocab_size}: this run would build {built} "
            f"embedding rows (the tokenizer's {tokenizer.vocab_size} ids, padded to a multiple "
            f"of model.make_vocab_size_divisible_by = {cfg.model.make_vocab_size_divisible_by})"
            f" but checkpoint {path!r} has {rows}. Fix: --set model.vocab_size={rows}, or "
            f"leave model.vocab_size out (a resume takes the checkpoint's)")


def _mismatch(path: str, saved: dict, cfg: RootConfig) -> str:
    before = _get(saved, "data.tokenizer")
    now = cfg.data.tokenizer
    if before == now == "bpe":
        corpus = _get(saved, "data.corpus")
        return (f"DataConfig.corpus = {cfg.data.corpus!r}: the BPE tokenizer trained on it "
                f"(data.tokenizer = 'bpe') is not the one checkpoint {path!r} was trained with "
                f"(trained on data.corpus = {corpus!r}), so its embedding rows would be fed "
                f"other token ids. Fix: resume with --set data.corpus={corpus} (and that run's "
                f"data.vocab_size and data.val_works), or start a new run in another --out")
    if isinstance(before, str) and os.path.isdir(before):
        before = f"{before!r}, the copy it carries"
    else:
        before = repr(before)
    return (f"DataConfig.tokenizer = {now!r}: not the tokenizer checkpoint {path!r} was trained "
            f"with ({before}; they encode text to other ids, recorded in {META_FILE} "
            f"'tokenizer'), so its embedding rows would be fed other token ids. Fix: leave "
            f"data.tokenizer out (a resume takes the checkpoint's), or start a new run in "
            f"another --out")
