"""Megatron-Core's prepared corpus format, read and written natively: ``PREFIX.bin`` + ``PREFIX.idx``.

The layout is ``megatron.core.datasets.indexed_dataset``'s (what ``tools/preprocess_data.py`` and
``IndexedDatasetBuilder`` write, version 1, not multimodal):

    .bin  every sequence's token ids back to back, in the .idx's dtype
    .idx  b"MMIDIDX\\x00\\x00", <Q version = 1, <B dtype code, <Q sequence count S,
          <Q document-index count D, int32 lengths[S], int64 byte pointers[S],
          int64 document_indices[D] (sequence index where each document starts, then S)

A GPT corpus samples sequences (Megatron's ``GPTDataset.numel_low_level_dataset``), so moeplug
calls every sequence a document; ``moeplug data prepare`` writes one sequence per document,
as preprocess_data.py does without ``--split-sentences``. Both files are checked against each
other when opened (:func:`open_indexed`): a truncated ``.bin`` or an ``.idx`` whose counts or
dtype do not match it is one ConfigError naming the file and the fix, never a crash later.

Legend: S sequences (documents), N tokens.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from moeplug.config import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's DType enum: the code stored in the .idx for each token dtype.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEAD_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34


def token_dtype(vocab_size: int) -> np.dtype:
    """The .bin dtype for a vocabulary: Megatron's ``DType.optimal_dtype`` (uint16 below 65500
    tokens, else int32), so what moeplug writes is byte for byte what preprocess_data.py
    writes for the same ids."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


@dataclass(frozen=True)
class IndexedTokens:
    """An opened, checked ``PREFIX.bin``/``.idx`` pair: per-sequence lengths and the ids,
    memory-mapped (nothing is read until a sample asks for it)."""

    prefix: str
    lengths_S: np.ndarray  # int32
    pointers_S: np.ndarray  # int64 byte offsets into the .bin
    document_indices: np.ndarray  # int64, Megatron's document boundaries over sequences
    tokens_N: np.ndarray  # np.memmap of the .bin, dtype as the .idx says

    @property
    def num_docs(self) -> int:
        return len(self.lengths_S)

    @property
    def dtype(self) -> np.dtype:
        return self.tokens_N.dtype

    @property
    def starts_S(self) -> np.ndarray:
        """Token offset of each sequence into ``tokens_N``."""
        return self.pointers_S // self.dtype.itemsize

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``doc`` (to its end when None), as
        Megatron's ``IndexedDataset.get``."""
        start = int(self.pointers_S[doc]) // self.dtype.itemsize + offset
        n = int(self.lengths_S[doc]) - offset if length is None else length
        return self.tokens_N[start:start + n]


def _fail(path: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: {what}. Fix: {fix}")


def open_indexed(prefix: str) -> IndexedTokens:
    """Open ``prefix``.bin/.idx and check them against each other (ConfigError naming the file
    otherwise). Costs one pass over the .idx (not the .bin)."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    for p in (ipath, bpath):
        if not os.path.isfile(p):
            raise _fail(p, "not found (a Megatron prepared corpus is a PREFIX.bin and a "
                        "PREFIX.idx side by side)", "give data.corpus the prefix both files share")
    refix = ("prepare it again (moeplug data prepare, or Megatron's "
             "tools/preprocess_data.py) or copy it again from its source")
    size = os.path.getsize(ipath)
    with open(ipath, "rb") as f:
        head = f.read(_HEAD_BYTES)
    if len(head) < _HEAD_BYTES or head[:len(INDEX_HEADER)] != INDEX_HEADER:
        raise _fail(ipath, f"not a Megatron index: it does not start with {INDEX_HEADER!r}",
                    f"point data.corpus at a prefix written by IndexedDatasetBuilder, or {refix}")
    version, code, num_seqs, num_doc_idx = struct.unpack("<QBQQ", head[len(INDEX_HEADER):])
    if version != INDEX_VERSION:
        raise _fail(ipath, f"index version {version}, moeplug reads version {INDEX_VERSION}",
                    refix)
    if code not in DTYPE_CODES:
        raise _fail(ipath, f"dtype code {code} is none of Megatron's "
                    f"({', '.join(f'{k}={np.dtype(v).name}' for k, v in DTYPE_CODES.items())})",
                    refix)
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind not in "iu":
        raise _fail(ipath, f"dtype {dtype.name}: token ids must be integers", refix)
    want = _HEAD_BYTES + num_seqs * (4 + 8) + num_doc_idx * 8
    if size != want:
        multimodal = size == want + num_seqs
        raise _fail(ipath, f"{size} bytes, but its counts ({num_seqs} sequences, {num_doc_idx} "
                    f"document indices) need {want}"
                    + (" (it carries sequence modes: a multimodal index)" if multimodal else
                       " (truncated or not a version-1 index)"),
                    "use a text (not multimodal) corpus" if multimodal else refix)
    raw = np.memmap(ipath, dtype=np.uint8, mode="r")
    lengths_S = np.frombuffer(raw, np.int32, num_seqs, _HEAD_BYTES)
    pointers_S = np.frombuffer(raw, np.int64, num_seqs, _HEAD_BYTES + 4 * num_seqs)
    doc_idx = np.frombuffer(raw, np.int64, num_doc_idx, _HEAD_BYTES + 12 * num_seqs)
    if num_seqs and lengths_S.min() < 0:
        raise _fail(ipath, f"sequence {int(np.argmin(lengths_S))} has a negative length", refix)
    if num_doc_idx == 0 or doc_idx[0] != 0 or doc_idx[-1] != num_seqs or (
            np.diff(doc_idx) < 0).any():
        raise _fail(ipath, f"its document indices do not run from 0 to its {num_seqs} "
                    "sequences in order", refix)
    ends = np.cumsum(lengths_S, dtype=np.int64) * dtype.itemsize
    total = int(ends[-1]) if num_seqs else 0
    bsize = os.path.getsize(bpath)
    if bsize != total:
        hint = ""
        for other in {np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64)} - {dtype}:
            if bsize == total // dtype.itemsize * other.itemsize:
                hint = (f"; it holds exactly that many {other.name} ids: the .idx says "
                        f"{dtype.name} (code {code}), was it written with another dtype?")
        raise _fail(bpath, f"{bsize} bytes, but {ipath} describes {total // dtype.itemsize} "
                    f"{dtype.name} tokens = {total} bytes"
                    + (hint or (" (truncated)" if bsize < total else " (extra bytes)")), refix)
    starts = ends - lengths_S.astype(np.int64) * dtype.itemsize
    if not np.array_equal(starts, pointers_S):
        bad = int(np.argmax(starts != pointers_S))
        raise _fail(ipath, f"sequence {bad}'s byte pointer {int(pointers_S[bad])} is not the "
                    f"sum of the lengths before it times {dtype.itemsize} ({int(starts[bad])})",
                    refix)
    tokens_N = (np.memmap(bpath, dtype=dtype, mode="r") if total else np.zeros(0, dtype))
    return IndexedTokens(prefix, lengths_S, pointers_S, doc_idx, tokens_N)


class IndexedWriter:
    """Writes ``PREFIX.bin``/``.idx`` as Megatron's ``IndexedDatasetBuilder`` does, one sequence
    per document, in memory bounded by a block whatever the corpus size: the lengths go to a
    side file as they come and the .idx is streamed from it at the end. The caller makes it
    atomic (it writes into a temporary directory renamed into place once complete): a crash
    leaves no file a reader could take for whole."""

    BLOCK = 1 << 22  # documents per pass over the lengths when the .idx is written

    def __init__(self, prefix: str, dtype: np.dtype) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"IndexedWriter: dtype {self.dtype} has no Megatron code")
        self._bin = open(bin_path(prefix), "wb")
        self._lengths = open(prefix + ".lengths", "w+b")
        self.num_tokens = self.num_docs = 0

    def add_documents(self, ids_N: np.ndarray, lengths_S: np.ndarray) -> None:
        """Append documents given as their ids back to back and each one's length."""
        self._bin.write(np.ascontiguousarray(ids_N, dtype=self.dtype).tobytes())
        self._lengths.write(np.asarray(lengths_S, dtype=np.int32).tobytes())
        self.num_tokens += int(len(ids_N))
        self.num_docs += len(lengths_S)

    def close(self) -> None:
        self._bin.close()
        self._lengths.close()

    def finalize(self) -> int:
        """Close the .bin and write the .idx (header, lengths, byte pointers, document
        indices, each streamed); returns the number of documents."""
        self._bin.close()
        n, f = self.num_docs, self._lengths

        def blocks():
            f.seek(0)
            while block := f.read(4 * self.BLOCK):
                yield np.frombuffer(block, np.int32)
        with open(idx_path(self.prefix), "wb") as out:
            out.write(INDEX_HEADER)
            out.write(struct.pack("<QB", INDEX_VERSION, _CODE_OF[self.dtype]))
            out.write(struct.pack("<QQ", n, n + 1))
            for lengths_S in blocks():
                out.write(lengths_S.tobytes())
            offset = 0  # bytes before the block's first sequence
            for lengths_S in blocks():
                ends = offset + np.cumsum(lengths_S, dtype=np.int64) * self.dtype.itemsize
                out.write((ends - lengths_S.astype(np.int64) * self.dtype.itemsize).tobytes())
                offset = int(ends[-1])
            for lo in range(0, n + 1, self.BLOCK):
                out.write(np.arange(lo, min(lo + self.BLOCK, n + 1), dtype=np.int64).tobytes())
        f.close()
        os.remove(self.prefix + ".lengths")
        return n
