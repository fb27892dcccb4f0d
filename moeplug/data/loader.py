"""Batches of a run from the sample stream: data-parallel shares, the loader's position, and
the validation set.

Step t's global batch is the next ``G = DP * micro_batch_size * grad_accum_steps`` samples of
the stream (moeplug.data.sampling), as Megatron's ``consumed_samples`` counts them: micro-batch
k of the step holds samples ``first + k*B .. first + (k+1)*B - 1`` and DP rank r trains on
micro-batches ``r*A .. (r+1)*A - 1``, so the DP ranks' shares are disjoint, the ranks of one
replica (TP, CP, PP and the EP ranks inside it) read the same samples, and their union is what
one process with ``grad_accum_steps = DP * A`` trains on. The position (``consumed_samples``) is
saved in every checkpoint: a resume continues at the next sample whatever its layout or batch
shape, bit for bit the samples the uninterrupted run would have seen.

``MOEPLUG_TEST_SAMPLES=PATH`` (tests only) makes every rank append, per step, which samples it
trained on to ``PATH.rank<R>`` (JSON lines).

Legend: B micro-batch size, S sequence length, A accumulation steps.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeplug.config import ConfigError
from moeplug.data.indexed import IndexedTokens
from moeplug.data.sampling import BlendedSamples, CorpusSamples

SAMPLES_ENV = "MOEPLUG_TEST_SAMPLES"


def array_stream(ids_N: np.ndarray, seq_len: int, seed: int) -> BlendedSamples:
    """A token array as a one-document corpus' stream (tests and benchmarks that have ids but
    no corpus)."""
    ids_N = np.asarray(ids_N)
    tokens = IndexedTokens("<array>", np.array([len(ids_N)], np.int32), np.zeros(1, np.int64),
                           np.array([0, 1], np.int64), ids_N)
    return BlendedSamples([CorpusSamples(tokens, np.zeros(1, np.int64), seq_len, seed)],
                          np.ones(1))


def _pair(rows_BS1: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    windows = torch.from_numpy(rows_BS1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _dp(groups: Any) -> tuple[int, int]:
    return (1, 0) if groups is None else (groups.size("dp"), groups.rank_in("dp"))


@dataclass
class Batches:
    """The training batches of a run over ``stream``."""

    stream: BlendedSamples
    micro_batch_size: int
    grad_accum_steps: int

    def global_batch(self, groups: Any = None) -> int:
        return _dp(groups)[0] * self.micro_batch_size * self.grad_accum_steps

    def step(self, first: int, groups: Any = None, step: int | None = None) -> list:
        """This rank's micro-batches of the step whose global batch starts at stream position
        ``first``: A pairs (tokens_BS, targets_BS), int64 on the CPU."""
        dp, r = _dp(groups)
        B, A = self.micro_batch_size, self.grad_accum_steps
        mine = range(first + r * A * B, first + (r + 1) * A * B)
        rows = np.stack([self.stream.sample(p) for p in mine])
        if os.environ.get(SAMPLES_ENV):
            _record(self.stream, step, mine, rows, groups)
        return [_pair(rows[m * B:(m + 1) * B]) for m in range(A)]


def sample_batches(stream: Any, tc: Any, step: int, groups: Any = None,
                   first: int | None = None) -> list:
    """This rank's micro-batches of optimizer step ``step`` (``first``: the stream position
    its global batch starts at; default ``step`` times the global batch). ``stream``: a
    BlendedSamples, or a token array (read as one document with seed ``tc.seed``)."""
    if not isinstance(stream, BlendedSamples):
        stream = array_stream(stream, tc.seq_len, tc.seed)
    batches = Batches(stream, tc.micro_batch_size, tc.grad_accum_steps)
    start = step * batches.global_batch(groups) if first is None else first
    return batches.step(start, groups, step)


def _record(stream: BlendedSamples, step: int | None, positions: range, rows: np.ndarray,
            groups: Any) -> None:
    rank = 0 if groups is None else groups.rank
    with open(f"{os.environ[SAMPLES_ENV]}.rank{rank}", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "rank": rank, "dp_rank": _dp(groups)[1],
                            "positions": list(positions),
                            "samples": [list(stream.describe(p)) for p in positions],
                            "tokens": rows.tolist()}) + "\n")


@dataclass(frozen=True)
class EvalBatches:
    """This rank's share of the validation set: micro-batches (tokens_BS, targets_BS) and
    each one's weight (its target count; 0 for the padding batch a DP rank with one batch
    fewer runs so that every rank runs as many forwards, as expert parallelism needs)."""

    batches: list
    weights: list[int]
    total_tokens: int  # over every DP rank


def eval_batches(val: Any, micro_batch_size: int, num_batches: int, groups: Any = None) -> EvalBatches:
    """The validation set (moeplug.data.corpus.ValSamples) in micro-batches, this DP rank's
    share: batch b (samples ``b*B ..``, the last one possibly smaller) goes to DP rank
    ``b mod DP``. ``num_batches``: 0 = the whole set, else its first ``num_batches``."""
    B = micro_batch_size
    total = math.ceil(len(val) / B)
    nb = total if num_batches == 0 else min(num_batches, total)
    dp, r = _dp(groups)
    mine = list(range(r, nb, dp))
    per_rank = math.ceil(nb / dp)
    batches, weights = [], []
    for b in mine:
        rows = np.stack([val.sample(i) for i in range(b * B, min((b + 1) * B, len(val)))])
        batches.append(_pair(rows))
        weights.append(int(rows.shape[0] * (rows.shape[1] - 1)))
    if len(mine) < per_rank:  # an idle forward (weight 0) on the first batch's samples
        rows = np.stack([val.sample(i) for i in range(min(B, len(val)))])
        batches.append(_pair(rows))
        weights.append(0)
    S = int(batches[0][0].shape[1])
    return EvalBatches(batches, weights, min(nb * B, len(val)) * S)


def loader_state(corpus: Any, cfg: Any, consumed: int = 0) -> dict:
    """The loader's part of a checkpoint: its position and what the order depends on."""
    d, t = cfg.data, cfg.train
    return {"consumed_samples": consumed, "order": corpus.order_key(t.seq_len, t.seed),
            "settings": {"corpus": d.corpus, "tokenizer": d.tokenizer,
                         "validation": corpus.split, "seq_len": t.seq_len, "seed": t.seed}}


def resume_position(saved: Any, corpus: Any, cfg: Any, checkpoint: str) -> int:
    """Where a resumed run's loader starts: the checkpoint's position when its data order is
    this run's; 0 for a checkpoint without loader state (an import, or a run from before it
    was saved) or, with ``data.allow_new_order``, a new order; else a ConfigError naming both
    orders (checked by the CLI before any process group exists)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("consumed_samples"), int):
        return 0
    here = loader_state(corpus, cfg)
    if saved.get("order") == here["order"]:
        return saved["consumed_samples"]
    if cfg.data.allow_new_order:
        return 0
    was, now = saved.get("settings") or {}, here["settings"]
    diffs = [f"{k}: checkpoint {was.get(k)!r}, now {v!r}" for k, v in now.items()
             if was.get(k) != v]
    what = "; ".join(diffs) if diffs else (
        f"the same settings ({', '.join(f'{k} {v!r}' for k, v in now.items())}), but the "
        f"corpus files' contents changed")
    raise ConfigError(
        f"train.resume = {checkpoint!r}: this run would feed the model another data order "
        f"than the checkpoint's ({what}). Fix: resume with the checkpoint's data settings (its "
        f"meta.json 'data'), or set data.allow_new_order: true to go on with this data from its "
        f"first sample")
