"""The built-in corpus readers, one format per module, registered through the ``moeplug``
entry-point group (``builtin_datasets`` in moeplug's pyproject.toml) exactly as a third-party
package registers its own: the data code finds them through the plugin host, never by import."""

from __future__ import annotations

from moeplug.hookspecs import hookimpl


@hookimpl
def moeplug_register_datasets(registry) -> None:
    from moeplug.data.readers.hf_disk import HFDiskReader
    from moeplug.data.readers.jsonl import JsonlReader
    from moeplug.data.readers.megatron import MegatronReader
    from moeplug.data.readers.parquet import ParquetReader
    from moeplug.data.readers.text import ShakespeareReader, TextFolderReader
    for cls, requires, hint in (
            (ShakespeareReader, (), ""), (TextFolderReader, (), ""), (JsonlReader, (), ""),
            (ParquetReader, ("pyarrow",), "pip install pyarrow"),
            (HFDiskReader, ("pyarrow",), "pip install pyarrow"), (MegatronReader, (), "")):
        registry.add(cls.name, cls, requires=requires, description=cls.description,
                     install_hint=hint)
