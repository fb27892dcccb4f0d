"""Proof against Megatron-Core 0.16.1 (the test extra installs it beside torch 2.13.0, CPU):

- a corpus written by its ``IndexedDatasetBuilder`` is read by moeplug, every document's ids
  exactly; what ``moeplug data prepare`` writes, its ``IndexedDataset`` reads identically (and
  the files are byte for byte the builder's for the same ids);
- moeplug's epoch-0 indices are its ``GPTDataset``'s (document, sample and shuffle index, and
  every sample's tokens), built on the CPU from the same files, split and seed;
- the blend is its ``build_blending_indices`` / ``build_exhaustive_blending_indices``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="pip install megatron-core==0.16.1 (test extra)")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|APEX).*")
# megatron-core 0.16.1 under numpy 2: its readers warn about numpy's copy keyword, every call
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
torch = pytest.importorskip("torch")

from megatron.core.datasets import helpers  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import (IndexedDataset,  # noqa: E402
                                                    IndexedDatasetBuilder)
from megatron.core.datasets.utils import Split  # noqa: E402

from moeplug.config import DataConfig  # noqa: E402
from moeplug.data import prepare_corpus  # noqa: E402
from moeplug.data.indexed import IndexedWriter, open_indexed  # noqa: E402
from moeplug.data.sampling import (CorpusSamples, blending_indices,  # noqa: E402
                                   exhaustive_blending_indices)


def megatron_corpus(prefix, docs, dtype, split_sentences=False):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids in docs:
        if split_sentences:  # preprocess_data.py --split-sentences: one sequence per sentence
            cut = len(ids) // 2
            for part in (ids[:cut], ids[cut:]):
                builder.add_item(torch.tensor(part, dtype=torch.int64))
            builder.end_document()
        else:
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + ".idx")


def random_docs(n, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(2, 300))).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 50_000), (np.int32, 150_000)])
@pytest.mark.parametrize("split_sentences", [False, True])
def test_moeplug_reads_what_megatron_writes(tmp_path, dtype, vocab, split_sentences):
    prefix = str(tmp_path / "mega_text_document")
    docs = random_docs(40, vocab, 1)
    megatron_corpus(prefix, docs, dtype, split_sentences)
    mine = open_indexed(prefix)
    theirs = IndexedDataset(prefix)
    assert mine.num_docs == len(theirs) and mine.dtype == theirs.index.dtype
    for i in range(len(theirs)):
        assert mine.get(i).tolist() == theirs[i].tolist()
        assert mine.get(i, 1, 2).tolist() == theirs.get(i, offset=1, length=2).tolist()
    assert mine.document_indices.tolist() == theirs.document_indices.tolist()
    sequences = [s for d in docs for s in ((d[:len(d) // 2], d[len(d) // 2:])
                                           if split_sentences else (d,))]
    assert [mine.get(i).tolist() for i in range(mine.num_docs)] == sequences


def test_training_reads_a_megatron_prefix_as_its_documents(tmp_path):
    prefix = str(tmp_path / "mega_text_document")
    docs = random_docs(20, 256, 2)
    megatron_corpus(prefix, docs, np.uint16)
    corpus = prepare_corpus(DataConfig(corpus=prefix, tokenizer="bytes", val_fraction=0.1,
                                       cache_dir=str(tmp_path / "c")))
    assert corpus.train_ids.tolist() == [t for d in docs[:18] for t in d]
    assert corpus.val_ids.tolist() == [t for d in docs[18:] for t in d]
    # the prefix is read where it lies: nothing copied into the cache
    assert corpus.train[0].tokens.prefix == prefix


@pytest.mark.parametrize("block", [IndexedWriter.BLOCK, 7])  # 7: the .idx in several passes
def test_megatron_reads_what_moeplug_writes(tmp_path, monkeypatch, block):
    monkeypatch.setattr(IndexedWriter, "BLOCK", block)
    docs = random_docs(30, 50_000, 3)
    ours = str(tmp_path / "ours")
    w = IndexedWriter(ours, np.uint16)
    for part in (docs[:11], docs[11:]):
        w.add_documents(np.array([t for d in part for t in d], np.uint16),
                        np.array([len(d) for d in part], np.int32))
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx"]
    theirs = str(tmp_path / "theirs")
    megatron_corpus(theirs, docs, np.uint16)
    for ext in (".bin", ".idx"):  # byte for byte the builder's files
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read()
    ds = IndexedDataset(ours)
    assert [ds[i].tolist() for i in range(len(ds))] == docs


def test_megatron_reads_what_moeplug_data_prepare_writes(tmp_path, cli_env):
    lines = [{"text": f"document {i}: " + "lorem ipsum " * (i % 9)} for i in range(50)]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "prepared"
    done = subprocess.run([sys.executable, "-m", "moeplug", "data", "prepare", "--corpus",
                           str(src), "--tokenizer", "bytes", "--out", str(out), "--workers", "2"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "50 documents" in done.stdout
    ds = IndexedDataset(str(out / "corpus"))
    assert [ds[i].tolist() for i in range(len(ds))] == \
        [list(r["text"].encode()) + list(b"\n\n") for r in lines]


class _Tokenizer:
    """What GPTDatasetConfig reads of a tokenizer (its ids never meet ours: pad out of range)."""

    vocab_size = 256
    eod = 0
    pad = -1
    unique_identifiers = {"class": "test"}


@pytest.mark.parametrize("seq_len, seed", [(32, 1234), (7, 5)])
def test_epoch_zero_is_megatron_gptdataset(tmp_path, seq_len, seed):
    prefix = str(tmp_path / "mega_text_document")
    docs = random_docs(60, 256, 4)
    megatron_corpus(prefix, docs, np.uint16)
    corpus = prepare_corpus(DataConfig(corpus=prefix, tokenizer="bytes", val_fraction=0.2,
                                       cache_dir=str(tmp_path / "c")))
    ours = corpus.train_samples(seq_len, seed).corpora[0]
    train_docs = corpus.train[0].docs
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, split="80,20,0",
                           tokenizer=_Tokenizer(), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False,
                           path_to_cache=str(tmp_path / "megatron_cache"))
    theirs = GPTDataset(IndexedDataset(prefix), prefix, train_docs.astype(np.int32), None,
                        Split.train, cfg)
    document_index, sample_index, shuffle_index = ours.epoch(0)
    assert np.array_equal(document_index, theirs.document_index)
    assert np.array_equal(sample_index, theirs.sample_index)
    assert np.array_equal(shuffle_index, theirs.shuffle_index)
    assert len(theirs) == ours.samples_per_epoch
    for i in range(len(theirs)):
        item = theirs[i]
        tokens = item["tokens"].tolist() + item["labels"][-1:].tolist()
        assert ours.sample(i).tolist() == tokens, i


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.5, 0.3], [1e-3, 1 - 1e-3]])
def test_blend_is_megatron_build_blending_indices(weights):
    size = 5000
    w = np.array(weights, np.float64)
    which_m = np.zeros(size, np.int16)
    where_m = np.zeros(size, np.int64)
    helpers.build_blending_indices(which_m, where_m, w, len(w), size, False)
    which, where, _ = blending_indices(w, 0, np.zeros(len(w), np.int64), size)
    assert np.array_equal(which, which_m) and np.array_equal(where, where_m)
    # built in two pieces, the counts carried over: the same sequence
    a = blending_indices(w, 0, np.zeros(len(w), np.int64), 1234)
    b = blending_indices(w, 1234, a[2], size - 1234)
    assert np.array_equal(np.concatenate([a[0], b[0]]), which_m)


def test_validation_interleaving_is_megatron_exhaustive_blending():
    sizes = [13, 40, 7]
    total = sum(sizes)
    which_m = np.zeros(total, np.int16)
    where_m = np.zeros(total, np.int64)
    helpers.build_exhaustive_blending_indices(which_m, where_m, np.array(sizes, np.int64),
                                              len(sizes))
    which, where = exhaustive_blending_indices(sizes)
    assert np.array_equal(which, which_m) and np.array_equal(where, where_m)


def test_sample_stream_reads_epoch_one_from_the_next_seed(tmp_path):
    """Epoch e is Megatron's one-epoch index for random_seed = seed + e."""
    prefix = str(tmp_path / "m")
    megatron_corpus(prefix, random_docs(25, 256, 5), np.uint16)
    tokens = open_indexed(prefix)
    stream = CorpusSamples(tokens, np.arange(25), 16, 99)
    cfg = GPTDatasetConfig(random_seed=100, sequence_length=16, split="100,0,0",
                           tokenizer=_Tokenizer(), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False,
                           path_to_cache=str(tmp_path / "mc"))
    theirs = GPTDataset(IndexedDataset(prefix), prefix, np.arange(25, dtype=np.int32), None,
                        Split.train, cfg)
    n = stream.samples_per_epoch
    for i in range(n):
        item = theirs[i]
        assert stream.sample(n + i).tolist() == \
            item["tokens"].tolist() + item["labels"][-1:].tolist()
    assert os.path.isdir(str(tmp_path / "mc"))
