"""The ``data:`` section: corpus, tokenizer and the token cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moeplug.config._checks import _check_fields, _fail


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
    """The corpus and tokenizer. Token ids live in memory-mapped files under ``cache_dir``."""

    corpus: str = "shakespeare"
    # "bpe" (byte-level BPE trained locally), "bytes", or the path of a Hugging Face tokenizer:
    # a directory as save_pretrained writes it (tokenizer.json + tokenizer_config.json) or a
    # tokenizer.json file (moeplug.data.tokenizer.HFTokenizer).
    tokenizer: str = "bpe"
    vocab_size: int = 2048  # BPE target vocabulary (ignored for "bytes" and HF tokenizers)
    # Whole works held out for validation (file stems of shksprdata/texts/*_gut.txt).
    val_works: list = field(default_factory=lambda: ["hamlet_gut", "tempest_gut"])
    cache_dir: str = ""  # empty: $MOEPLUG_CACHE or ~/.cache/moeplug

    def __post_init__(self) -> None:
        _check_fields(self)
        self._check_tokenizer()
        if self.tokenizer == "bpe" and not (256 < self.vocab_size <= 65536):
            _fail(self, "vocab_size", self.vocab_size, "BPE vocab must be in (256, 65536]",
                  "choose e.g. 2048")
        if self.corpus != "shakespeare" and not os.path.isdir(self.corpus):
            _fail(self, "corpus", self.corpus, "neither 'shakespeare' nor a directory of .txt files",
                  "use 'shakespeare' or a path to a folder of text files")

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

