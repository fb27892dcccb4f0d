"""Sampling as Megatron's GPTDataset / BlendedDataset: every sample once per epoch, samples are
windows of the documents joined in the epoch's shuffled order, blends hold their weights to
within one sample, data-parallel shares are disjoint and add up to one process' batches, the
validation set is covered once, and a resume keeps its position or says why it cannot.

Megatron-Core's own indices are compared in tests/test_data_megatron.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from moeplug.config import ConfigError, DataConfig
from moeplug.data import prepare_corpus
from moeplug.data.indexed import IndexedWriter, open_indexed
from moeplug.data.loader import eval_batches, resume_position, sample_batches
from moeplug.data.sampling import BlendedSamples, CorpusSamples, blending_indices


def make_tokens(tmp_path, lengths, name="c", seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 60000, n).astype(np.uint16) for n in lengths]
    w = IndexedWriter(str(tmp_path / name), np.uint16)
    w.add_documents(np.concatenate(ids), np.array(lengths, np.int32))
    w.finalize()
    return open_indexed(str(tmp_path / name)), ids


def windows(ids, order, seq_len):
    """Every sample of an epoch as Megatron builds it: the documents in ``order`` joined, cut
    into seq_len + 1 tokens, each starting at the previous one's last token."""
    joined = np.concatenate([ids[d] for d in order]).astype(np.int64)
    n = (len(joined) - 1) // seq_len
    return [joined[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]


def test_every_sample_once_per_epoch_and_epochs_differ(tmp_path):
    lengths = [37, 1, 120, 64, 5, 300, 33]
    tokens, ids = make_tokens(tmp_path, lengths)
    stream = CorpusSamples(tokens, np.arange(len(lengths)), 16, seed=7)
    n = stream.samples_per_epoch
    assert n == (sum(lengths) - 1) // 16
    orders = []
    for e in range(3):
        document_index, sample_index, shuffle_index = stream.epoch(e)
        assert sorted(document_index.tolist()) == list(range(len(lengths)))
        assert sorted(shuffle_index.tolist()) == list(range(n))  # each sample once
        expected = windows(ids, document_index, 16)
        got = [stream.sample(e * n + k) for k in range(n)]
        assert [g.tolist() for g in got] == [expected[i].tolist() for i in shuffle_index]
        orders.append((document_index.tolist(), shuffle_index.tolist()))
    assert orders[0] != orders[1] != orders[2]
    # the stream is the same read again (a fresh object, or from the .npy cache)
    cached = CorpusSamples(tokens, np.arange(len(lengths)), 16, 7, str(tmp_path / "idx"))
    again = CorpusSamples(tokens, np.arange(len(lengths)), 16, 7, str(tmp_path / "idx"))
    assert [cached.sample(p).tolist() for p in range(2 * n)] == \
        [stream.sample(p).tolist() for p in range(2 * n)] == \
        [again.sample(p).tolist() for p in range(2 * n)]


def test_split_documents_only(tmp_path):
    tokens, ids = make_tokens(tmp_path, [50] * 10)
    stream = CorpusSamples(tokens, np.array([2, 5, 7]), 8, seed=1)
    seen = np.concatenate([stream.sample(k) for k in range(stream.samples_per_epoch)])
    allowed = set(np.concatenate([ids[d] for d in (2, 5, 7)]).tolist())
    assert set(seen.tolist()) <= allowed


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 5], [0.05, 0.95]])
def test_blend_holds_its_weights_to_within_one_sample_over_every_prefix(weights):
    w = np.array(weights, np.float64) / sum(weights)
    which, where, counts = blending_indices(w, 0, np.zeros(len(w), np.int64), 20000)
    seen = np.zeros(len(w), np.int64)
    for i, d in enumerate(which):
        assert where[i] == seen[d]  # each corpus' samples in order, none skipped
        seen[d] += 1
        assert np.all(np.abs(seen - w * (i + 1)) <= 1.0 + 1e-9), (i, seen)
    assert np.array_equal(seen, counts)


def test_blend_built_in_blocks_equals_one_piece(tmp_path, monkeypatch):
    import moeplug.data.sampling as S
    a, _ = make_tokens(tmp_path, [400, 300], "a", 1)
    b, _ = make_tokens(tmp_path, [90], "b", 2)
    streams = [CorpusSamples(a, np.arange(2), 8, 3), CorpusSamples(b, np.arange(1), 8, 3)]
    w = np.array([0.3, 0.7])
    whole = BlendedSamples(streams, w)
    monkeypatch.setattr(S, "BLEND_BLOCK", 7)  # many blocks, the counts carried across
    blocked = BlendedSamples(streams, w, str(tmp_path / "blend"))
    reread = BlendedSamples(streams, w, str(tmp_path / "blend"))
    monkeypatch.setattr(S, "BLEND_BLOCK", 1 << 20)
    one = [whole.locate(p) for p in range(200)]
    monkeypatch.setattr(S, "BLEND_BLOCK", 7)
    assert [blocked.locate(p) for p in range(200)] == one
    assert [reread.locate(p) for p in reversed(range(200))] == one[::-1]
    # corpus b (11 samples per epoch) is 70 % of the blend: it runs through several epochs
    assert max(j for d, j in one if d == 1) >= 3 * streams[1].samples_per_epoch


class FakeGroups(SimpleNamespace):
    def size(self, kind):
        return self.dp if kind == "dp" else 1

    def rank_in(self, kind):
        return self.r if kind == "dp" else 0


def test_dp_shares_are_disjoint_and_add_up_to_one_process(tmp_path):
    tokens, _ = make_tokens(tmp_path, [500, 700, 300])
    stream = BlendedSamples([CorpusSamples(tokens, np.arange(3), 16, 5)], np.ones(1))
    tc = SimpleNamespace(micro_batch_size=3, grad_accum_steps=2, seq_len=16, seed=5)
    one = SimpleNamespace(**{**vars(tc), "grad_accum_steps": 8})  # DP 4 x A 2
    for step in range(4):  # past the epoch end (91 samples, 24 per step)
        ref = sample_batches(stream, one, step)
        shares = [sample_batches(stream, tc, step, FakeGroups(dp=4, r=r, rank=r))
                  for r in range(4)]
        flat = [mb for share in shares for mb in share]
        assert len(flat) == len(ref)
        for (x, y), (rx, ry) in zip(flat, ref):
            assert x.tolist() == rx.tolist() and y.tolist() == ry.tolist()
            assert x[:, 1:].tolist() == y[:, :-1].tolist()


def test_validation_set_is_covered_once_over_dp_ranks(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    for i, n in enumerate([900, 1300, 70, 400]):
        (d / f"w{i}.txt").write_text("".join(chr(97 + (k * 7 + i) % 26) for k in range(n)))
    corpus = prepare_corpus(DataConfig(corpus=str(d), tokenizer="bytes", val_works=["w1", "w2"],
                                       cache_dir=str(tmp_path / "c")))
    val = corpus.val_samples(32, 1)
    everything = sorted(tuple(val.sample(i).tolist()) for i in range(len(val)))
    for dp in (1, 2, 3):
        seen, weights = [], 0
        for r in range(dp):
            share = eval_batches(val, 5, 0, FakeGroups(dp=dp, r=r, rank=r))
            lengths = {len(share.batches)}
            for (x, y), w in zip(share.batches, share.weights):
                if w:
                    seen += [tuple(row) + (int(t[-1]),) for row, t in zip(x.tolist(), y)]
                    assert w == x.numel()
            weights += sum(share.weights)
            assert share.total_tokens == len(val) * 32
        assert len(lengths) == 1  # every rank runs as many forwards
        assert sorted(seen) == everything and weights == len(val) * 32
    first = eval_batches(val, 5, 2)
    assert len(first.batches) == 2 and first.total_tokens == 10 * 32


def test_resume_keeps_the_position_or_names_both_orders(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    for i in range(3):
        (d / f"w{i}.txt").write_text("abcdefghij" * (50 + i))
    data = DataConfig(corpus=str(d), tokenizer="bytes", val_works=["w2"],
                      cache_dir=str(tmp_path / "c"))
    corpus = prepare_corpus(data)
    cfg = SimpleNamespace(data=data, train=SimpleNamespace(seq_len=16, seed=3))
    from moeplug.data.loader import loader_state
    saved = loader_state(corpus, cfg, 96)
    assert resume_position(saved, corpus, cfg, "ckpt") == 96
    assert resume_position(None, corpus, cfg, "ckpt") == 0  # an import: its first sample
    other = SimpleNamespace(data=data, train=SimpleNamespace(seq_len=16, seed=4))
    with pytest.raises(ConfigError, match=r"train.resume = 'ckpt': this run would feed the "
                       r"model another data order than the checkpoint's \(seed: checkpoint 3, "
                       r"now 4\)\. Fix: .*data.allow_new_order: true"):
        resume_position(saved, corpus, other, "ckpt")
    allowed = SimpleNamespace(data=dataclasses.replace(data, allow_new_order=True),
                              train=other.train)
    assert resume_position(saved, corpus, allowed, "ckpt") == 0
    (d / "w0.txt").write_text("changed" * 80)  # same settings, other content
    changed = prepare_corpus(data)
    with pytest.raises(ConfigError, match=r"the same settings .* but the corpus files' "
                       r"contents changed"):
        resume_position(saved, changed, cfg, "ckpt")


def test_val_fraction_holds_out_the_last_documents_as_megatron_splits(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(10)))
    corpus = prepare_corpus(DataConfig(corpus=str(path), tokenizer="bytes", val_fraction=0.25,
                                       cache_dir=str(tmp_path / "c")))
    # Megatron: train [0, round(0.75 * 10)) = [0, 8), validation [8, 10)
    assert corpus.train[0].docs.tolist() == list(range(8))
    assert corpus.val[0].docs.tolist() == [8, 9]
    assert b"document number 9" in bytes(corpus.val_ids.tolist())
    assert b"number 9" not in bytes(corpus.train_ids.tolist())
    with pytest.raises(ConfigError, match=r"DataConfig.val_fraction = 0.01: of the 10 documents "
                       r".* holds out 0, leaving no validation documents\. Fix: raise"):
        prepare_corpus(DataConfig(corpus=str(path), tokenizer="bytes", val_fraction=0.01,
                                  cache_dir=str(tmp_path / "c")))
    with pytest.raises(ConfigError, match=r"DataConfig.val_fraction = 0.1: data.val_works is "
                       r"set too, and each chooses the validation documents\. Fix: keep one"):
        DataConfig(corpus=str(path), val_works=["a"], val_fraction=0.1)


def test_val_corpus_and_a_blend(tmp_path):
    for name, n in (("a", 30), ("b", 12), ("v", 6)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(f'{{"text": "{name} document {i} {name * 40}"}}\n' for i in range(n)))
    data = DataConfig(corpus=[{"path": str(tmp_path / "a.jsonl"), "weight": 3},
                              {"path": str(tmp_path / "b.jsonl"), "weight": 1}],
                      val_corpus=str(tmp_path / "v.jsonl"), tokenizer="bytes",
                      cache_dir=str(tmp_path / "c"))
    corpus = prepare_corpus(data)
    assert corpus.weights.tolist() == [0.75, 0.25]
    assert [len(p.docs) for p in corpus.train] == [30, 12] and len(corpus.val[0].docs) == 6
    stream = corpus.train_samples(16, 1)
    first = [stream.locate(p)[0] for p in range(400)]
    assert abs(first.count(0) - 300) <= 1 and abs(first.count(1) - 100) <= 1
    assert set(bytes(corpus.val_ids.tolist()).decode().split()) >= {"v"}
