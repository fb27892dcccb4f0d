"""The run's data: the tokenizer, every corpus prepared once into the cache, the train /
validation split, and the samplers over them (:func:`prepare_corpus`).

Raw corpora (text, JSONL, Parquet, datasets folders) are tokenised once into
``<cache>/prepared-<key>/`` (moeplug.data.prepare), key = the reader, the files' contents, the
tokenizer and the text field, so a changed file or tokenizer prepares afresh and an unchanged
one is never tokenised twice. Prepared corpora (Megatron's .bin/.idx, a ``moeplug data prepare``
folder) are read where they are.

Validation (at most one of these; moeplug.config.data.DataConfig checks):
  ``val_works``    named documents (file stems) held out; the Shakespeare default: Hamlet and
                   The Tempest;
  ``val_fraction`` the last fraction of each corpus' documents, as Megatron's ``--split``
                   (train ``[0, round((1 - f) N))``, validation the rest);
  ``val_corpus``   separate files (any format), the training corpora whole.
With none given, a corpus other than Shakespeare holds out ``val_fraction`` 0.01.
Validation documents are never training documents: the split is by document.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from moeplug.config import ConfigError, DataConfig
from moeplug.data.indexed import IndexedTokens, open_indexed
from moeplug.data.prepare import (PREFIX, PREPARED_FORMAT, default_workers, iter_texts, prepare,
                                  read_meta, records)
from moeplug.data.reader import CHUNK_BYTES, CorpusReader, ReadOptions
from moeplug.data.sampling import (BlendedSamples, CorpusSamples, blend_key,
                                   exhaustive_blending_indices)
from moeplug.config.data import CorpusEntry, corpus_entries
from moeplug.data.sources import fingerprint, ids_fingerprint, reader_for, unknown_names
from moeplug.data.tokenizer import (BPETokenizer, ByteTokenizer, HFTokenizer, TextTokenizer,
                                    is_hf_tokenizer)

SHAKESPEARE_VAL_WORKS = ("hamlet_gut", "tempest_gut")
DEFAULT_VAL_FRACTION = 0.01
BPE_FORMAT = 2  # bump when the local BPE's training changes


@dataclass
class CorpusPart:
    """One corpus of the run, split: its prepared ids and the documents of one split."""

    entry: CorpusEntry
    tokens: IndexedTokens
    docs: np.ndarray  # int64 document ids of this split, ascending
    key: str  # the prepared ids' content key (moeplug.data.sources.ids_fingerprint)
    counts: np.ndarray  # how often each id occurs in the whole corpus (int64)
    folder: str  # the prepared folder ("" for a prefix prepared elsewhere)

    @functools.cached_property
    def split_key(self) -> str:
        """The ids' key and this split's documents: what its sample order depends on."""
        h = hashlib.sha256(self.key.encode())
        h.update(np.ascontiguousarray(self.docs, dtype=np.int64).tobytes())
        return h.hexdigest()[:20]

    def split_tokens(self) -> np.ndarray:
        """This split's ids in corpus order (a copy; for small corpora and tests)."""
        starts, lengths = self.tokens.starts_S, self.tokens.lengths_S
        if not len(self.docs):
            return np.zeros(0, self.tokens.dtype)
        return np.concatenate([self.tokens.tokens_N[starts[d]:starts[d] + lengths[d]]
                               for d in self.docs])

    def split_counts(self) -> np.ndarray:
        if len(self.docs) == self.tokens.num_docs:
            return self.counts
        ids = self.split_tokens()
        return np.bincount(ids, minlength=len(self.counts))[:len(self.counts)].astype(np.int64)


@dataclass
class ValSamples:
    """The whole validation set: every validation sample of every corpus once (module
    docstring of moeplug.data.sampling), interleaved by size."""

    parts: list[CorpusSamples]
    which: np.ndarray = field(init=False)
    where: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.which, self.where = exhaustive_blending_indices(
            [p.samples_per_epoch for p in self.parts])

    def __len__(self) -> int:
        return len(self.which)

    def sample(self, i: int) -> np.ndarray:
        return self.parts[int(self.which[i])].sample(int(self.where[i]))


@dataclass
class Corpus:
    """What :func:`prepare_corpus` returns: the tokenizer, the split corpora and their samplers."""

    tokenizer: TextTokenizer
    vocab_size: int
    cache_dir: str  # the data cache (``data.cache_dir`` resolved)
    train: list[CorpusPart]
    val: list[CorpusPart]
    weights: np.ndarray  # the blend's, normalised
    split: str = ""  # how validation was chosen, e.g. "val_fraction 0.01"
    description: str = ""
    _legacy: dict = field(default_factory=dict, repr=False)

    def order_key(self, seq_len: int, seed: int) -> str:
        """What the training sample order depends on: equal keys, equal batches."""
        return blend_key([str(PREPARED_FORMAT), str(seq_len), str(seed)] +
                         [f"{p.split_key}:{w!r}" for p, w in zip(self.train, self.weights)])

    def _index_dir(self, part: CorpusPart, seq_len: int, seed: int) -> str:
        return os.path.join(self.cache_dir, "indices",
                            blend_key([part.split_key, str(seq_len), str(seed)]))

    def train_samples(self, seq_len: int, seed: int) -> BlendedSamples:
        parts = [CorpusSamples(p.tokens, p.docs, seq_len, seed, self._index_dir(p, seq_len, seed))
                 for p in self.train]
        for p, s in zip(self.train, parts):
            _check_fits(p, s, seq_len, "training")
        return BlendedSamples(parts, self.weights, os.path.join(
            self.cache_dir, "indices", self.order_key(seq_len, seed) + "-blend"))

    def val_samples(self, seq_len: int, seed: int) -> ValSamples:
        parts = [CorpusSamples(p.tokens, p.docs, seq_len, seed, self._index_dir(p, seq_len, seed))
                 for p in self.val]
        for p, s in zip(self.val, parts):
            _check_fits(p, s, seq_len, "validation")
        return ValSamples(parts)

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/token) of the validation ids under the training ids' unigram
        distribution (add-one smoothing keeps unseen ids finite): a model must beat it to have
        learnt anything beyond token frequencies."""
        V = self.vocab_size
        train_V = np.zeros(V, np.float64)
        val_V = np.zeros(V, np.float64)
        for parts, out in ((self.train, train_V), (self.val, val_V)):
            for p in parts:
                c = p.split_counts()[:V]
                out[:len(c)] += c
        logp_V = np.log((train_V + 1.0) / (train_V.sum() + V))
        return float(-(val_V * logp_V).sum() / val_V.sum())

    @property
    def train_ids(self) -> np.ndarray:
        """The training split's ids in corpus order, documents back to back (a copy)."""
        if "train" not in self._legacy:
            self._legacy["train"] = np.concatenate([p.split_tokens() for p in self.train])
        return self._legacy["train"]

    @property
    def val_ids(self) -> np.ndarray:
        if "val" not in self._legacy:
            self._legacy["val"] = np.concatenate([p.split_tokens() for p in self.val])
        return self._legacy["val"]


def _check_fits(part: CorpusPart, samples: CorpusSamples, seq_len: int, split: str) -> None:
    if samples.samples_per_epoch == 0:
        n = samples.num_tokens
        raise ConfigError(
            f"train.seq_len = {seq_len} needs more than {seq_len} tokens but the {split} split "
            f"of {part.entry.path!r} has {n}. Fix: lower train.seq_len below {n} or give it "
            f"more documents (data.corpus; data.val_works / val_fraction / val_corpus)")


# --------------------------------------------------------------------------------------------
# Building it
# --------------------------------------------------------------------------------------------

def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class _Source:
    entry: CorpusEntry
    reader: CorpusReader
    fingerprint: str = ""

    @property
    def path(self) -> str:
        return self.entry.path


def _validation(cfg: DataConfig, train: list[_Source]) -> tuple[str, Any]:
    """("works", names) | ("fraction", f) | ("corpus", entries): the rule the split follows."""
    if cfg.val_corpus:
        return "corpus", corpus_entries(cfg.val_corpus, "data.val_corpus", cfg.format)
    if cfg.val_works is not None:
        return "works", list(cfg.val_works)
    if cfg.val_fraction > 0:
        return "fraction", cfg.val_fraction
    if len(train) == 1 and train[0].reader.name == "shakespeare":
        return "works", list(SHAKESPEARE_VAL_WORKS)
    return "fraction", DEFAULT_VAL_FRACTION


def prepare_corpus(cfg: DataConfig, host: Any = None,
                   log: Callable[[str], None] | None = None) -> Corpus:
    """Tokenizer, prepared corpora and split for ``cfg`` (module docstring); everything
    expensive is cached, so the ranks of a run (and later runs) only read. ConfigError (one
    line each: file, line or document, field, fix) for bad data."""
    if host is None:
        from moeplug.plugin_host import PluginHost
        host = PluginHost.load()
    cache = cfg.resolved_cache_dir()
    options = ReadOptions(text_field=cfg.text_field)
    train = [_Source(e, reader_for(host, e)) for e in corpus_entries(cfg.corpus, "data.corpus",
                                                                     cfg.format)]
    rule, value = _validation(cfg, train)
    val = ([_Source(e, reader_for(host, e)) for e in value] if rule == "corpus" else [])
    for s in train + val:
        s.fingerprint = fingerprint(s.reader, s.path, cache)
    if rule == "works":
        unnamed = [s.path for s in train if not s.reader.named]
        if unnamed:
            raise ConfigError(f"DataConfig.val_works = {value!r}: corpus {unnamed[0]!r} has no "
                              f"document names. Fix: hold out data.val_fraction of its "
                              f"documents or give data.val_corpus")
    tok = _tokenizer(cfg, train, rule, value, options, cache)
    prepared = {id(s): _prepared(s, tok, cfg, options, cache, log) for s in train + val}
    train_parts: list[CorpusPart] = []
    val_parts: list[CorpusPart] = []
    remaining = set(value) if rule == "works" else set()
    for s in train:
        tokens, key, counts, folder, names = prepared[id(s)]
        n = tokens.num_docs
        if rule == "works":
            held = np.array([i for i, name in enumerate(names) if name in value], np.int64)
            remaining -= {names[i] for i in held}
            train_docs = np.setdiff1d(np.arange(n), held)
            val_docs = held
        elif rule == "fraction":
            cut = int(round((1.0 - value) * n))  # Megatron's split book-ends
            train_docs, val_docs = np.arange(cut), np.arange(cut, n)
            if cut == 0 or cut == n:
                raise ConfigError(
                    f"DataConfig.val_fraction = {value}: of the {n:,} documents of "
                    f"{s.path!r} it holds out {n - cut:,}, leaving "
                    f"{'no training' if cut == 0 else 'no validation'} documents. Fix: "
                    + ("lower data.val_fraction" if cut == 0 else
                       "raise data.val_fraction (or give data.val_corpus)"))
        else:
            train_docs, val_docs = np.arange(n), np.zeros(0, np.int64)
        train_parts.append(CorpusPart(s.entry, tokens, train_docs, key, counts, folder))
        if len(val_docs):
            val_parts.append(CorpusPart(s.entry, tokens, val_docs, key, counts, folder))
    if rule == "works":
        all_names = [n for s in train for n in prepared[id(s)][4]]
        if remaining:
            raise unknown_names(sorted(remaining), all_names, "val_works", cfg.corpus)
        if not val_parts or any(not len(p.docs) for p in train_parts):
            what = "no validation" if not value else "no training"
            raise ConfigError(f"DataConfig.val_works = {value!r}: leaves {what} works out of "
                              f"{len(all_names)}. Fix: hold out at least one work and fewer "
                              f"than all")
    for s in val:
        tokens, key, counts, folder, _ = prepared[id(s)]
        val_parts.append(CorpusPart(s.entry, tokens, np.arange(tokens.num_docs), key, counts,
                                    folder))
    weights = np.array([s.entry.weight for s in train], np.float64)
    weights = weights / weights.sum()  # Megatron's normalize
    corpus = Corpus(tok, tok.vocab_size, cache, train_parts, val_parts, weights)
    _check_ids(corpus, tok.vocab_size, f"data.tokenizer = {cfg.tokenizer!r}")
    corpus.split = {"works": f"val_works {value}", "fraction": f"val_fraction {value}",
                    "corpus": f"val_corpus {cfg.val_corpus!r}"}[rule]
    corpus.description = _describe(corpus)
    return corpus


def _describe(corpus: Corpus) -> str:
    def size(parts):
        docs = sum(len(p.docs) for p in parts)
        toks = sum(int(p.tokens.lengths_S[p.docs].sum()) for p in parts)
        return f"{docs:,} documents, {toks:,} tokens"
    return f"data: train {size(corpus.train)}; validation ({corpus.split}) {size(corpus.val)}"


def _check_ids(corpus: Corpus, vocab: int, what: str) -> None:
    for p in corpus.train + corpus.val:
        top = int(np.flatnonzero(p.counts).max(initial=-1))
        if top < vocab:
            continue
        doc, token = _first_id_at_least(p.tokens, vocab)
        raise ConfigError(
            f"{p.tokens.prefix}.bin: document {doc} holds token id {token} (the corpus' largest "
            f"is {top}), outside the vocabulary of {vocab} ids ({what}). Fix: set "
            f"data.tokenizer to the tokenizer this corpus was prepared with (or prepare it "
            f"again with this one: moeplug data prepare)")


def _first_id_at_least(tokens: IndexedTokens, vocab: int) -> tuple[int, int]:
    step = 1 << 24
    for lo in range(0, len(tokens.tokens_N), step):
        hits = np.flatnonzero(tokens.tokens_N[lo:lo + step] >= vocab)
        if len(hits):
            pos = lo + int(hits[0])
            doc = int(np.searchsorted(tokens.starts_S, pos, side="right") - 1)
            return doc, int(tokens.tokens_N[pos])
    return -1, -1


def _train_texts(s: _Source, rule: str, value: Any, options: ReadOptions) -> Iterator[str]:
    """The training documents' texts of a raw corpus, in order (the local BPE trains on them)."""
    if rule == "works":
        for text, name in zip(records(s.reader, s.path, options), s.reader.names(s.path)):
            if text and name not in value:
                yield text
    elif rule == "fraction":  # the split is by (non-empty) document count: count them first
        cut = int(round((1.0 - value) * sum(1 for _ in iter_texts(s.reader, s.path, options))))
        yield from itertools.islice(iter_texts(s.reader, s.path, options), cut)
    else:
        yield from iter_texts(s.reader, s.path, options)


def _prepared_bpe(train: list[_Source]) -> TextTokenizer | None:
    """The local BPE that ``moeplug data prepare --tokenizer bpe`` stored beside every one of
    these prepared corpora, if it is the same one for all."""
    found = set()
    for s in train:
        folder = os.path.dirname(s.reader.open_prepared(s.path).prefix)
        meta = read_meta(folder)
        if meta is None or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return None
        found.add((meta["tokenizer"], os.path.join(folder, "tokenizer.json")))
    if len({fp for fp, _ in found}) != 1:
        return None
    return BPETokenizer.load(sorted(found)[0][1])


def _tokenizer(cfg: DataConfig, train: list[_Source], rule: str, value: Any,
               options: ReadOptions, cache: str) -> TextTokenizer:
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if is_hf_tokenizer(cfg.tokenizer):  # a Hugging Face tokenizer: read from its files
        return HFTokenizer.load(cfg.tokenizer)
    # "bpe": trained here on the training documents, or the one prepared folders carry.
    prepared = [s for s in train if s.reader.prepared]
    if prepared:
        tok = _prepared_bpe(train) if len(prepared) == len(train) else None
        if tok is None:
            raise ConfigError(
                f"DataConfig.tokenizer = 'bpe': a BPE trained here cannot know the ids of the "
                f"prepared corpus {prepared[0].path!r} (only a folder 'moeplug data prepare "
                f"--tokenizer bpe' wrote carries its BPE, and a blend needs the same one "
                f"throughout). Fix: set data.tokenizer to the tokenizer it was prepared with")
        return tok
    key = _key("bpe", BPE_FORMAT, cfg.vocab_size, [s.fingerprint for s in train], rule,
               value if rule != "corpus" else None, cfg.text_field)
    path = os.path.join(cache, f"bpe-{key}", "tokenizer.json")
    if os.path.isfile(path):
        return BPETokenizer.load(path)
    tok = BPETokenizer.train((t for s in train for t in _train_texts(s, rule, value, options)),
                             cfg.vocab_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)
    return tok


def _prepared(s: _Source, tok: TextTokenizer, cfg: DataConfig, options: ReadOptions,
              cache: str, log: Callable[[str], None] | None):
    """(ids, content key, token counts, folder, names) of a corpus, preparing it if raw."""
    if s.reader.prepared:
        tokens = s.reader.open_prepared(s.path)
        folder = os.path.dirname(tokens.prefix)
        meta = read_meta(folder) if os.path.basename(tokens.prefix) == PREFIX else None
        if meta is not None and meta["tokenizer"] != tok.fingerprint():
            raise ConfigError(
                f"{s.entry.field} = {s.path!r}: prepared with another tokenizer "
                f"({meta['tokenizer']}; its meta.json) than data.tokenizer = "
                f"{cfg.tokenizer!r} gives ({tok.fingerprint()}). Fix: set data.tokenizer to "
                f"the one it was prepared with, or prepare it again with this one")
        counts = _counts(tokens, folder if meta else "", s.fingerprint, cache)
        return tokens, ids_fingerprint(tokens.prefix, cache), counts, folder, \
            (meta or {}).get("names", [])
    key = _key("raw", PREPARED_FORMAT, s.reader.name, s.fingerprint, tok.fingerprint(),
               cfg.text_field)
    folder = os.path.join(cache, f"prepared-{key}")
    if read_meta(folder) is None:
        size = sum(os.path.getsize(f) for f in s.reader.files(s.path))
        workers = cfg.num_workers or default_workers()
        summary = prepare(s.reader, s.path, tok, folder, options,
                          num_workers=0 if size < 4 * CHUNK_BYTES else workers)
        if log is not None:
            log(summary.line(s.path))
    tokens = open_indexed(os.path.join(folder, PREFIX))
    meta = read_meta(folder)
    counts = np.load(os.path.join(folder, "token_counts.npy"))
    return tokens, ids_fingerprint(tokens.prefix, cache), counts, folder, meta.get("names", [])


def _counts(tokens: IndexedTokens, folder: str, fp: str, cache: str) -> np.ndarray:
    """Token counts of a prepared corpus: its token_counts.npy, or counted once and cached."""
    if folder and os.path.isfile(os.path.join(folder, "token_counts.npy")):
        return np.load(os.path.join(folder, "token_counts.npy"))
    path = os.path.join(cache, "counts", f"{fp[:32]}.npy")
    if os.path.isfile(path):
        return np.load(path)
    counts = np.zeros(0, np.int64)
    step = 1 << 26
    for lo in range(0, len(tokens.tokens_N), step):
        c = np.bincount(tokens.tokens_N[lo:lo + step])
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[:len(c)] += c
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, counts)
    os.replace(tmp, path)
    return counts


def check_run_data(corpus: Corpus, cfg: Any, resume_from: str | None = None,
                   meta: dict | None = None) -> None:
    """What a training run needs of its data, checked before any rank starts: samples of
    ``train.seq_len`` in both splits (their epoch-0 indices are built and cached here) and a
    resume that keeps the data order (moeplug.data.loader; ``meta``: the resumed checkpoint's
    meta.json, read by the caller). (Every id is inside the
    tokenizer's vocabulary, checked by prepare_corpus, and so inside the model's: a
    model.vocab_size below the tokenizer's is refused with the model.)"""
    t = cfg.train
    stream = corpus.train_samples(t.seq_len, t.seed)
    for part in stream.corpora:
        part.epoch(0)
    corpus.val_samples(t.seq_len, t.seed)
    if resume_from:
        from moeplug.data.loader import resume_position
        resume_position((meta or {}).get("data"), corpus, cfg, resume_from)
