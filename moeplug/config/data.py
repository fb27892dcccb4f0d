"""The ``data:`` section: corpora (and blends of them), the validation split, tokenizer, cache."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from moeplug.config._checks import _check_fields, _fail


@dataclass(frozen=True)
class CorpusEntry:
    """One corpus of a blend; ``field`` says where it was written (for messages)."""

    path: str
    weight: float = 1.0
    format: str = ""
    field: str = "data.corpus"


def _blend_problem(value: object, field: str) -> tuple[str, str] | None:
    """(rule, fix) when ``value`` is no corpus path or blend, else None."""
    blend_fix = (f"write {field}: PATH, or a blend {field}: [{{path: A, weight: 0.3}}, "
                 f"{{path: B, weight: 0.7}}]")
    if isinstance(value, str):
        return None if value else ("must name a corpus", blend_fix)
    if not isinstance(value, list) or not value:
        return "must be a path or a non-empty list of {path, weight}", blend_fix
    for i, item in enumerate(value):
        if isinstance(item, str):
            continue
        if not isinstance(item, dict) or not isinstance(item.get("path"), str):
            return f"entry {i} ({item!r}) is no mapping with a 'path'", blend_fix
        unknown = sorted(set(item) - {"path", "weight", "format"})
        if unknown:
            return (f"entry {i} has unknown key(s) {', '.join(unknown)}",
                    "give each entry path, weight and (optionally) format")
        w = item.get("weight", 1.0)
        if isinstance(w, str):
            try:
                w = float(w)
            except ValueError:
                pass
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (
                w > 0 and math.isfinite(w)):
            return (f"entry {i} ({item['path']!r}) has weight {item.get('weight')!r}, not a "
                    f"positive number (Megatron's --data-path weights are > 0 and are "
                    f"normalised to sum to 1)", "give every corpus a weight > 0, or drop it")
        if not isinstance(item.get("format", ""), str):
            return (f"entry {i} has format {item['format']!r}, not a reader name",
                    "write format: jsonl (`moeplug plugins` lists the dataset readers)")
    return None


def _missing_path(value: str | list) -> str | None:
    """The first local path of a corpus or blend that does not exist (a URI, with ``://``, is
    its reader's business)."""
    for item in [value] if isinstance(value, str) else value:
        path = item if isinstance(item, str) else item["path"]
        if path != "shakespeare" and "://" not in path and not os.path.exists(path) \
                and not os.path.exists(path + ".idx"):
            return path
    return None


def corpus_entries(value: str | list, field: str = "data.corpus",
                   format: str = "") -> list[CorpusEntry]:
    """``data.corpus`` / ``data.val_corpus`` (already checked) as blend entries."""
    if isinstance(value, str):
        return [CorpusEntry(value, 1.0, format, field)]
    out = []
    for i, item in enumerate(value):
        item = {"path": item} if isinstance(item, str) else item
        out.append(CorpusEntry(item["path"], float(item.get("weight", 1.0)),
                               item.get("format", format), f"{field}[{i}]"))
    return out
TOKENIZER_JSON = "tokenizer.json"
MISSING_TOKENIZER_FIX = (
    "save the tokenizer with a fast (Rust) tokenizer, which writes tokenizer.json: "
    "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR), or point data.tokenizer at a "
    "tokenizer.json file")


def missing_tokenizer_json(folder: str) -> str:
    """Why a directory is no tokenizer moeplug reads (naming what the folder holds)."""
    try:
        held = sorted(os.listdir(folder))
    except OSError:
        held = []
    shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
    return (f"the directory holds no {TOKENIZER_JSON} (it holds {shown or 'nothing'}); moeplug "
            f"reads the fast-tokenizer file that save_pretrained writes")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The corpus and tokenizer. Token ids live in memory-mapped files under ``cache_dir``.

    corpus: ``shakespeare`` (bundled), a path (a folder of .txt; .jsonl[.gz|.zst] files or a
    folder of them; .parquet files or a folder; a datasets ``save_to_disk`` folder; a Megatron
    PREFIX of .bin/.idx, or a ``moeplug data prepare`` folder), or a blend
    ``[{path: A, weight: 0.3}, {path: B, weight: 0.7}]``. The format is found from the path;
    ``format`` (or an entry's ``format:``) names the reader instead (`moeplug plugins`).
    """

    corpus: str | list = "shakespeare"
    format: str = ""  # "": the one reader that claims the path
    text_field: str = "text"  # JSONL key / Parquet and Arrow column of the text
    # "bpe" (byte-level BPE trained locally), "bytes", or the path of a Hugging Face tokenizer:
    # a directory as save_pretrained writes it (tokenizer.json + tokenizer_config.json) or a
    # tokenizer.json file (moeplug.data.tokenizer.HFTokenizer).
    tokenizer: str = "bpe"
    vocab_size: int = 2048  # BPE target vocabulary (ignored for "bytes" and HF tokenizers)
    # Validation, at most one of: whole documents held out by name (file stems; null: Hamlet
    # and The Tempest for the bundled Shakespeare), the last fraction of each corpus'
    # documents (Megatron's --split), or separate files. None given and not Shakespeare:
    # val_fraction 0.01.
    val_works: list | None = None
    val_fraction: float = 0.0
    val_corpus: str | list = ""
    num_workers: int = 0  # tokenising processes when preparing a raw corpus; 0: one per CPU
    # A resume whose data order differs from the checkpoint's (corpus, split, tokenizer,
    # train.seq_len or train.seed) is refused; true: it starts the new order at its first
    # sample instead.
    allow_new_order: bool = False
    cache_dir: str = ""  # empty: $MOEPLUG_CACHE or ~/.cache/moeplug
    # Packed documents (Megatron --reset-attention-mask --reset-position-ids): a token attends
    # only within its document and RoPE restarts per document; documents end at the
    # tokenizer's EOS (which it must have). moeplug.data.documents.
    document_mask: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        self._check_tokenizer()
        if self.tokenizer == "bpe" and not (256 < self.vocab_size <= 65536):
            _fail(self, "vocab_size", self.vocab_size, "BPE vocab must be in (256, 65536]",
                  "choose e.g. 2048")
        for name in ("corpus", "val_corpus"):
            value = getattr(self, name)
            if name == "val_corpus" and value == "":
                continue
            problem = _blend_problem(value, f"data.{name}")
            if problem:
                _fail(self, name, value, *problem)
            elif _missing_path(value) is not None:
                _fail(self, name, value, f"{_missing_path(value)!r}: no such file or folder",
                      "give the path of your corpus (a folder, a file, a Megatron PREFIX of "
                      ".bin/.idx), or 'shakespeare' for the bundled one")
        if not isinstance(self.text_field, str) or not self.text_field:
            _fail(self, "text_field", self.text_field, "must name a field",
                  "set text_field to the JSONL key / column of the text, e.g. text")
        if self.val_works is not None and not all(isinstance(w, str) for w in self.val_works):
            _fail(self, "val_works", self.val_works, "must be a list of document names",
                  "list file stems, e.g. [hamlet_gut]")
        if not 0.0 <= self.val_fraction < 1.0:
            _fail(self, "val_fraction", self.val_fraction, "must be in [0, 1)",
                  "set val_fraction to e.g. 0.01")
        given = [n for n, on in (("val_works", self.val_works is not None),
                                 ("val_fraction", self.val_fraction > 0),
                                 ("val_corpus", self.val_corpus != "")) if on]
        if len(given) > 1:
            _fail(self, given[1], getattr(self, given[1]), f"data.{given[0]} is set too, and "
                  "each chooses the validation documents", f"keep one of "
                  f"data.{' / data.'.join(given)}")
        if self.num_workers < 0:
            _fail(self, "num_workers", self.num_workers, "must be >= 0",
                  "set num_workers to 0 (one per CPU) or a process count")

    def _check_tokenizer(self) -> None:
        # Only what the file system says: reading the tokenizer itself happens once it is used
        # (moeplug.data.tokenizer.HFTokenizer.load names a broken file the same way).
        tok = self.tokenizer
        if not isinstance(tok, str) or not tok:
            _fail(self, "tokenizer", tok, "must be 'bpe', 'bytes' or a path",
                  "use 'bpe', 'bytes', or a Hugging Face tokenizer directory or tokenizer.json")
        elif tok in ("bpe", "bytes"):
            return
        elif os.path.isdir(tok) and not os.path.isfile(os.path.join(tok, TOKENIZER_JSON)):
            _fail(self, "tokenizer", tok, missing_tokenizer_json(tok), MISSING_TOKENIZER_FIX)
        elif not os.path.exists(tok):
            _fail(self, "tokenizer", tok, "neither 'bpe', 'bytes' nor an existing path",
                  "use 'bpe', 'bytes', or the path of a Hugging Face tokenizer directory "
                  "(save_pretrained's tokenizer.json + tokenizer_config.json) or tokenizer.json")

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.environ.get("MOEPLUG_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "moeplug")
