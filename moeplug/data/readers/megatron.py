"""Megatron-Core's prepared format, read natively (moeplug.data.indexed): a path prefix with
``PREFIX.bin`` + ``PREFIX.idx`` as ``tools/preprocess_data.py`` or ``IndexedDatasetBuilder``
write them (``data.corpus: /data/wiki_text_document``; ``.bin``/``.idx`` on the end is accepted
too), or a folder holding one such pair (what ``moeplug data prepare --out DIR`` writes).
Training reads the ids as they are: the same documents (sequences), the same ids."""

from __future__ import annotations

import os

from moeplug.data.indexed import IndexedTokens, bin_path, idx_path, open_indexed
from moeplug.data.reader import CorpusReader


def prefix_of(path: str) -> str | None:
    """The .bin/.idx prefix ``path`` names, or None."""
    for end in (".bin", ".idx"):
        if path.endswith(end) and os.path.isfile(path[:-len(end)] + ".idx"):
            return path[:-len(end)]
    if os.path.isfile(idx_path(path)) or os.path.isfile(bin_path(path)):
        return path
    if os.path.isdir(path):
        pairs = sorted(f[:-len(".idx")] for f in os.listdir(path) if f.endswith(".idx"))
        if len(pairs) == 1:
            return os.path.join(path, pairs[0])
    return None


class MegatronReader(CorpusReader):
    name = "megatron"
    prepared = True
    description = "Megatron-Core prepared ids: PREFIX.bin + PREFIX.idx (or a folder with one pair)"

    def claims(self, path: str) -> bool:
        return prefix_of(path) is not None

    def files(self, path: str) -> list[str]:
        prefix = prefix_of(path) or path
        return [idx_path(prefix), bin_path(prefix)]

    def open_prepared(self, path: str) -> IndexedTokens:
        return open_indexed(prefix_of(path) or path)
