"""``moeplug generate``: read the text a trained model writes, from its checkpoint.

    model = load_checkpoint_model(ckpt, device)   # LoadedModel: model, tokenizer, cfg, path
    ids = generate_ids(model.model, prompt_ids, ...)

What is loaded is what the run trained: the model is rebuilt from the config stored in the
checkpoint's meta.json and filled from its safetensors (never unpickled); the tokenizer is the
run's, found (or rebuilt) by :func:`moeplug.data.prepare_corpus` from the same data config, and
checked against the fingerprint the trainer stored in the checkpoint. One process, whatever
layout trained it: the shards of a tp/cp/pp/ep/etp run are joined as a one-process resume joins
them (moeplug.training.reshard), and only what defines the model is taken from the run's config
(:func:`inference_config`), so neither its layout nor an execution setting stands in the way.

Decoding: greedy (temperature 0) takes the argmax token; sampling divides the logits by the
temperature, keeps the ``top_k`` largest (0: all) and draws from their softmax with a CPU
generator seeded by ``seed``, so a seed gives the same text on every device. The context is
the last ``train.seq_len`` tokens: windows of that length are all the model was trained on.
Legend: V vocabulary, S context length.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from moeplug.config import SEED_LIMIT, ConfigError, RootConfig, TrainConfig, config_from_dict
from moeplug.training.checkpoint import CheckpointError


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module  # in eval mode, on the device asked for
    tokenizer: Any          # the run's tokenizer (moeplug.data.tokenizer)
    cfg: RootConfig         # the run's config, from the checkpoint
    path: str               # the step directory loaded
    step: int


def add_generate_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="continue a prompt with a trained checkpoint")
    g.add_argument("--ckpt", required=True, metavar="DIR",
                   help="a step_XXXXXX checkpoint, or a run directory (its newest checkpoint)")
    g.add_argument("--prompt", default="", help="text to continue (default: empty, i.e. start "
                   "at a work boundary)")
    g.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy; > 0: sample from softmax(logits / T)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample only among the K most likely tokens (0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda, cuda:N")


def _check_args(args: argparse.Namespace) -> None:
    """Bad flags exit 2 naming the flag, the value and the fix, before anything is loaded."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1. Fix: pass "
                          "e.g. --max-new-tokens 200")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be a finite number >= 0. "
                          "Fix: 0 for greedy decoding, e.g. 0.8 to sample")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 0. Fix: 0 keeps every token")
    if not 0 <= args.seed < SEED_LIMIT:
        raise ConfigError(f"--seed {args.seed}: must be in [0, 2**63) (torch's generator takes "
                          "no other). Fix: pass e.g. --seed 1")
    try:
        TrainConfig(device=args.device)  # train.device's own rule
    except ConfigError as e:
        raise ConfigError(f"--device {args.device}: {e}") from None
    if args.top_k and args.temperature == 0:
        raise ConfigError(f"--top-k {args.top_k}: applies to sampling, but --temperature is 0 "
                          "(greedy). Fix: add --temperature 0.8 (for example), or drop --top-k")


# Sections and fields of a run's config that say how it trained, not what model it is: one
# process reading its text runs none of them, so they are set back to their defaults (a GPU-only
# dispatcher or precision, a layout, or an execution setting a newer release refuses would
# otherwise keep the checkpoint from loading). The model-defining fields (config.MODEL_DEFINING),
# data and train.seq_len (the context) are kept.
_INFERENCE_DEFAULTS = ("parallel", "runtime", "plugins.dispatcher", "plugins.dispatcher_options",
                       "plugins.precision", "plugins.precision_options", "train.param_dtype",
                       "train.master_dtype", "train.optimizer_dtype", "train.device")


def inference_config(saved: dict) -> dict:
    """The config (a nested mapping, as meta.json stores it) with which one process rebuilds a
    run's model for inference: ``saved`` without its training-only settings
    (``_INFERENCE_DEFAULTS``) and execution-only model fields (config.EXECUTION_ONLY)."""
    from moeplug.config import EXECUTION_ONLY
    out = copy.deepcopy(saved)
    for dotted in _INFERENCE_DEFAULTS + EXECUTION_ONLY:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def load_checkpoint_model(ckpt: str, device: str = "auto") -> LoadedModel:
    """The model and tokenizer of a checkpoint (or a run directory's newest) of a run of any
    layout, on ``device`` (a ``train.device`` value). CheckpointError/ConfigError with the fix
    otherwise."""
    from moeplug.data import prepare_corpus
    from moeplug.modules import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training import distributed as D
    from moeplug.training.checkpoint import find_checkpoint, load_checkpoint, read_meta

    path = find_checkpoint(ckpt)
    if path is None:
        raise CheckpointError(
            f"--ckpt {ckpt!r}: no checkpoint there (expected a step_XXXXXX directory with "
            f"meta.json, or a run directory with 'latest' or step_* checkpoints). Fix: pass "
            f"the --out / train.out_dir of a finished 'moeplug train' run")
    meta = read_meta(path)
    if "hf" in meta:
        raise CheckpointError(
            f"--ckpt {path!r} was imported from Hugging Face ({meta['hf'].get('source')}): "
            f"its tokenizer is not one moeplug trains. Fix: generate with transformers from the "
            f"original directory, or train it on with 'moeplug train --resume' first")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(
            f"--ckpt {path!r}: its meta.json stores no 'config', so the model cannot be rebuilt. "
            f"Fix: generate from a checkpoint written by moeplug train")
    saved = config_from_dict(inference_config(meta["config"]))
    # The device is this machine's choice, not the run's: validated by TrainConfig's own rule.
    cfg = dataclasses.replace(saved, train=dataclasses.replace(saved.train, device=device))
    if D.world_from_env() > 1:
        raise ConfigError(f"$WORLD_SIZE = {D.world_from_env()}: generate runs in one process. "
                          "Fix: run 'moeplug generate' directly, not under torchrun")
    target = D.resolve_device(cfg)
    corpus = prepare_corpus(cfg.data)  # the run's tokenizer: cached, or rebuilt from its data
    want = meta.get("tokenizer")
    if want is not None and corpus.tokenizer.fingerprint() != want:
        raise CheckpointError(
            f"--ckpt {path!r}: the tokenizer built from the run's data config (corpus "
            f"{cfg.data.corpus!r}, {cfg.data.tokenizer}) differs from the one it trained with, "
            f"so its ids would decode to the wrong text. Fix: restore the corpus files the run "
            f"trained on (data.corpus)")
    model = build_model(cfg, PluginHost.load(block=cfg.plugins.block), corpus.vocab_size)
    load_checkpoint(path, model, optimizer=None, restore_rng=False)  # any layout's shards
    return LoadedModel(model.to(target).eval(), corpus.tokenizer, cfg, path, int(meta["step"]))


@torch.no_grad()
def next_token_logits(model: torch.nn.Module, ids: list[int], context_len: int,
                      vocab_size: int) -> torch.Tensor:
    """Float32 logits [V] of the token after ``ids`` (the last ``context_len`` of them). Rows
    past the tokenizer's vocabulary (``model.vocab_size`` padding) are never generated."""
    from moeplug.training.distributed import model_device
    tokens_BS = torch.tensor([ids[-context_len:]], dtype=torch.int64, device=model_device(model))
    return model(tokens_BS).logits_BSV[0, -1, :vocab_size].float()


def generate_ids(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int,
                 context_len: int, vocab_size: int, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0) -> list[int]:
    """The ``max_new_tokens`` ids that follow ``prompt_ids`` (non-empty), one forward each."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits_V = next_token_logits(model, ids, context_len, vocab_size)
        if temperature == 0:
            ids.append(int(logits_V.argmax()))
            continue
        logits_V = logits_V.cpu() / temperature
        if 0 < top_k < vocab_size:
            kth = torch.topk(logits_V, top_k).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, -math.inf)
        ids.append(int(torch.multinomial(torch.softmax(logits_V, -1), 1, generator=gen)))
    return ids[len(prompt_ids):]


def cmd_generate(args: argparse.Namespace) -> int:
    from moeplug.data.dataset import WORK_SEPARATOR

    _check_args(args)
    loaded = load_checkpoint_model(args.ckpt, args.device)
    tok = loaded.tokenizer
    # An empty prompt starts where every work starts in training: after the work separator.
    prompt_ids = tok.encode(args.prompt) or tok.encode(WORK_SEPARATOR)
    mode = ("greedy" if args.temperature == 0 else
            f"temperature {args.temperature}, top-k {args.top_k or 'all'}, seed {args.seed}")
    # first, so a long generation shows what runs
    print(f"moeplug generate: {loaded.path} (step {loaded.step}), {mode}, "
          f"{args.max_new_tokens} new tokens", file=sys.stderr, flush=True)
    new_ids = generate_ids(loaded.model, prompt_ids, args.max_new_tokens,
                           loaded.cfg.train.seq_len, tok.vocab_size, args.temperature,
                           args.top_k, args.seed)
    # The prompt verbatim, then the continuation (byte-level tokenizers: decoding the new ids
    # alone gives the same text as decoding prompt + new ids, since the prompt is whole chars).
    print(args.prompt + tok.decode(new_ids))
    return 0
