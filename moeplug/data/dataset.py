"""Tokenise the corpus once into memory-mapped token-id files, and sample training windows.

Cache layout: ``<cache_dir>/corpus-<key>/{tokenizer.json, train.bin, val.bin, meta.json}`` where
key hashes the corpus texts, the split and the tokenizer settings, so any change re-tokenises
into a fresh directory and an unchanged corpus is never tokenised twice. ``meta.json`` is written
last: its presence means the directory is complete.

Legend: B batch, S sequence length, N tokens in a split, V vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from moeplug.config import ConfigError, DataConfig
from moeplug.data.corpus import Split, Work, load_split
from moeplug.data.tokenizer import (BPETokenizer, ByteTokenizer, HFTokenizer, TextTokenizer,
                                    frame_document, is_hf_tokenizer)

CACHE_FORMAT = 1  # bump when the file layout or tokenisation rules change
WORK_SEPARATOR = "\n\n"  # encoded between consecutive works


@dataclass(frozen=True)
class Corpus:
    train_ids: np.ndarray  # np.memmap, uint16 or int32
    val_ids: np.ndarray
    tokenizer: TextTokenizer
    vocab_size: int
    cache_dir: str

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/token) of the val ids under the train unigram distribution.

        Add-one smoothing keeps tokens absent from train finite. A model must beat this number
        to have learnt anything beyond token frequencies.
        """
        train_counts_V = np.bincount(self.train_ids, minlength=self.vocab_size).astype(np.float64)
        val_counts_V = np.bincount(self.val_ids, minlength=self.vocab_size).astype(np.float64)
        logp_V = np.log((train_counts_V + 1.0) / (train_counts_V.sum() + self.vocab_size))
        return float(-(val_counts_V * logp_V).sum() / val_counts_V.sum())


def _cache_key(cfg: DataConfig, split: Split, hf: HFTokenizer | None = None) -> str:
    # An HF tokenizer by what it encodes (its fingerprint), not by where it lies: the same
    # tokenizer found elsewhere (a checkpoint's copy) reuses the cache.
    settings = json.dumps({"format": CACHE_FORMAT,
                           "tokenizer": cfg.tokenizer if hf is None else hf.fingerprint(),
                           "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else 256,
                           "separator": WORK_SEPARATOR}, sort_keys=True)
    return hashlib.sha256((settings + split.fingerprint()).encode()).hexdigest()[:20]


def _id_dtype(vocab_size: int) -> np.dtype:
    # uint16 holds ids 0..65535, i.e. any vocabulary of at most 2**16 tokens: half the disk and
    # page-cache footprint of int32.
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _encode_works(tok: TextTokenizer, works: list[Work]) -> list[int]:
    """Each work encoded on its own (BPE: in parallel), framed with the tokenizer's EOS (and
    BOS) where it has one, else joined by the encoded separator."""
    texts = [w.text for w in works]
    per_work = tok.encode_batch(texts)
    if tok.eos_id is not None:
        return [i for ids in per_work for i in frame_document(tok, ids)]
    sep = tok.encode(WORK_SEPARATOR)
    out: list[int] = []
    for i, ids in enumerate(per_work):
        out.extend(sep if i else [])
        out.extend(ids)
    return out


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def prepare_corpus(cfg: DataConfig) -> Corpus:
    """Train/load the tokenizer and tokenise the corpus once; later calls only memory-map."""
    split = load_split(cfg)
    hf = HFTokenizer.load(cfg.tokenizer) if is_hf_tokenizer(cfg.tokenizer) else None
    folder = os.path.join(cfg.resolved_cache_dir(), f"corpus-{_cache_key(cfg, split, hf)}")
    meta_path = os.path.join(folder, "meta.json")
    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(meta_path):
        os.makedirs(folder, exist_ok=True)
        if cfg.tokenizer == "bpe":
            tok: TextTokenizer = BPETokenizer.train((w.text for w in split.train), cfg.vocab_size)
            tok.save(tok_path)
        else:
            tok = hf or ByteTokenizer()
        dtype = _id_dtype(tok.vocab_size)
        for name, works in (("train", split.train), ("val", split.val)):
            ids_N = np.asarray(_encode_works(tok, works), dtype=dtype)
            _write_atomic(os.path.join(folder, f"{name}.bin"), ids_N.tobytes())
        meta = {"tokenizer": "hf" if hf else cfg.tokenizer, "vocab_size": tok.vocab_size,
                "dtype": dtype.name,
                "train_works": [w.name for w in split.train], "val_works": [w.name for w in split.val]}
        _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    tok = (BPETokenizer.load(tok_path) if meta["tokenizer"] == "bpe" else hf
           if meta["tokenizer"] == "hf" else ByteTokenizer())
    ids = {name: np.memmap(os.path.join(folder, f"{name}.bin"), dtype=meta["dtype"], mode="r")
           for name in ("train", "val")}
    return Corpus(ids["train"], ids["val"], tok, int(meta["vocab_size"]), folder)


def get_batch(ids_N: np.ndarray, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` tokens -> (inputs, inputs shifted by one)."""
    num_starts = len(ids_N) - seq_len
    if num_starts <= 0:
        # A ConfigError, not a crash: the CLI reports it as a configuration problem (exit 2).
        raise ConfigError(
            f"get_batch: train.seq_len = {seq_len} needs more than {seq_len} tokens but the "
            f"split has {len(ids_N)}. Fix: lower train.seq_len below {len(ids_N)} or use a "
            f"larger corpus (data.corpus; data.val_works for the validation split)")
    starts_B = torch.randint(0, num_starts, (batch_size,), generator=generator).tolist()
    windows_BS1 = np.stack([np.asarray(ids_N[s:s + seq_len + 1], dtype=np.int64) for s in starts_B])
    windows = torch.from_numpy(windows_BS1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
