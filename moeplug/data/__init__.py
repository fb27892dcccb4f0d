"""Corpora, tokenizers, Megatron-format prepared ids and GPTDataset-style sampling.

The names below load on first use: a tokenising worker process (moeplug.data.prepare) imports
only the reader and tokenizer it runs, not torch.
"""

import importlib

_EXPORTS = {"prepare_corpus": "corpus", "Corpus": "corpus", "get_batch": "dataset",
            "Batches": "loader", "sample_batches": "loader", "BPETokenizer": "tokenizer",
            "ByteTokenizer": "tokenizer"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moeplug.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moeplug.data.{_EXPORTS[name]}"), name)
