"""The corpus-reader interface: what a data-format plugin implements.

A reader is registered by the ``moeplug_register_datasets`` hook (moeplug.hookspecs), as the
built-in ones are (moeplug.data.readers, entry point ``builtin_datasets``). It turns a path into
documents in one fixed order, in two halves so that tokenisation runs in worker processes
(moeplug.data.prepare) with bounded memory:

1. ``chunks(path, options)`` runs in the main process and cuts the corpus into picklable work
   units, in corpus order, each a few MiB of text (a byte range of a file, a row group...);
2. ``documents(chunk, options)`` runs in a worker and yields that unit's documents' texts.

A reader of an already tokenised format sets ``prepared = True`` and implements
``open_prepared(path)`` instead (Megatron's .bin/.idx: moeplug.data.indexed.IndexedTokens).

Errors: a bad record raises :class:`RecordError` with its index inside the chunk; the main
process names the file and the record's position in it (``data.jsonl line 12``), so every data
error is one line naming the file, the line and the fix (moeplug.config.ConfigError, exit 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from moeplug.config import ConfigError

CHUNK_BYTES = 4 << 20  # text per work unit: large enough to amortise IPC, small enough to bound


@dataclass(frozen=True)
class ReadOptions:
    """What the data config says about reading (every reader gets it)."""

    text_field: str = "text"  # JSONL key / Parquet and Arrow column holding the text


@dataclass(frozen=True)
class Chunk:
    """One work unit: ``file`` (for messages and record numbering: records count from the
    file's first chunk on) and reader-specific ``data``."""

    file: str
    data: Any


class RecordError(Exception):
    """Raised by ``documents`` for a bad record: ``index`` counts the chunk's records from 0,
    ``message`` holds ``{where}`` where the file and line go, and says the fix."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index, self.message = index, message


class CorpusReader:
    """Base class of a corpus format (see the module docstring)."""

    name: ClassVar[str] = ""
    # What a record is called in messages ("line", "row"); "" when a record is a whole file.
    record: ClassVar[str] = ""
    # Documents have names (file stems): ``data.val_works`` can hold some of them out.
    named: ClassVar[bool] = False
    # Token ids, not text: opened with ``open_prepared``, never tokenised.
    prepared: ClassVar[bool] = False
    description: ClassVar[str] = ""

    def __init__(self, options: Any = None) -> None:
        """The plugin host calls the factory with the reader's options (None: it takes none)."""

    def claims(self, path: str) -> bool:
        """Whether ``path`` is in this format (cheap: names and headers only)."""
        raise NotImplementedError

    def files(self, path: str) -> list[str]:
        """The files the corpus consists of, in corpus order (content fingerprint, messages)."""
        raise NotImplementedError

    def names(self, path: str) -> list[str]:
        """Named readers: each document's name, in corpus order (empty ones included)."""
        raise NotImplementedError

    def chunks(self, path: str, options: ReadOptions) -> Iterator[Chunk]:
        raise NotImplementedError

    def documents(self, chunk: Chunk, options: ReadOptions) -> Iterator[str]:
        """The texts of ``chunk``'s records (one per record; "" for an empty document, which
        preparation skips and counts)."""
        raise NotImplementedError

    def open_prepared(self, path: str) -> Any:
        raise NotImplementedError


def files_under(folder: str, suffixes: tuple[str, ...]) -> list[str]:
    """Every file below ``folder`` (nested folders too) ending in one of ``suffixes``, sorted by
    relative path so the order never depends on the filesystem."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        found += [os.path.join(root, n) for n in names if n.endswith(suffixes)]
    return sorted(found, key=lambda p: os.path.relpath(p, folder).split(os.sep))


def file_or_files_under(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """``[path]`` for a file ending in one of ``suffixes``, the matching files below a folder
    (:func:`files_under`), else []: what a one-file-or-a-folder format reads."""
    if os.path.isfile(path):
        return [path] if path.endswith(suffixes) else []
    return files_under(path, suffixes) if os.path.isdir(path) else []


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8, or a ConfigError naming the first bad byte (never replaced
    silently)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: byte {e.start} (0x{data[e.start]:02x}) is not UTF-8 ({e.reason}). Fix: "
            f"re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove it from the "
            f"corpus") from None


def head_bytes(path: str, n: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def summarise_names(names: list[str], limit: int = 8) -> str:
    """A few of ``names`` and how many there are: an error never lists thousands."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names):,} in all)"
