"""Tokenizers: byte-level BPE trained locally on the train split, raw UTF-8 bytes, or a Hugging
Face tokenizer (a directory as ``save_pretrained`` writes it, or a ``tokenizer.json`` file).

All expose ``encode(str) -> list[int]``, ``encode_batch(list[str]) -> list[list[int]]``,
``decode(list[int]) -> str``, ``vocab_size``, the special ids a document is framed with
(``eos_id`` appended to every document, ``bos_id`` prepended when ``add_bos``; None: the
tokenizer has none) and ``fingerprint()`` (equal fingerprints: the same ids for the same text;
checkpoints record it so ``moeplug generate`` can prove it decodes with the tokenizer the run
trained with) and ``hf_files()`` (the files of a Hugging Face tokenizer directory that
reproduce it, carried in every checkpoint so that a resume, ``generate`` and ``convert export``
need nothing else; ``{}`` for the tokenizers moeplug builds itself).

A document is framed as Megatron's preprocessing frames it (``tools/preprocess_data.py`` with
``--append-eod``): ``[bos] + ids + [eos]``, BOS only where the tokenizer's own post-processor
adds one (``add_bos``), EOS where the tokenizer names one (:func:`frame_document`). The local BPE
and bytes have neither: their works are joined by a separator (moeplug.data.dataset). The local
BPE keeps no EOS so that the default run, its cache and every checkpoint trained before stay
what they were.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moeplug.config import ConfigError
from moeplug.config.data import MISSING_TOKENIZER_FIX, TOKENIZER_JSON, missing_tokenizer_json


class TextTokenizer(Protocol):
    vocab_size: int
    eos_id: int | None  # appended to every document (Megatron's --append-eod); None: no EOS
    bos_id: int | None
    add_bos: bool  # prepend bos_id to every document (the tokenizer's config asks for it)

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def fingerprint(self) -> str: ...

    def hf_files(self) -> dict[str, bytes]: ...


def frame_document(tok: TextTokenizer, ids: list[int]) -> list[int]:
    """One document's ids as training sees them: BOS first where the tokenizer adds one, EOS
    last where it has one (Megatron's ``--append-eod``)."""
    head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return head + list(ids) + ([] if tok.eos_id is None else [tok.eos_id])


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

    def hf_files(self) -> dict[str, bytes]:
        return {}


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

    def hf_files(self) -> dict[str, bytes]:
        return {}  # rebuilt from the run's corpus (moeplug.data.prepare_corpus), as before


# What save_pretrained writes for a tokenizer (v4 and v5), carried into checkpoints and exports
# as found. Only tokenizer.json (and the special tokens of the two configs) is read: it is the
# whole fast tokenizer; the others let transformers rebuild its slow twin or chat template.
TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILES = (TOKENIZER_JSON, *TOKENIZER_CONFIGS, "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "vocab.txt")


def is_hf_tokenizer(spec: str) -> bool:
    """``data.tokenizer`` names a Hugging Face tokenizer (a path), not a built-in kind."""
    return spec not in ("bpe", "bytes")


def _error(field: str, spec: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{field} = {spec!r}: {what}. Fix: {fix}")


def _special_token(value) -> str | None:
    # transformers writes a token as its text, or (v4 AddedToken) as {"content": text, ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``), read with ``tokenizers`` offline.

    ``encode`` gives the text's own ids (no special tokens); a document is framed by
    :func:`frame_document` with the EOS that ``tokenizer_config.json`` /
    ``special_tokens_map.json`` name (the latter read last, as transformers 4 does) and the BOS the
    tokenizer's post-processor adds, so a framed document equals
    ``AutoTokenizer.from_pretrained(dir)(text).input_ids + [eos_token_id]``
    (tests/test_hf_tokenizer.py). A bare ``tokenizer.json`` names no EOS unless its
    post-processor appends one: its documents are joined by the separator instead.
    """

    def __init__(self, tok: Tokenizer, files: dict[str, bytes], eos_id: int | None,
                 bos_id: int | None, add_bos: bool, source: str) -> None:
        self._tok = tok
        self._files = dict(files)
        self.eos_id, self.bos_id, self.add_bos = eos_id, bos_id, add_bos
        self.source = source  # the path it was read from (for messages)
        # The embedding needs a row for every id, added tokens included (they may sit past
        # get_vocab_size's count when their ids leave gaps).
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        data = json.dumps({"tokenizer": tok.to_str(), "eos": eos_id, "bos": bos_id,
                           "add_bos": add_bos}, sort_keys=True)
        self._fingerprint = "hf-sha256:" + hashlib.sha256(data.encode("utf-8")).hexdigest()

    @classmethod
    def load(cls, spec: str, field: str = "DataConfig.tokenizer") -> "HFTokenizer":
        """From a tokenizer directory or a ``tokenizer.json`` file; ConfigError naming the
        file, ``field`` and the fix for anything unreadable."""
        folder = spec if os.path.isdir(spec) else None
        path = os.path.join(spec, TOKENIZER_JSON) if folder else spec
        if folder and not os.path.isfile(path):
            raise _error(field, spec, missing_tokenizer_json(spec), MISSING_TOKENIZER_FIX)
        files = {}
        for name in (TOKENIZER_FILES if folder else ()):
            if os.path.isfile(os.path.join(folder, name)):
                with open(os.path.join(folder, name), "rb") as f:
                    files[name] = f.read()
        if not folder:
            with open(path, "rb") as f:
                files[TOKENIZER_JSON] = f.read()
        try:
            tok = Tokenizer.from_str(files[TOKENIZER_JSON].decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise _error(field, spec, f"{path} is not a tokenizer.json the tokenizers library "
                         f"reads ({' '.join(str(e).split())[:200]})",
                         "restore it, or save the tokenizer again with save_pretrained") from None
        special: dict = {}
        for name in TOKENIZER_CONFIGS:  # special_tokens_map.json last: it wins (transformers)
            if name in files:
                try:
                    data = json.loads(files[name].decode("utf-8"))
                except ValueError as e:
                    raise _error(field, spec, f"{os.path.join(folder, name)} is not valid JSON "
                                 f"({e})", f"restore {name}, or remove it") from None
                if isinstance(data, dict):
                    special.update({k: data[k] for k in ("eos_token", "bos_token")
                                    if _special_token(data.get(k)) is not None})
        ids = {}
        for key in ("eos_token", "bos_token"):
            text = _special_token(special.get(key))
            ids[key] = None if text is None else tok.token_to_id(text)
            if text is not None and ids[key] is None:
                raise _error(field, spec, f"{key} = {text!r} (its tokenizer_config.json / "
                             f"special_tokens_map.json) is not a token of {path}",
                             f"set {key} to a token of the vocabulary, or remove it")
        eos_id, bos_id, add_bos = _framing(tok, ids["eos_token"], ids["bos_token"], field, spec)
        return cls(tok, files, eos_id, bos_id, add_bos, spec)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        # As transformers' decode: special tokens kept (a document's text that spells one was
        # encoded to it); generate stops before an EOS and never decodes the prompt's BOS.
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        """sha256 of the tokenizer as tokenizers serialises it (formatting of the file aside)
        and of the document framing: equal fingerprints, equal ids for every document."""
        return self._fingerprint  # (computed once: to_str of a 150k-token vocabulary is MBs)

    def hf_files(self) -> dict[str, bytes]:
        return dict(self._files)


def _framing(tok: Tokenizer, eos_id: int | None, bos_id: int | None, field: str,
             spec: str) -> tuple[int | None, int | None, bool]:
    """(eos_id, bos_id, add_bos) from what the post-processor wraps around a text: nothing, a
    BOS before (Llama) and/or an EOS after (T5); anything else cannot be framed per document."""
    probe = "a b"
    plain = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    start = next((i for i in range(len(full) - len(plain) + 1)
                  if full[i:i + len(plain)] == plain), None)
    if start is None:
        raise _error(field, spec, "its post-processor changes the text's own tokens (encoding "
                     f"{probe!r} gives {full} with special tokens, {plain} without)",
                     "use a tokenizer whose post-processor only adds special tokens")
    prefix, suffix = full[:start], full[start + len(plain):]
    if len(prefix) > 1 or (prefix and bos_id is not None and prefix[0] != bos_id):
        raise _error(field, spec, f"its post-processor puts {prefix} before every text, not the "
                     f"one BOS ({bos_id}) a document starts with", "use a tokenizer whose "
                     "post-processor adds at most its bos_token before a text")
    if len(suffix) > 1 or (suffix and eos_id is not None and suffix[0] != eos_id):
        raise _error(field, spec, f"its post-processor puts {suffix} after every text, not the "
                     f"one EOS ({eos_id}) a document ends with", "use a tokenizer whose "
                     "post-processor adds at most its eos_token after a text")
    bos_id = prefix[0] if prefix else bos_id
    eos_id = suffix[0] if suffix and eos_id is None else eos_id
    return eos_id, bos_id, bool(prefix)
