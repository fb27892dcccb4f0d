"""A Hugging Face ``datasets`` folder written by ``Dataset.save_to_disk``: ``state.json`` lists
its Arrow shards (``data-0000N-of-0000M.arrow``, Arrow IPC streams), read here with pyarrow
through a memory map, a few record batches per work unit (the ``datasets`` package is not
needed). One document per row: the string column ``data.text_field`` (default ``text``). A
``DatasetDict`` folder (``dataset_dict.json``) is refused naming its splits."""

from __future__ import annotations

import json
import os
from typing import Iterator

from moeplug.config import ConfigError
from moeplug.data.reader import CHUNK_BYTES, Chunk, CorpusReader, ReadOptions
from moeplug.data.readers.parquet import pyarrow_module, text_column


class HFDiskReader(CorpusReader):
    name = "hf_disk"
    record = "row"
    description = "a Hugging Face datasets folder written by save_to_disk"

    def claims(self, path: str) -> bool:
        return os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))

    def files(self, path: str) -> list[str]:
        dd = os.path.join(path, "dataset_dict.json")
        if os.path.isfile(dd):
            try:
                with open(dd, encoding="utf-8") as f:
                    splits = json.load(f).get("splits", [])
            except (OSError, ValueError):
                splits = []
            raise ConfigError(
                f"{path}: a DatasetDict (splits: {', '.join(splits) or 'none listed'}), not one "
                f"dataset. Fix: point data.corpus at one split's folder, e.g. "
                f"{os.path.join(path, splits[0] if splits else 'train')}")
        state = os.path.join(path, "state.json")
        try:
            with open(state, encoding="utf-8") as f:
                shards = [d["filename"] for d in json.load(f)["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{state}: not a datasets state.json listing its '_data_files' "
                              f"({type(e).__name__}: {e}). Fix: write the folder with "
                              f"Dataset.save_to_disk") from None
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"{state}: lists {missing[0]}, which is missing. Fix: copy the "
                              f"whole folder save_to_disk wrote")
        return files

    def chunks(self, path: str, options: ReadOptions) -> Iterator[Chunk]:
        pa = pyarrow_module(path)
        for f in self.files(path):
            with pa.memory_map(f) as src:
                reader = pa.ipc.open_stream(src)
                first, size, n = 0, 0, 0
                for batch in reader:  # zero-copy over the map: only the batch headers are read
                    n += 1
                    size += batch.nbytes
                    if size >= CHUNK_BYTES:
                        yield Chunk(f, (first, n))
                        first, size = n, 0
                if first < n:
                    yield Chunk(f, (first, n))

    def documents(self, chunk: Chunk, options: ReadOptions) -> Iterator[str]:
        pa = pyarrow_module(chunk.file)
        first, end = chunk.data
        with pa.memory_map(chunk.file) as src:
            reader = pa.ipc.open_stream(src)
            batches = []
            for i, batch in enumerate(reader):
                if i >= end:
                    break
                if i >= first:
                    batches.append(batch)
            for text in text_column(pa.Table.from_batches(batches, reader.schema),
                                    options.text_field, chunk.file):
                yield "" if text is None else text
