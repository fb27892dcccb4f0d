"""Which tokens each training sample holds: Megatron-Core's GPTDataset and BlendedDataset indices.

One epoch of a corpus is Megatron's ``GPTDataset`` with ``num_samples=None`` (one epoch):

1. the document index: the split's document ids, shuffled (``numpy.random.RandomState``);
2. the sample index: the documents in that order, joined (each already ends in EOS, or the
   separator), cut into ``(num_tokens - 1) // seq_len`` samples of ``seq_len + 1`` tokens, each
   starting at the last token of the one before (inputs and shifted targets); row i is
   (position in the document index, offset) of sample i's first token, row i + 1 its last;
3. the shuffle index: the samples in a random order, from the same RandomState.

Epoch e draws from ``RandomState((seed + e) mod 2**32)``, so epoch 0 is bit for bit Megatron's
one-epoch index for ``random_seed = seed`` (tests/test_data_megatron.py builds both) and every
sample of an epoch comes exactly once before the next epoch begins. (Megatron's multi-epoch
index shuffles the documents of all epochs together, so a sample can come twice before another
came once; and it depends on ``train.steps``, which a resume may raise.)

Several corpora blend as Megatron's ``BlendedDataset``: sample i of the blend comes from the
corpus whose share is most behind, ``argmax_d(w_d * max(i, 1) - count_d)`` (its
``build_blending_indices``), so over any prefix of the blend every corpus has its weight's
share to within one sample; corpus d's count is its own sample position, which runs on into its
next epochs. The greedy sequence does not depend on its length, so it is built in blocks of
:data:`BLEND_BLOCK` samples as the run reaches them.

The validation set is the split's epoch-0 index (drop the last partial sample, as Megatron's
``drop_last_partial_validation_sequence``); several validation corpora are interleaved in
proportion to their sizes, each sample exactly once (Megatron's exhaustive blending).

Indices are cached as ``.npy`` under ``<cache>/indices/<key>/``, key = (corpus content and
tokenizer, the split's documents, seq_len, seed), written atomically.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

from moeplug.data.indexed import IndexedTokens

BLEND_BLOCK = 1 << 20
_U32 = 2 ** 32


def epoch_seed(seed: int, epoch: int) -> int:
    return (seed + epoch) % _U32


def build_document_index(docs: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's ``_build_document_index`` for one epoch (int32, shuffled in place)."""
    document_index = np.array(docs, dtype=np.int32)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(lengths_S: np.ndarray, document_index: np.ndarray,
                       seq_len: int) -> np.ndarray:
    """Megatron's ``helpers.build_sample_idx`` for one epoch (drop the last partial sample,
    one extra token per sample), vectorised: row i locates token ``i * seq_len`` of the joined
    documents as (position in ``document_index``, offset), the offset always inside a
    document."""
    doc_lengths = lengths_S[document_index].astype(np.int64)
    num_tokens = int(doc_lengths.sum())
    num_samples = max((num_tokens - 1) // seq_len, 0)
    ends = np.cumsum(doc_lengths)
    starts = ends - doc_lengths
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    # The document holding each position: the last one starting at or before it (empty
    # documents start where the next one does and are passed over, as Megatron's walk does).
    which = np.searchsorted(starts, positions, side="right") - 1
    which[0] = 0  # Megatron's first row is (0, 0) even before an empty first document
    dtype = np.int32 if max(len(document_index), int(lengths_S.max(initial=0))) < 2**31 - 1 \
        else np.int64
    index = np.empty((num_samples + 1, 2), dtype=dtype)
    index[:, 0] = which
    index[:, 1] = positions - starts[which]
    return index


def build_shuffle_index(num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's ``_build_shuffle_index`` for one epoch."""
    dtype = np.uint32 if num_samples < _U32 - 1 else np.int64
    shuffle_index = np.arange(num_samples, dtype=dtype)
    rng.shuffle(shuffle_index)
    return shuffle_index


def blending_indices(weights: np.ndarray, start: int, counts: np.ndarray,
                     size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's ``helpers.build_blending_indices`` for blend positions ``start ..
    start + size`` given each corpus' count before ``start``: (corpus of each sample int16,
    its position in that corpus int64, the counts after)."""
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    n = len(w)
    which = np.empty(size, np.int16)
    position = np.empty(size, np.int64)
    for k in range(size):
        x = float(max(start + k, 1))
        best, best_error = 0, w[0] * x - c[0]
        for d in range(1, n):
            error = w[d] * x - c[d]
            if error > best_error:
                best, best_error = d, error
        which[k], position[k] = best, c[best]
        c[best] += 1
    return which, position, np.array(c, np.int64)


def exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``helpers.build_exhaustive_blending_indices``: exactly ``sizes[d]`` samples
    of corpus d, interleaved in proportion."""
    total = sum(sizes)
    w = [s / total for s in sizes] if total else []
    c = [0] * len(sizes)
    unspent = [d for d, s in enumerate(sizes) if s > 0]
    which = np.empty(total, np.int16)
    position = np.empty(total, np.int64)
    for k in range(total):
        x = float(max(k, 1))
        best = max(unspent, key=lambda d: (w[d] * x - c[d], -d))
        which[k], position[k] = best, c[best]
        c[best] += 1
        if c[best] == sizes[best]:
            unspent.remove(best)
    return which, position


def _save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def _load(path: str) -> np.ndarray | None:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None


@dataclass
class CorpusSamples:
    """One corpus split as an endless stream of samples, epoch after epoch (module docstring).

    ``tokens``: the prepared corpus; ``docs``: the split's document ids; ``cache``: the folder
    of this (corpus, split, seq_len, seed)'s index files ("" keeps them in memory only)."""

    tokens: IndexedTokens
    docs: np.ndarray
    seq_len: int
    seed: int
    cache: str = ""
    _epochs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        lengths = self.tokens.lengths_S[self.docs].astype(np.int64)
        self.num_tokens = int(lengths.sum())
        self.samples_per_epoch = max((self.num_tokens - 1) // self.seq_len, 0)
        self._starts = self.tokens.starts_S

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document index, sample index, shuffle index) of epoch ``e``, built once."""
        if e in self._epochs:
            return self._epochs[e]
        names = [os.path.join(self.cache, f"epoch{e}-{k}_index.npy")
                 for k in ("document", "sample", "shuffle")]
        arrays = [_load(p) for p in names] if self.cache else [None]
        if any(a is None for a in arrays):
            rng = np.random.RandomState(epoch_seed(self.seed, e))
            document_index = build_document_index(self.docs, rng)
            sample_index = build_sample_index(self.tokens.lengths_S, document_index,
                                              self.seq_len)
            arrays = [document_index, sample_index,
                      build_shuffle_index(len(sample_index) - 1, rng)]
            if self.cache:
                os.makedirs(self.cache, exist_ok=True)
                for p, a in zip(names, arrays):
                    _save(p, a)
        if len(self._epochs) >= 2:  # a run reads one epoch at a time (two at a boundary)
            self._epochs.pop(min(self._epochs))
        self._epochs[e] = tuple(arrays)
        return self._epochs[e]

    def sample(self, position: int, shuffled: bool = True) -> np.ndarray:
        """The ``seq_len + 1`` tokens (int64) at stream position ``position``."""
        e, k = divmod(position, self.samples_per_epoch)
        document_index, sample_index, shuffle_index = self.epoch(e)
        i = int(shuffle_index[k]) if shuffled else k
        (d0, o0), (d1, o1) = sample_index[i], sample_index[i + 1]
        tokens, starts, lengths = self.tokens.tokens_N, self._starts, self.tokens.lengths_S
        if d0 == d1:
            s = int(starts[document_index[d0]])
            return tokens[s + o0:s + o1 + 1].astype(np.int64)
        parts = []
        for j in range(int(d0), int(d1) + 1):
            doc = int(document_index[j])
            s = int(starts[doc])
            lo = int(o0) if j == d0 else 0
            hi = int(o1) + 1 if j == d1 else int(lengths[doc])
            parts.append(tokens[s + lo:s + hi])
        return np.concatenate(parts).astype(np.int64)


def blend_key(parts: list[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


@dataclass
class BlendedSamples:
    """Corpora blended by weight (module docstring); one corpus: that corpus' stream."""

    corpora: list[CorpusSamples]
    weights: np.ndarray  # normalised
    cache: str = ""
    _blocks: dict = field(default_factory=dict, repr=False)
    _counts: dict = field(default_factory=dict, repr=False)  # block -> counts at its start

    def locate(self, position: int) -> tuple[int, int]:
        """(corpus, position in that corpus' stream) of blend position ``position``."""
        if len(self.corpora) == 1:
            return 0, position
        b, k = divmod(position, BLEND_BLOCK)
        which, where = self.block(b)
        return int(which[k]), int(where[k])

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if b in self._blocks:
            return self._blocks[b]
        names = [os.path.join(self.cache, f"blend{b}-{k}.npy") for k in ("dataset", "sample")]
        arrays = [_load(p) for p in names] if self.cache else [None]
        if any(a is None for a in arrays):
            counts = self.counts_at(b)
            which, where, after = blending_indices(self.weights, b * BLEND_BLOCK, counts,
                                                   BLEND_BLOCK)
            self._counts[b + 1] = after
            arrays = [which, where]
            if self.cache:
                os.makedirs(self.cache, exist_ok=True)
                for p, a in zip(names, arrays):
                    _save(p, a)
        self._blocks = {b: tuple(arrays)}  # one block at a time
        return self._blocks[b]

    def counts_at(self, b: int) -> np.ndarray:
        """Each corpus' count before block ``b`` (from block b - 1, built if need be)."""
        if b == 0:
            return np.zeros(len(self.corpora), np.int64)
        if b not in self._counts:
            which, where = self.block(b - 1)
            counts = np.zeros(len(self.corpora), np.int64)
            for d in range(len(self.corpora)):  # each corpus' last position in the block, + 1
                mine = where[np.asarray(which) == d]
                counts[d] = int(mine[-1]) + 1 if len(mine) else int(self.counts_at(b - 1)[d])
            self._counts[b] = counts
        return self._counts[b]

    def sample(self, position: int) -> np.ndarray:
        d, j = self.locate(position)
        return self.corpora[d].sample(j)

    def describe(self, position: int) -> tuple[int, int, int]:
        """(corpus, epoch, sample id in that epoch's unshuffled order) of ``position``: which
        sample a run consumed there (the data-parallel tests read these back)."""
        d, j = self.locate(position)
        c = self.corpora[d]
        e, k = divmod(j, c.samples_per_epoch)
        return d, e, int(c.epoch(e)[2][k])
