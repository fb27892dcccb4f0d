"""``moeplug data prepare``: tokenise a corpus of any format into Megatron's .bin/.idx.

    moeplug data prepare --corpus SRC --tokenizer TOK --out DIR [--format NAME]
                         [--text-field KEY] [--workers N] [--vocab-size N]

SRC is anything ``data.corpus`` takes; TOK a ``data.tokenizer`` value (``bpe`` trains the
local BPE on every document of SRC and stores it in DIR). ``data.corpus: DIR`` then trains on
the result, and Megatron-Core reads ``DIR/corpus`` as a ``--data-path`` prefix. Bad input is one
line naming the file and line, exit 2, and leaves no DIR behind.
"""

from __future__ import annotations

import argparse
import sys

from moeplug.config import ConfigError, DataConfig
from moeplug.config.data import corpus_entries


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="prepare corpora (tokenise into Megatron's .bin/.idx)")
    dsub = d.add_subparsers(dest="data_command")
    p = dsub.add_parser("prepare", help="tokenise a corpus into DIR/corpus.bin + .idx")
    p.add_argument("--corpus", required=True, metavar="SRC", help="what data.corpus takes "
                   "(a path of any supported format, or shakespeare)")
    p.add_argument("--tokenizer", required=True, metavar="TOK", help="what data.tokenizer "
                   "takes (bpe: train the local BPE on SRC; bytes)")
    p.add_argument("--out", required=True, metavar="DIR", help="new (or empty) output folder")
    p.add_argument("--format", default="", metavar="NAME", help="reader name (default: the "
                   "one that claims SRC; `moeplug plugins` lists them)")
    p.add_argument("--text-field", default="text", metavar="KEY",
                   help="JSONL key / column holding the text (data.text_field)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="tokenising processes (default 0: one per CPU)")
    p.add_argument("--vocab-size", type=int, default=2048, metavar="N",
                   help="the local BPE's vocabulary (data.vocab_size; --tokenizer bpe only)")


def cmd_data(args: argparse.Namespace) -> int:
    if args.data_command != "prepare":
        raise ConfigError("moeplug data: missing subcommand. Fix: moeplug data prepare "
                          "--corpus SRC --tokenizer TOK --out DIR")
    from moeplug.data.prepare import default_workers, iter_texts, prepare
    from moeplug.data.reader import ReadOptions
    from moeplug.data.sources import reader_for
    from moeplug.data.tokenizer import BPETokenizer, ByteTokenizer, HFTokenizer, is_hf_tokenizer
    from moeplug.plugin_host import PluginHost

    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: must be >= 0. Fix: pass 0 (one per CPU) "
                          f"or a process count")
    cfg = DataConfig(corpus=args.corpus, format=args.format, text_field=args.text_field,
                     tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    entries = corpus_entries(cfg.corpus, "--corpus", cfg.format)
    if len(entries) != 1:
        raise ConfigError("--corpus: one corpus per prepare (a blend's weights apply at "
                          "training). Fix: prepare each corpus into its own --out")
    reader = reader_for(PluginHost.load(), entries[0])
    if reader.prepared:
        raise ConfigError(f"--corpus {args.corpus!r}: already prepared ({reader.name}). Fix: "
                          f"train on it directly (data.corpus: {args.corpus})")
    options = ReadOptions(text_field=cfg.text_field)
    if cfg.tokenizer == "bpe":
        print(f"training the local BPE ({cfg.vocab_size} ids) on {args.corpus}",
              file=sys.stderr, flush=True)
        tok = BPETokenizer.train(iter_texts(reader, args.corpus, options), cfg.vocab_size)
    elif is_hf_tokenizer(cfg.tokenizer):
        tok = HFTokenizer.load(cfg.tokenizer, field="--tokenizer")
    else:
        tok = ByteTokenizer()
    summary = prepare(reader, args.corpus, tok, args.out, options,
                      num_workers=args.workers or default_workers())
    print(summary.line(args.corpus))
    return 0
