"""JSON Lines: a ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` file, or a folder of them (nested
folders included, sorted by path). One document per line: the string under
``data.text_field`` (default ``text``). A blank line or a null text is an empty document
(skipped and counted); a line that is not JSON, not an object, lacks the field or holds no
string there is an error naming the file and the line.

Plain files are cut into byte ranges at line ends, which the workers read themselves; a
compressed file is decompressed in the main process as a stream and its lines are sent in
blocks, so memory stays bounded either way.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from typing import Iterator

from moeplug.config import ConfigError
from moeplug.data.reader import (CHUNK_BYTES, Chunk, CorpusReader, ReadOptions, RecordError,
                                 file_or_files_under)

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
ZSTD_INSTALL = "pip install zstandard"


def _open_stream(path: str) -> io.BufferedIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"{path}: reading .zst needs the package 'zstandard', which is "
                              f"not installed. Fix: {ZSTD_INSTALL}") from None
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


class JsonlReader(CorpusReader):
    name = "jsonl"
    record = "line"
    description = "JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst), a file or a folder of them"

    def claims(self, path: str) -> bool:
        return bool(self.files(path))

    def files(self, path: str) -> list[str]:
        return file_or_files_under(path, SUFFIXES)

    def chunks(self, path: str, options: ReadOptions) -> Iterator[Chunk]:
        for f in self.files(path):
            if f.endswith(".jsonl"):
                yield from _byte_ranges(f)
            else:
                yield from _line_blocks(f)

    def documents(self, chunk: Chunk, options: ReadOptions) -> Iterator[str]:
        data = chunk.data
        if isinstance(data, tuple):  # (start, end) of a plain file
            with open(chunk.file, "rb") as f:
                f.seek(data[0])
                data = f.read(data[1] - data[0])
        field = options.text_field
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the newline that ends the last line starts no line
        for i, line in enumerate(lines):
            if not line.strip():
                yield ""
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError as e:
                raise RecordError(i, f"{{where}}: byte {e.start} of the line is not UTF-8 "
                                  f"({e.reason}). Fix: re-encode the file as UTF-8") from None
            except ValueError as e:
                raise RecordError(i, f"{{where}}: not JSON ({e}). Fix: write one JSON object "
                                  f"per line") from None
            if not isinstance(record, dict):
                raise RecordError(i, f"{{where}}: a JSON {type(record).__name__}, not an "
                                  f"object. Fix: write one object per line, e.g. "
                                  f'{{"{field}": "..."}}')
            if field not in record:
                keys = ", ".join(map(repr, list(record)[:8])) or "none"
                raise RecordError(i, f"{{where}}: no field {field!r} (data.text_field; its keys: "
                                  f"{keys}). Fix: set data.text_field to the key holding the "
                                  f"text, or add {field!r} to every line")
            text = record[field]
            if text is None:
                yield ""
            elif isinstance(text, str):
                yield text
            else:
                raise RecordError(i, f"{{where}}: field {field!r} holds a "
                                  f"{type(text).__name__}, not a string. Fix: set "
                                  f"data.text_field to the key holding the text")


def _byte_ranges(path: str) -> Iterator[Chunk]:
    """(start, end) ranges of about CHUNK_BYTES, each ending just after a newline (or at EOF)."""
    size = os.path.getsize(path)
    start = 0
    with open(path, "rb") as f:
        while start < size:
            end = min(start + CHUNK_BYTES, size)
            if end < size:
                f.seek(end)
                while True:  # on to the end of the line (a line longer than a chunk: whole)
                    block = f.read(1 << 16)
                    if not block:
                        end = size
                        break
                    nl = block.find(b"\n")
                    if nl >= 0:
                        end += nl + 1
                        break
                    end += len(block)
            yield Chunk(path, (start, end))
            start = end


def _line_blocks(path: str) -> Iterator[Chunk]:
    """Blocks of whole lines of a compressed file, decompressed here as one stream."""
    with _open_stream(path) as stream:
        rest = b""
        while True:
            block = stream.read(CHUNK_BYTES)
            if not block:
                break
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # no line end yet: keep reading
                rest = block
                continue
            yield Chunk(path, block[:cut])
            rest = block[cut:]
        if rest:
            yield Chunk(path, rest)
