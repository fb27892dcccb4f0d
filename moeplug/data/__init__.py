"""Corpus, tokenizer and memory-mapped token datasets."""

from moeplug.data.corpus import SHAKESPEARE_ATTRIBUTION, SHAKESPEARE_INSTALL
from moeplug.data.dataset import Corpus, get_batch, prepare_corpus
from moeplug.data.tokenizer import BPETokenizer, ByteTokenizer

__all__ = ["prepare_corpus", "get_batch", "Corpus", "BPETokenizer", "ByteTokenizer",
           "SHAKESPEARE_ATTRIBUTION", "SHAKESPEARE_INSTALL"]
