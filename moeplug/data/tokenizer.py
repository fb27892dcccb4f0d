"""Tokenizers: byte-level BPE trained locally on the train split, or raw UTF-8 bytes.

Both expose ``encode(str) -> list[int]``, ``encode_batch(list[str]) -> list[list[int]]``,
``decode(list[int]) -> str``, ``vocab_size``, the special ids a document is framed with
(``eos_id`` appended to every document, ``bos_id`` prepended when ``add_bos``; None: the
tokenizer has none) and ``fingerprint()`` (equal fingerprints: the same ids for the same text;
checkpoints record it so ``moeplug generate`` can prove it decodes with the tokenizer the run
trained with).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


class TextTokenizer(Protocol):
    vocab_size: int
    eos_id: int | None  # appended to every document (Megatron's --append-eod); None: no EOS
    bos_id: int | None
    add_bos: bool  # prepend bos_id to every document (the tokenizer's config asks for it)

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; no training, no file."""

    vocab_size = 256
    eos_id = bos_id = None
    add_bos = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes"


class BPETokenizer:
    """A Hugging Face ``tokenizers`` byte-level BPE: any string round-trips exactly."""

    eos_id = bos_id = None  # trained without special tokens: works are joined by a separator
    add_bos = False

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        tok = Tokenizer(models.BPE())
        # add_prefix_space=False keeps decode(encode(s)) == s exactly.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str) -> "BPETokenizer":
        return cls(Tokenizer.from_file(path))

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        self._tok.save(tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def fingerprint(self) -> str:
        """sha256 of the serialised tokenizer (vocabulary, merges, pre-tokenizer, decoder)."""
        return "bpe-sha256:" + hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()
