"""Corpus-reader contract (moeplug.data.reader): a CorpusReader with a name, a description and
bool flags; ``claims`` is False for a path that does not exist; a text reader implements
``files``/``chunks``/``documents`` (a prepared one ``open_prepared``). Given a sample
``corpus`` and the texts it holds (``expected``), also: it claims the sample, its work units
survive pickling (they travel to worker processes) and, read back in order, give exactly
``expected``, each unit's texts a list of str."""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any

from moeplug.data.reader import CorpusReader, ReadOptions
from moeplug.testing._common import build, expect


def check_reader(source: Any, name: str | None = None, *, corpus: str | None = None,
                 expected: list[str] | None = None, options: ReadOptions = ReadOptions()) -> None:
    reader, label = build(source, "dataset", name, None)
    expect(isinstance(reader, CorpusReader), label,
           f"is a {type(reader).__name__}, not a moeplug.data.reader.CorpusReader")
    expect(isinstance(reader.name, str) and reader.name, label,
           f"name must be a non-empty str, got {reader.name!r}")
    expect(isinstance(reader.description, str) and reader.description, label,
           "needs a description (`moeplug plugins` and the unknown-format error list it)")
    expect(isinstance(reader.record, str), label, f"record must be a str, got {reader.record!r}")
    for flag in ("named", "prepared"):
        expect(isinstance(getattr(reader, flag), bool), label, f"{flag} must be a bool")
    needed = ("open_prepared",) if reader.prepared else ("claims", "files", "chunks",
                                                          "documents")
    for method in needed:
        expect(getattr(type(reader), method) is not getattr(CorpusReader, method), label,
               f"does not implement {method}")
    if reader.named:
        expect(getattr(type(reader), "names") is not CorpusReader.names, label,
               "is named but does not implement names")
    missing = os.path.join(tempfile.gettempdir(), "moeplug-no-such-corpus", "x")
    claimed = reader.claims(missing)
    expect(claimed is False, label, f"claims({missing!r}) must be False, got {claimed!r}")
    if corpus is None:
        return
    expect(reader.claims(corpus) is True, label, f"does not claim its sample {corpus!r}")
    if reader.prepared:
        return
    texts: list[str] = []
    for chunk in reader.chunks(corpus, options):
        again = pickle.loads(pickle.dumps(chunk))  # what a worker process receives
        got = list(reader.documents(again, options))
        expect(all(isinstance(t, str) for t in got), label,
               f"documents({chunk!r}) must yield str, got {[type(t).__name__ for t in got]}")
        texts += got
    if expected is not None:
        expect(texts == list(expected), label, f"read {texts[:3]!r}... from {corpus!r}, "
               f"expected {list(expected)[:3]!r}... ({len(texts)} vs {len(expected)} records)")
    if reader.named:
        expect(len(reader.names(corpus)) == len(texts), label,
               f"names() gives {len(reader.names(corpus))} names for {len(texts)} documents")
