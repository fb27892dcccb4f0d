"""Corpus readers: every format gives the same documents and ids, written by the tools users
have (json, gzip, zstandard, pyarrow, datasets' save_to_disk, Megatron's format); preparation
in worker processes equals preparation in one; every bad input is one ConfigError line naming
the file (and line or document), the field and the fix, and leaves nothing half-written."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from moeplug.config import ConfigError, DataConfig
from moeplug.data import prepare_corpus
from moeplug.data.indexed import open_indexed
from moeplug.data.prepare import prepare, read_meta
from moeplug.data.reader import CorpusReader, ReadOptions
from moeplug.data.tokenizer import ByteTokenizer
from moeplug.plugin_host import PluginHost

DOCS = ["first document\nwith two lines", "", "zweites Dokument: café ‘quotes’ 日本語",
        "third", "a longer one " * 50]
SEP = list(b"\n\n")


@pytest.fixture(scope="module")
def host():
    return PluginHost.load()


def reader(host, name):
    return host.create("dataset", name, None, interface=CorpusReader)


def expected_ids(docs=DOCS):
    return [list(d.encode("utf-8")) + SEP for d in docs if d]


def prepared_docs(folder):
    tokens = open_indexed(os.path.join(folder, "corpus"))
    return [tokens.get(i).tolist() for i in range(tokens.num_docs)]


def write_jsonl(path, docs=DOCS, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def prep(host, name, path, tmp_path, workers=0, **kw):
    out = str(tmp_path / f"out-{name}-{workers}")
    summary = prepare(reader(host, name), path, ByteTokenizer(), out, ReadOptions(**kw),
                      num_workers=workers)
    return out, summary


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_plain_gzip_zstd_give_the_documents_in_order(host, tmp_path, suffix):
    path = str(tmp_path / f"c{suffix}")
    if suffix == ".jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
            for i, d in enumerate(DOCS):
                f.write((json.dumps({"id": i, "text": d}) + "\n").encode())
    else:
        write_jsonl(path, opener=gzip.open if suffix.endswith(".gz") else open)
    out, summary = prep(host, "jsonl", path, tmp_path)
    assert prepared_docs(out) == expected_ids()
    assert (summary.documents, summary.empty) == (4, 1)
    assert summary.tokens == sum(map(len, expected_ids()))
    meta = read_meta(out)
    assert meta["documents"] == 4 and meta["empty"] == 1 and meta["tokenizer"] == "bytes"


def test_every_format_reads_the_same_documents(host, tmp_path):
    """JSONL, Parquet (pyarrow) and a datasets save_to_disk folder of the same rows."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    datasets = pytest.importorskip("datasets")
    write_jsonl(str(tmp_path / "c.jsonl"))
    table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
    pq.write_table(table, str(tmp_path / "c.parquet"), row_group_size=2)  # 3 row groups
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "hf"), num_shards=2)
    got = {
        "jsonl": prep(host, "jsonl", str(tmp_path / "c.jsonl"), tmp_path)[0],
        "parquet": prep(host, "parquet", str(tmp_path / "c.parquet"), tmp_path,
                        text_field="body")[0],
        "hf_disk": prep(host, "hf_disk", str(tmp_path / "hf"), tmp_path, text_field="body")[0],
    }
    for name, out in got.items():
        assert prepared_docs(out) == expected_ids(), name
    # datasets' own reader agrees on the rows moeplug read
    loaded = datasets.load_from_disk(str(tmp_path / "hf"))
    assert [r["body"] for r in loaded] == DOCS


def test_text_folder_reads_nested_files_in_sorted_order(host, tmp_path):
    d = tmp_path / "texts"
    (d / "sub" / "deeper").mkdir(parents=True)
    files = {"z.txt": "zed", "a.txt": "alpha", "sub/b.txt": "bee", "sub/deeper/c.txt": "sea",
             "sub/ignored.md": "not a document"}
    for name, text in files.items():
        (d / name).write_text(text, encoding="utf-8")
    r = reader(host, "txt")
    assert r.names(str(d)) == ["a", "sub/b", "sub/deeper/c", "z"]
    out, summary = prep(host, "txt", str(d), tmp_path)
    assert prepared_docs(out) == expected_ids(["alpha\n", "bee\n", "sea\n", "zed\n"])
    assert read_meta(out)["names"] == ["a", "sub/b", "sub/deeper/c", "z"]
    # the nested document can be held out by its path
    corpus = prepare_corpus(DataConfig(corpus=str(d), tokenizer="bytes", val_works=["sub/b"],
                                       cache_dir=str(tmp_path / "cache")))
    assert corpus.val_ids.tolist() == list(b"bee\n") + SEP


def test_workers_write_what_one_process_writes(host, tmp_path, monkeypatch):
    """Many small work units through 2 spawned workers: the same bytes as in-process."""
    import moeplug.data.readers.jsonl as jsonl
    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 256)  # chunks are cut in this process
    docs = [f"document {i}: " + "words " * (i % 17) for i in range(300)]
    write_jsonl(str(tmp_path / "c.jsonl"), docs)
    one, s1 = prep(host, "jsonl", str(tmp_path / "c.jsonl"), tmp_path, workers=0)
    two, s2 = prep(host, "jsonl", str(tmp_path / "c.jsonl"), tmp_path, workers=2)
    for f in ("corpus.bin", "corpus.idx", "token_counts.npy"):
        assert open(os.path.join(one, f), "rb").read() == open(os.path.join(two, f), "rb").read()
    assert prepared_docs(two) == expected_ids(docs)
    assert s1.documents == s2.documents == 300


# --------------------------------------------------------------------------------------------
# Bad input: one line each, naming file, line, field and fix; nothing half-written
# --------------------------------------------------------------------------------------------

def _fails(host, name, path, tmp_path, match, **kw):
    out = tmp_path / f"out-{name}"
    with pytest.raises(ConfigError, match=match) as info:
        prepare(reader(host, name), str(path), ByteTokenizer(), str(out), ReadOptions(**kw))
    assert "\n" not in str(info.value)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    return str(info.value)


def test_jsonl_line_that_is_not_json_names_file_and_line(host, tmp_path, monkeypatch):
    import moeplug.data.readers.jsonl as jsonl
    monkeypatch.setattr(jsonl, "CHUNK_BYTES", 64)  # the bad line is several chunks in
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(40)]
    lines[27] = '{"text": "unterminated'
    path.write_text("\n".join(lines) + "\n")
    _fails(host, "jsonl", path, tmp_path, rf"^{path} line 28: not JSON \(.*\)\. Fix: write one "
           r"JSON object per line$")


def test_jsonl_line_without_the_text_field(host, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"content": "b", "id": 1}\n')
    _fails(host, "jsonl", path, tmp_path, rf"^{path} line 2: no field 'text' \(data.text_field; "
           r"its keys: 'content', 'id'\)\. Fix: set data.text_field to the key")


@pytest.mark.parametrize("line, what", [('[1, 2]', "a JSON list, not an object"),
                                        ('{"text": 7}', "field 'text' holds a int")])
def test_jsonl_record_of_the_wrong_shape(host, tmp_path, line, what):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    _fails(host, "jsonl", path, tmp_path, rf"^{path} line 2: {what}.*Fix: ")


def test_jsonl_bytes_that_are_not_utf8(host, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    _fails(host, "jsonl", path, tmp_path, rf"^{path} line 2: .*not UTF-8.*Fix: re-encode")


def test_text_file_bytes_that_are_not_utf8_are_never_replaced(host, tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "good.txt").write_text("fine")
    (d / "latin1.txt").write_bytes("naïve".encode("latin-1"))
    _fails(host, "txt", d, tmp_path, rf"^{d / 'latin1.txt'}: byte 2 \(0xef\) is not UTF-8 "
           r"\(invalid continuation byte\)\. Fix: re-encode it as UTF-8")


def test_parquet_without_the_column(host, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["a"]}), str(tmp_path / "c.parquet"))
    _fails(host, "parquet", tmp_path / "c.parquet", tmp_path,
           r"c.parquet \(row group 0\): no column 'text' \(data.text_field; its columns: "
           r"'content'\)\. Fix: set data.text_field")


def test_datasets_dict_folder_is_refused_naming_its_splits(host, tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"a DatasetDict \(splits: train, validation\), not "
                       r"one dataset\. Fix: point data.corpus at one split's folder, e\.g\. "
                       rf"{tmp_path / 'dd' / 'train'}"):
        reader(host, "hf_disk").files(str(tmp_path / "dd"))


def test_unknown_format_lists_the_readers(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"data.corpus = '.*data.csv': unknown format, no "
                       r"reader claims it \(readers: .*jsonl: JSON Lines.*megatron: .*\)\. Fix: "):
        prepare_corpus(DataConfig(corpus=str(tmp_path / "data.csv"), tokenizer="bytes",
                                  cache_dir=str(tmp_path / "c")))


def test_folder_two_readers_claim_needs_data_format(tmp_path):
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("a text document")
    write_jsonl(str(tmp_path / "mixed" / "b.jsonl"))
    common = dict(corpus=str(tmp_path / "mixed"), tokenizer="bytes", val_fraction=0.5,
                  cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"several readers claim it \(jsonl, txt\)\. Fix: "
                       r"name one with data.format"):
        prepare_corpus(DataConfig(**common))
    corpus = prepare_corpus(DataConfig(**common, format="jsonl"))
    assert len(corpus.train[0].docs) + len(corpus.val[0].docs) == 4


@pytest.mark.parametrize("weight", [0, -0.5, "x", float("nan")])
def test_blend_weight_that_is_not_positive(weight):
    with pytest.raises(ConfigError, match=r"DataConfig.corpus = .*: entry 1 \('b'\) has weight "
                       r".* not a positive number .*Fix: give every corpus a weight > 0"):
        DataConfig(corpus=[{"path": "a", "weight": 0.5}, {"path": "b", "weight": weight}])


def test_empty_documents_are_skipped_and_counted_not_an_error(host, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": ""}\n\n{"text": null}\n{"text": "kept"}\n')
    out, summary = prep(host, "jsonl", str(path), tmp_path)
    assert (summary.documents, summary.empty) == (1, 3)
    assert "1 documents, 6 tokens, 3 empty documents skipped" in summary.line(str(path))


def test_val_works_error_for_thousands_of_files_names_a_few(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(3574):
        (d / f"file_{i:05d}.txt").write_text(f"text {i}")
    with pytest.raises(ConfigError) as info:
        prepare_corpus(DataConfig(corpus=str(d), tokenizer="bytes", val_works=["nope"],
                                  cache_dir=str(tmp_path / "c")))
    message = str(info.value)
    assert len(message) < 600 and "(3,574 in all)" in message and "file_00000" in message
    assert message.count("file_") <= 8


# --------------------------------------------------------------------------------------------
# Megatron's .bin/.idx: damaged pairs are refused naming the file
# --------------------------------------------------------------------------------------------

@pytest.fixture
def megatron_prefix(host, tmp_path):
    path = tmp_path / "c.jsonl"
    write_jsonl(str(path))
    out, _ = prep(host, "jsonl", str(path), tmp_path)
    return os.path.join(out, "corpus")


def test_truncated_bin_is_refused(megatron_prefix):
    size = os.path.getsize(megatron_prefix + ".bin")
    with open(megatron_prefix + ".bin", "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(ConfigError, match=rf"^{megatron_prefix}.bin: {size - 3} bytes, but .* "
                       rf"describes {size // 2} uint16 tokens = {size} bytes \(truncated\)\. Fix: "
                       r"prepare it again"):
        open_indexed(megatron_prefix)


@pytest.mark.parametrize("offset, value, match", [
    # int32: twice the bytes the .bin's uint16 ids take
    (17, bytes([4]), r"corpus.bin: \d+ bytes, but .* describes \d+ int32 tokens = \d+ bytes; it "
                     r"holds exactly that many uint16 ids: the .idx says int32 \(code 4\)"),
    (18, (7).to_bytes(8, "little"), r"corpus.idx: \d+ bytes, but its counts \(7 sequences, 5 "
                                    r"document indices\) need \d+ \(truncated or not a "
                                    r"version-1 index\)"),
    (0, b"NOTMEGA", r"corpus.idx: not a Megatron index: it does not start with"),
], ids=["dtype", "counts", "header"])
def test_idx_that_does_not_match_the_bin(megatron_prefix, offset, value, match):
    with open(megatron_prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value)
    with pytest.raises(ConfigError, match=match):
        open_indexed(megatron_prefix)


def test_token_ids_outside_the_vocabulary_name_the_document(tmp_path):
    from moeplug.data.indexed import IndexedWriter
    prefix = str(tmp_path / "wide")
    w = IndexedWriter(prefix, np.uint16)
    w.add_documents(np.array([1, 2, 3, 300, 5], np.uint16), np.array([2, 3], np.int32))
    w.finalize()
    with pytest.raises(ConfigError, match=rf"^{prefix}.bin: document 1 holds token id 300 \(the "
                       r"corpus' largest is 300\), outside the vocabulary of 256 ids "
                       r"\(data.tokenizer = 'bytes'\)\. Fix: set data.tokenizer"):
        prepare_corpus(DataConfig(corpus=prefix, tokenizer="bytes", val_fraction=0.5,
                                  cache_dir=str(tmp_path / "c")))


def test_every_builtin_reader_meets_the_reader_contract_on_a_sample(host, tmp_path):
    """moeplug.testing.check_reader with a sample of each format and the texts it holds."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    datasets = pytest.importorskip("datasets")
    from moeplug.testing import check_reader
    write_jsonl(str(tmp_path / "c.jsonl"))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
    pq.write_table(pa.table({"text": DOCS}), str(tmp_path / "c.parquet"), row_group_size=2)
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "hf"), num_shards=2)
    (tmp_path / "t" / "sub").mkdir(parents=True)
    (tmp_path / "t" / "a.txt").write_text("alpha")
    (tmp_path / "t" / "sub" / "b.txt").write_text("beta")
    samples = {"jsonl": [(tmp_path / "c.jsonl", DOCS), (tmp_path / "c.jsonl.gz", DOCS)],
               "parquet": [(tmp_path / "c.parquet", DOCS)], "hf_disk": [(tmp_path / "hf", DOCS)],
               "txt": [(tmp_path / "t", ["alpha\n", "beta\n"])]}
    for name, cases in samples.items():
        for path, expected in cases:
            check_reader(host, name, corpus=str(path), expected=expected)
    out, _ = prep(host, "jsonl", str(tmp_path / "c.jsonl"), tmp_path)
    check_reader(host, "megatron", corpus=os.path.join(out, "corpus"))
    check_reader(host, "shakespeare")


def test_a_prepared_folder_carries_its_bpe_and_refuses_another_tokenizer(host, tmp_path):
    from moeplug.data.tokenizer import BPETokenizer
    docs = [f"document {i}: " + "the quick brown fox jumps " * (i % 5 + 1) for i in range(40)]
    write_jsonl(str(tmp_path / "c.jsonl"), docs)
    tok = BPETokenizer.train(docs, 300)
    out = str(tmp_path / "prepared")
    prepare(reader(host, "jsonl"), str(tmp_path / "c.jsonl"), tok, out, ReadOptions())
    corpus = prepare_corpus(DataConfig(corpus=out, tokenizer="bpe", val_fraction=0.1,
                                       cache_dir=str(tmp_path / "c")))
    assert corpus.tokenizer.fingerprint() == tok.fingerprint()
    assert corpus.train_ids.tolist() == [t for d in docs[:36] for t in tok.encode(d)
                                         + tok.encode("\n\n")]
    with pytest.raises(ConfigError, match=r"data.corpus = '.*prepared': prepared with another "
                       r"tokenizer \(bpe-sha256:.*; its meta.json\) than data.tokenizer = "
                       r"'bytes' gives \(bytes\)\. Fix: set data.tokenizer"):
        prepare_corpus(DataConfig(corpus=out, tokenizer="bytes", val_fraction=0.1,
                                  cache_dir=str(tmp_path / "c")))
