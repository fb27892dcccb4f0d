"""Tokenise a corpus into Megatron's prepared format: ``moeplug data prepare`` and the cache
``moeplug train`` fills.

The reader's work units (moeplug.data.reader) go to worker processes (``spawn``: nothing of
the parent's threads or torch state is inherited), at most two per worker in flight, so memory
is bounded by a few units whatever the corpus size. Each worker reads its unit, tokenises its
documents with ``encode_batch`` and frames each one as Megatron's preprocessing with
``--append-eod`` does: ``[bos] + ids + [eos]`` (BOS only where the tokenizer adds one); a
tokenizer without an EOS (``bytes``, the local ``bpe``) ends each document with the encoded
separator ``"\\n\\n"`` instead. The main process writes the results in unit order, so the
output does not depend on the number of workers.

Output ``OUT/``: ``corpus.bin`` + ``corpus.idx`` (one sequence per document), ``meta.json``
(tokenizer fingerprint, counts, document names of named formats), ``token_counts.npy`` (how
often each id occurs) and, for the local BPE, ``tokenizer.json``. Everything is written into
``OUT.tmp-<pid>`` and renamed into place once complete: an interrupted or failed run leaves no
folder a reader could take for whole. Empty documents are skipped and counted; a bad record is
one ConfigError naming the file and line.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from moeplug.config import ConfigError
from moeplug.data.indexed import IndexedWriter, token_dtype
from moeplug.data.reader import Chunk, CorpusReader, ReadOptions, RecordError
from moeplug.data.tokenizer import BPETokenizer

PREPARED_FORMAT = 1  # bump when the framing or the files change
SEPARATOR = "\n\n"  # ends each document when the tokenizer has no EOS
PREFIX = "corpus"
META = "meta.json"


@dataclass(frozen=True)
class Framing:
    """The ids around each document (a tokenizer's ``bos_id``/``add_bos``, ``eos_id``)."""

    head: tuple[int, ...]
    tail: tuple[int, ...]

    @classmethod
    def of(cls, tok: Any) -> "Framing":
        head = (tok.bos_id,) if tok.add_bos and tok.bos_id is not None else ()
        tail = (tok.eos_id,) if tok.eos_id is not None else tuple(tok.encode(SEPARATOR))
        return cls(head, tail)


@dataclass(frozen=True)
class PrepareSummary:
    documents: int
    tokens: int
    empty: int  # empty documents, skipped
    vocab_used: int  # distinct ids in the output
    vocab_size: int
    text_bytes: int
    seconds: float
    out_dir: str

    def line(self, source: str) -> str:
        mb = self.text_bytes / 1e6
        rate = mb / self.seconds if self.seconds > 0 else float("inf")
        return (f"prepared {source}: {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.empty:,} empty documents skipped, {self.vocab_used:,} of "
                f"{self.vocab_size:,} vocabulary ids used; {mb:,.1f} MB of text in "
                f"{self.seconds:.1f} s ({rate:,.1f} MB/s) -> {self.out_dir}")


@dataclass(frozen=True)
class _Result:
    ids: np.ndarray  # every kept document's framed ids, back to back
    lengths: np.ndarray  # int32, per kept document
    kept: np.ndarray  # bool per record: False for an empty one
    counts: np.ndarray  # int64 [V]
    text_bytes: int
    error: tuple[int, str] | None = None  # (record index in the chunk, message)


# The worker's state, set once per process by _init (in-process runs set it too).
_STATE: dict = {}


def _init(reader: CorpusReader, tok: Any, options: ReadOptions, dtype: np.dtype,
          worker: bool = True) -> None:
    if worker:  # one thread per worker process: the workers are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.update(reader=reader, tok=tok, options=options, dtype=np.dtype(dtype),
                  framing=Framing.of(tok))


def _encode(chunk: Chunk) -> _Result:
    reader, tok, options = _STATE["reader"], _STATE["tok"], _STATE["options"]
    dtype, framing = _STATE["dtype"], _STATE["framing"]
    texts: list[str] = []
    try:
        for text in reader.documents(chunk, options):
            texts.append(text)
    except RecordError as e:
        return _Result(*_empty(dtype, tok.vocab_size), 0, (e.index, e.message))
    except ConfigError as e:
        return _Result(*_empty(dtype, tok.vocab_size), 0, (-1, str(e)))
    except OSError as e:  # a file that vanished or cannot be read
        return _Result(*_empty(dtype, tok.vocab_size), 0, (-1, _os_error(e, chunk.file)))
    kept = np.fromiter((bool(t) for t in texts), bool, len(texts))
    docs = [t for t in texts if t]
    encoded = tok.encode_batch(docs) if docs else []
    head, tail = list(framing.head), list(framing.tail)
    framed = [head + ids + tail for ids in encoded] if head else [ids + tail for ids in encoded]
    lengths = np.fromiter(map(len, framed), np.int32, len(framed))
    ids = np.fromiter(itertools.chain.from_iterable(framed), dtype, int(lengths.sum()))
    counts = np.bincount(ids, minlength=tok.vocab_size).astype(np.int64)
    return _Result(ids, lengths, kept, counts, sum(len(t.encode("utf-8")) for t in docs))


def _empty(dtype: np.dtype, vocab: int) -> tuple:
    return (np.zeros(0, dtype), np.zeros(0, np.int32), np.zeros(0, bool),
            np.zeros(vocab, np.int64))


def _results(reader: CorpusReader, path: str, tok: Any, options: ReadOptions, dtype: np.dtype,
             num_workers: int) -> Iterator[tuple[Chunk, _Result]]:
    """Each chunk with its result, in corpus order, at most 2 per worker in flight."""
    chunks = reader.chunks(path, options)
    if num_workers <= 0:
        _init(reader, tok, options, dtype, worker=False)
        for chunk in chunks:
            yield chunk, _encode(chunk)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_workers, initializer=_init, initargs=(reader, tok, options, dtype)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(_encode, (chunk,))))
            if len(pending) >= 2 * num_workers:
                chunk, result = pending.popleft()
                yield chunk, result.get()
        while pending:
            chunk, result = pending.popleft()
            yield chunk, result.get()


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(reader: CorpusReader, path: str, tok: Any, out_dir: str,
            options: ReadOptions = ReadOptions(), num_workers: int | None = None,
            progress: bool | None = None, meta: dict | None = None) -> PrepareSummary:
    """Tokenise ``path`` (read by ``reader``) into ``out_dir`` (module docstring); ``meta``
    goes into meta.json besides what is written here. ``num_workers``: None = one per CPU,
    0 = in this process. ``progress``: a tqdm bar on stderr (None: when stderr is a terminal)."""
    from tqdm import tqdm

    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(f"--out {out_dir!r}: exists and is not an empty folder. Fix: choose a "
                          f"new folder, or delete this one")
    workers = default_workers() if num_workers is None else num_workers
    dtype = token_dtype(tok.vocab_size)
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    start = time.perf_counter()
    bar = tqdm(unit="B", unit_scale=True, desc="prepare", file=sys.stderr, dynamic_ncols=True,
               disable=not (sys.stderr.isatty() if progress is None else progress))
    writer = IndexedWriter(os.path.join(tmp, PREFIX), dtype)
    try:
        counts = np.zeros(tok.vocab_size, np.int64)
        records_before: dict[str, int] = collections.defaultdict(int)
        kept_mask: list[np.ndarray] = []
        empty = text_bytes = 0
        # closing: a failure stops the workers at once (the pool's exit terminates them)
        with contextlib.closing(_results(reader, path, tok, options, dtype, workers)) as results:
            for chunk, r in results:
                if r.error is not None:
                    index, message = r.error
                    raise ConfigError(message.replace("{where}", _where(reader, chunk,
                                                                        records_before, index)))
                records_before[chunk.file] += len(r.kept)
                writer.add_documents(r.ids, r.lengths)
                counts += r.counts
                if reader.named:  # names of the documents kept (those of other formats: none)
                    kept_mask.append(r.kept)
                empty += int(len(r.kept) - r.kept.sum())
                text_bytes += r.text_bytes
                bar.update(r.text_bytes)
                bar.set_postfix(documents=f"{writer.num_docs:,}", tokens=f"{writer.num_tokens:,}",
                                refresh=False)
        documents = writer.finalize()
        info = {"format": "moeplug-prepared", "version": PREPARED_FORMAT, "reader": reader.name,
                "source": path, "text_field": options.text_field,
                "tokenizer": tok.fingerprint(), "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                "add_bos": bool(tok.add_bos),
                "separator": None if tok.eos_id is not None else SEPARATOR,
                "documents": documents, "tokens": writer.num_tokens, "empty": empty,
                **(meta or {})}
        if reader.named:
            kept = np.concatenate(kept_mask) if kept_mask else np.zeros(0, bool)
            info["names"] = [n for n, k in zip(reader.names(path), kept) if k]
        np.save(os.path.join(tmp, "token_counts.npy"), counts)
        if isinstance(tok, BPETokenizer):  # the local BPE: the tokenizer lives with its ids
            tok.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
        _publish(tmp, out_dir)
    except OSError as e:
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(_os_error(e, path)) from None
    except BaseException:
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return PrepareSummary(documents, writer.num_tokens, empty, int((counts > 0).sum()),
                          tok.vocab_size, text_bytes, time.perf_counter() - start, out_dir)


def _os_error(e: OSError, path: str) -> str:
    return (f"{e.filename or path}: {e.strerror or e}. Fix: make the corpus files readable and "
            f"the output folder writable (with space free)")


def _where(reader: CorpusReader, chunk: Chunk, records_before: dict, index: int) -> str:
    if index < 0 or not reader.record:
        return chunk.file
    return f"{chunk.file} {reader.record} {records_before[chunk.file] + index + 1}"


def _publish(tmp: str, out_dir: str) -> None:
    """Rename the finished folder into place; a folder another process finished first for
    the same cache key wins (same content), this one is dropped."""
    try:
        if os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
    except OSError:
        if not os.path.isfile(os.path.join(out_dir, META)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def read_meta(folder: str) -> dict | None:
    """A moeplug-prepared folder's meta.json, or None (e.g. a corpus Megatron prepared)."""
    try:
        with open(os.path.join(folder, META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == "moeplug-prepared" else None


def records(reader: CorpusReader, path: str, options: ReadOptions) -> Iterator[str]:
    """Every record's text in corpus order ("" for an empty one), read in this process; a bad
    record raises the error preparation would."""
    records_before: dict[str, int] = collections.defaultdict(int)
    for chunk in reader.chunks(path, options):
        n = 0
        try:
            for text in reader.documents(chunk, options):
                n += 1
                yield text
        except RecordError as e:
            raise ConfigError(e.message.replace(
                "{where}", _where(reader, chunk, records_before, e.index))) from None
        records_before[chunk.file] += n


def iter_texts(reader: CorpusReader, path: str, options: ReadOptions) -> Iterator[str]:
    """Every non-empty document's text in corpus order (the local BPE trains on them)."""
    return (t for t in records(reader, path, options) if t)
