"""Packed documents (``data.document_mask``): each token's position inside its document, and the
block-diagonal causal mask that attention derives from those positions.

Legend: B batch, S sequence (the tokens this rank holds), J key tokens.

A sample of ``seq_len`` tokens packs documents end to end, each ended by the tokenizer's EOD
token (``eos_id``); the token after an EOD starts a new document (Megatron's
``get_ltor_masks_and_position_ids`` with ``--reset-position-ids --reset-attention-mask``, whose
EOD belongs to the document it ends). With document masking a token attends only to the earlier
tokens of its own document and RoPE counts its position from that document's first token, so
each document is computed as if it were alone in the sample.

The positions alone define the mask. They restart at 0 on a document's first token and count up
by one, so the token at sequence index i with position p is in the document that starts at
index i - p, and key index j is visible to it iff ``i - p <= j <= i``. Context parallelism, whose
ranks hold other parts of each sequence, therefore masks any block of keys from the queries'
positions and the keys' sequence indices, with nothing extra exchanged: the positions are
sharded with the tokens (``moeplug.parallel.context_parallel.shard_sequence``), and under
sequence parallelism attention sees the whole (CP-local) sequence anyway.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from moeplug.config import ConfigError


def document_ids(tokens_BS: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Each token's document within its row (int64 [B, S]): 0 for the first, counted up after
    every EOD (an EOD keeps the id of the document it ends)."""
    is_eod_BS = (tokens_BS == eod_id).to(torch.int64)
    return torch.cumsum(is_eod_BS, dim=1) - is_eod_BS


def document_positions(tokens_BS: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Each token's position in its document (int64 [B, S]): the RoPE position that
    ``--reset-position-ids`` gives it, and what attention derives the document mask from."""
    B, S = tokens_BS.shape
    index_BS = torch.arange(S, device=tokens_BS.device).expand(B, S)
    # A document starts at index 0 and after every EOD; a token's document began at the last
    # start at or before it (a running max of the start indices).
    starts_BS = torch.zeros_like(index_BS, dtype=torch.bool)
    starts_BS[:, 1:] = tokens_BS[:, :-1] == eod_id
    starts_BS[:, 0] = True
    first_BS = torch.cummax(torch.where(starts_BS, index_BS, 0), dim=1).values
    return index_BS - first_BS


def visible(q_index_S: torch.Tensor, k_index_J: torch.Tensor,
            positions_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query may attend to (True: attend). ``q_index_S`` / ``k_index_J``: the
    queries' and keys' indices in the whole sequence (int64; under CP the global ones).
    Without ``positions_BS``: the causal mask [S, J]. With them (the queries' positions in
    their documents): causal and within the query's document, [B, S, J]."""
    causal_SJ = k_index_J[None, :] <= q_index_S[:, None]
    if positions_BS is None:
        return causal_SJ
    first_BS = q_index_S[None, :] - positions_BS  # where each query's document starts
    return causal_SJ[None] & (k_index_J[None, None, :] >= first_BS[:, :, None])


def attention_mask(q_index_S: torch.Tensor, k_index_J: torch.Tensor,
                   positions_BS: torch.Tensor | None) -> torch.Tensor:
    """:func:`visible` shaped for SDPA's ``attn_mask``: [S, J], or [B, 1, S, J] (one mask for
    every head of a row)."""
    vis = visible(q_index_S, k_index_J, positions_BS)
    return vis if positions_BS is None else vis.unsqueeze(1)


def with_positions(micro_batches: Sequence[tuple], eod_id: int | None) -> list:
    """``(tokens_BS, targets_BS)`` micro-batches with their document positions appended, as
    ``(tokens_BS, targets_BS, positions_BS)``: what the model, the CP shard and the pipeline
    schedule take under document masking. ``eod_id`` None (masking off): unchanged. Computed
    once per micro-batch, on whole sequences (before any CP shard), where the tokens live."""
    if eod_id is None:
        return list(micro_batches)
    return [(tokens_BS, targets_BS, document_positions(tokens_BS, eod_id))
            for tokens_BS, targets_BS, *_ in micro_batches]


def document_eod(cfg: Any, tokenizer: Any) -> int | None:
    """The EOD id document masking splits samples at: the tokenizer's ``eos_id`` when
    ``data.document_mask`` is on, None when it is off. ConfigError when it is on and the
    tokenizer has no EOS (no boundary could ever be found: every sample would be one document,
    silently). The CLI calls it once the tokenizer is known, before any rank starts."""
    if not cfg.data.document_mask:
        return None
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise ConfigError(
            f"DataConfig.document_mask = True: data.tokenizer = {cfg.data.tokenizer!r} has no "
            f"end-of-document token (eos_id None), so no document boundary can be found in a "
            f"packed sample. Fix: use a tokenizer with an EOS token (a Hugging Face tokenizer "
            f"directory), or set data.document_mask: false")
    return int(eos)
