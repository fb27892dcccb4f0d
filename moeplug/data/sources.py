"""From ``data.corpus`` to corpus readers: the blend entries, each path's format (the reader
plugin that claims it), and a content fingerprint of the files behind it.

``data.corpus`` is a path (or ``shakespeare``) or a blend, Megatron's ``--data-path 0.3 A 0.7
B`` written as ``[{path: A, weight: 0.3}, {path: B, weight: 0.7}]`` (moeplug.config.data checks
it; the weights are normalised). An entry may name its format (``format: jsonl``); otherwise the
one reader whose ``claims(path)`` holds reads it, and none or several is an error listing the
readers.

Fingerprint: sha256 over every file's relative name and bytes. Hashing a large corpus on every
run would cost a pass over it, so each file's hash is remembered under ``<cache>/fingerprints``
keyed by its path, size, modification time and inode: a file that changes gets a new key.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from moeplug.config import ConfigError
from moeplug.config.data import CorpusEntry
from moeplug.data.reader import CorpusReader, summarise_names

_HASH_BLOCK = 8 << 20


def reader_for(host: Any, entry: CorpusEntry) -> CorpusReader:
    """The reader of ``entry``: the one it names, or the one reader that claims its path."""
    if entry.format:
        reader = host.create("dataset", entry.format, None, interface=CorpusReader)
        if not reader.claims(entry.path):
            raise ConfigError(f"{entry.field} = {entry.path!r}: not in format {entry.format!r} "
                              f"({reader.description}). Fix: correct the path or the format")
        return reader
    readers = {name: host.create("dataset", name, None, interface=CorpusReader)
               for name in host.names("dataset")}
    claimed = [name for name, r in readers.items() if r.claims(entry.path)]
    if len(claimed) == 1:
        return readers[claimed[0]]
    if claimed:
        raise ConfigError(f"{entry.field} = {entry.path!r}: several readers claim it "
                          f"({', '.join(claimed)}). Fix: name one with data.format (or the "
                          f"entry's format:)")
    known = "; ".join(f"{n}: {r.description}" for n, r in readers.items())
    raise ConfigError(f"{entry.field} = {entry.path!r}: unknown format, no reader claims it "
                      f"(readers: {known}). Fix: convert it to one of those, name the reader "
                      f"with data.format, or install a plugin that reads it")


def _file_hash(path: str, memo_dir: str) -> str:
    st = os.stat(path)
    key = hashlib.sha256(json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns,
                                     st.st_ino]).encode()).hexdigest()[:32]
    memo = os.path.join(memo_dir, key)
    try:
        with open(memo, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    digest = h.hexdigest()
    os.makedirs(memo_dir, exist_ok=True)
    tmp = f"{memo}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(digest)
    os.replace(tmp, memo)
    return digest


def fingerprint(reader: CorpusReader, path: str, cache_dir: str) -> str:
    """sha256 over the corpus' files (relative names and contents), memoised per file."""
    files = reader.files(path)
    if not files:
        raise ConfigError(f"data.corpus = {path!r}: the {reader.name} reader finds no files "
                          f"there. Fix: point data.corpus at your corpus")
    base = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    h = hashlib.sha256(reader.name.encode())
    memo_dir = os.path.join(cache_dir, "fingerprints")
    for f in files:
        h.update(f"\0{os.path.relpath(os.path.abspath(f), base)}\0".encode())
        h.update(_file_hash(f, memo_dir).encode())
    return h.hexdigest()


def ids_fingerprint(prefix: str, cache_dir: str) -> str:
    """sha256 over a prepared pair's .idx and .bin contents (not their names): the same ids
    give the same key wherever they came from (a raw corpus prepared into the cache, the
    folder ``moeplug data prepare`` wrote, a Megatron prefix)."""
    memo_dir = os.path.join(cache_dir, "fingerprints")
    h = hashlib.sha256(b"prepared ids")
    for ext in (".idx", ".bin"):
        h.update(_file_hash(prefix + ext, memo_dir).encode())
    return h.hexdigest()


def unknown_names(wanted: list[str], names: list[str], field: str, corpus: str) -> ConfigError:
    """The error for document names not in the corpus: a few close ones and how many exist."""
    import difflib
    missing = [n for n in wanted if n not in set(names)]
    close = sorted({c for n in missing for c in difflib.get_close_matches(n, names, n=3)})
    hint = f"close: {', '.join(close)}; " if close else ""
    return ConfigError(f"DataConfig.{field} = {wanted!r}: {summarise_names(missing)} not in "
                       f"corpus {corpus!r}. Fix: choose document names (file paths below the "
                       f"folder without .txt) from its {len(names):,} documents ({hint}e.g. "
                       f"{summarise_names(names, 5)})")
