"""``moeplug convert import --hf DIR --out CKPT_DIR`` and ``convert export --ckpt DIR --out HF_DIR``.

Argument parsing only; the work is in :mod:`moeplug.convert`. Errors are ConfigErrors, so the
CLI reports them like any configuration problem (exit 2, field, value and fix).
"""

from __future__ import annotations

import argparse


def add_convert_parser(sub) -> None:
    c = sub.add_parser("convert", help="convert between Hugging Face model directories and "
                       "moeplug checkpoints (safetensors only)")
    csub = c.add_subparsers(dest="direction", required=True)
    i = csub.add_parser("import", help="HF config.json + *.safetensors (+ tokenizer files) -> "
                        "moeplug checkpoint")
    i.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face model directory")
    i.add_argument("--out", required=True, metavar="CKPT_DIR",
                   help="run directory to write (checkpoint step_000000 + latest)")
    i.add_argument("--experts", default="grouped", metavar="NAME",
                   help="experts plugin of the imported model (default: grouped)")
    i.add_argument("--overwrite", action="store_true", help="replace the run already in --out "
                   "(its metrics.jsonl, checkpoints and latest are deleted first)")
    e = csub.add_parser("export", help="moeplug checkpoint -> HF config.json + model.safetensors "
                        "(+ the tokenizer files it carries)")
    e.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint or run directory")
    e.add_argument("--out", required=True, metavar="HF_DIR", help="directory to write")
    e.add_argument("--family", metavar="MODEL_TYPE", default=None,
                   help="mixtral | qwen3_moe | deepseek_v3 (default: the imported one, else "
                        "guessed from the architecture)")


def cmd_convert(args: argparse.Namespace) -> int:
    from moeplug.convert import export_hf, import_hf, import_notes
    if args.direction == "import":
        path = import_hf(args.hf, args.out, experts=args.experts, overwrite=args.overwrite)
        print(f"imported {args.hf} -> {path}")
        for line in import_notes(args.hf, path):
            print(line)
    else:
        export_hf(args.ckpt, args.out, model_type=args.family)
        print(f"exported {args.ckpt} -> {args.out}")
    return 0
