"""A CSV corpus reader: the smallest complete moeplug dataset plugin.

``claims`` says which paths are its format; ``chunks`` (main process) cuts the corpus into
picklable work units in order; ``documents`` (a worker process) yields each unit's texts.
"""

from __future__ import annotations

import csv
import io

from moeplug.api import Chunk, CorpusReader, file_or_files_under, hookimpl, RecordError


class CsvReader(CorpusReader):
    name = "csv"
    record = "row"
    description = "CSV files with a header row (moeplug-example-reader), one document per row"

    def claims(self, path):  # cheap: file names only
        return bool(self.files(path))

    def files(self, path):  # a .csv file, or every .csv below a folder, in sorted order
        return file_or_files_under(path, (".csv",))

    def chunks(self, path, options):
        for f in self.files(path):
            yield Chunk(f, None)  # a whole file per unit: fine for an example

    def documents(self, chunk, options):
        with open(chunk.file, encoding="utf-8", newline="") as f:
            for i, row in enumerate(csv.DictReader(io.StringIO(f.read()))):
                if options.text_field not in row or row[options.text_field] is None:
                    raise RecordError(i, f"{{where}}: no column {options.text_field!r}. Fix: "
                                      f"set data.text_field to the column holding the text")
                yield row[options.text_field]


@hookimpl
def moeplug_register_datasets(registry):
    registry.add("csv", CsvReader, description=CsvReader.description)
