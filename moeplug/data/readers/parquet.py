"""Parquet: a ``.parquet`` file or a folder of them (nested folders included, sorted by path),
read with pyarrow one row group at a time. One document per row: the string column
``data.text_field`` (default ``text``); a null is an empty document (skipped and counted)."""

from __future__ import annotations

from typing import Iterator

from moeplug.config import ConfigError
from moeplug.data.reader import Chunk, CorpusReader, ReadOptions, file_or_files_under

PYARROW_INSTALL = "pip install pyarrow"


def pyarrow_module(what: str):
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(f"{what}: reading it needs the package 'pyarrow', which is not "
                          f"installed. Fix: {PYARROW_INSTALL}") from None
    return pyarrow


def text_column(table, field: str, where: str) -> list:
    """The ``field`` column of an Arrow table as Python values (strings or None)."""
    pa = pyarrow_module(where)
    if field not in table.column_names:
        raise ConfigError(f"{where}: no column {field!r} (data.text_field; its columns: "
                          f"{', '.join(map(repr, table.column_names[:8]))}). Fix: set "
                          f"data.text_field to the column holding the text")
    column = table.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ConfigError(f"{where}: column {field!r} is {column.type}, not a string. Fix: set "
                          f"data.text_field to the column holding the text")
    return column.to_pylist()


class ParquetReader(CorpusReader):
    name = "parquet"
    record = "row"
    description = "Parquet files (pyarrow), a file or a folder of them"

    def claims(self, path: str) -> bool:
        return bool(self.files(path))

    def files(self, path: str) -> list[str]:
        return file_or_files_under(path, (".parquet",))

    def chunks(self, path: str, options: ReadOptions) -> Iterator[Chunk]:
        pyarrow_module(path)
        import pyarrow.parquet as pq
        for f in self.files(path):
            for g in range(pq.ParquetFile(f).metadata.num_row_groups):
                yield Chunk(f, g)

    def documents(self, chunk: Chunk, options: ReadOptions) -> Iterator[str]:
        import pyarrow.parquet as pq
        table = pq.ParquetFile(chunk.file).read_row_group(chunk.data)
        for text in text_column(table, options.text_field,
                                f"{chunk.file} (row group {chunk.data})"):
            yield "" if text is None else text
