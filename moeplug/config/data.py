"""The ``data:`` section: corpus, tokenizer and the token cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moeplug.config._checks import _check_fields, _fail


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The corpus and tokenizer. Token ids live in memory-mapped files under ``cache_dir``."""

    corpus: str = "shakespeare"
    tokenizer: str = "bpe"  # "bpe" (byte-level BPE trained locally) or "bytes"
    vocab_size: int = 2048  # BPE target vocabulary (ignored for "bytes")
    # Whole works held out for validation (file stems of shksprdata/texts/*_gut.txt).
    val_works: list = field(default_factory=lambda: ["hamlet_gut", "tempest_gut"])
    cache_dir: str = ""  # empty: $MOEPLUG_CACHE or ~/.cache/moeplug
    # Packed documents (Megatron --reset-attention-mask --reset-position-ids): a token attends
    # only within its document and RoPE restarts per document; documents end at the
    # tokenizer's EOS (which it must have). moeplug.documents.
    document_mask: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.tokenizer not in ("bpe", "bytes"):
            _fail(self, "tokenizer", self.tokenizer, "unknown tokenizer", "use 'bpe' or 'bytes'")
        if self.tokenizer == "bpe" and not (256 < self.vocab_size <= 65536):
            _fail(self, "vocab_size", self.vocab_size, "BPE vocab must be in (256, 65536]",
                  "choose e.g. 2048")
        if self.corpus != "shakespeare" and not os.path.isdir(self.corpus):
            _fail(self, "corpus", self.corpus, "neither 'shakespeare' nor a directory of .txt files",
                  "use 'shakespeare' or a path to a folder of text files")

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.environ.get("MOEPLUG_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "moeplug")

