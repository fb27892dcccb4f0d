"""Random training windows (``get_batch``): what the trainer drew before it sampled epochs as
Megatron's GPTDataset does (moeplug.data.sampling). Kept for tests and benchmarks that need
batches of some token array without a corpus.

Legend: B batch, S sequence length, N tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from moeplug.config import ConfigError
from moeplug.data.prepare import SEPARATOR

WORK_SEPARATOR = SEPARATOR  # ends each document when the tokenizer has no EOS


def get_batch(ids_N: np.ndarray, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` tokens -> (inputs, inputs shifted by one)."""
    num_starts = len(ids_N) - seq_len
    if num_starts <= 0:
        # A ConfigError, not a crash: the CLI reports it as a configuration problem (exit 2).
        raise ConfigError(
            f"get_batch: train.seq_len = {seq_len} needs more than {seq_len} tokens but the "
            f"split has {len(ids_N)}. Fix: lower train.seq_len below {len(ids_N)} or use a "
            f"larger corpus (data.corpus; data.val_works for the validation split)")
    starts_B = torch.randint(0, num_starts, (batch_size,), generator=generator).tolist()
    windows_BS1 = np.stack([np.asarray(ids_N[s:s + seq_len + 1], dtype=np.int64) for s in starts_B])
    windows = torch.from_numpy(windows_BS1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
