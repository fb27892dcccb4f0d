"""``moeplug generate``: read the text a trained model writes, from its checkpoint.

    model = load_checkpoint_model(ckpt, device)   # LoadedModel: model, tokenizer, cfg, path
    ids = generate_ids(model.model, prompt_ids, ...)

What is loaded is what the run trained: the model is rebuilt from the config stored in the
checkpoint's meta.json and filled from its safetensors (never unpickled); the tokenizer is the
run's: the Hugging Face tokenizer the checkpoint carries (a run with ``data.tokenizer`` a path,
an import of a model with its tokenizer), else the one :func:`moeplug.data.prepare_corpus`
finds (or rebuilds) from the same data config; either is checked against the fingerprint the
trainer stored in the checkpoint. One process, whatever
layout trained it: the shards of a tp/cp/pp/ep/etp run are joined as a one-process resume joins
them (moeplug.training.reshard), and only what defines the model is taken from the run's config
(:func:`inference_config`), so neither its layout nor an execution setting stands in the way.

The prompt is framed as training framed a document: after the tokenizer's BOS where it adds one
(an empty prompt: a document's start, after BOS, EOS or the works' separator); generation stops
at the tokenizer's EOS. Decoding: greedy (temperature 0) takes the argmax token; sampling divides the logits by the
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
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training import distributed as D
    from moeplug.data.tokenizer import HFTokenizer
    from moeplug.training.checkpoint import (carried_tokenizer, config_dict, find_checkpoint,
                                             load_checkpoint, read_meta)

    path = find_checkpoint(ckpt)
    if path is None:
        raise CheckpointError(
            f"--ckpt {ckpt!r}: no checkpoint there (expected a step_XXXXXX directory with "
            f"meta.json, or a run directory with 'latest' or step_* checkpoints). Fix: pass "
            f"the --out / train.out_dir of a finished 'moeplug train' run")
    meta = read_meta(path)
    carried = carried_tokenizer(path, meta)
    if "hf" in meta and carried is None:
        raise CheckpointError(
            f"--ckpt {path!r} was imported from Hugging Face ({meta['hf'].get('source')}) "
            f"without a tokenizer (that directory held no tokenizer.json), so nothing says "
            f"which text its ids are. Fix: import a directory saved with its tokenizer "
            f"(tokenizer.save_pretrained into it), or train it on with 'moeplug train --resume "
            f"--set data.tokenizer=...' first")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(
            f"--ckpt {path!r}: its meta.json stores no 'config', so the model cannot be rebuilt. "
            f"Fix: generate from a checkpoint written by moeplug train")
    config = inference_config(config_dict(path, meta))
    if carried is not None:  # its tokenizer is all the data it needs (the corpus may be gone)
        config["data"] = {"tokenizer": carried}
    saved = config_from_dict(config)
    # The device is this machine's choice, not the run's: validated by TrainConfig's own rule.
    cfg = dataclasses.replace(saved, train=dataclasses.replace(saved.train, device=device))
    if D.world_from_env() > 1:
        raise ConfigError(f"$WORLD_SIZE = {D.world_from_env()}: generate runs in one process. "
                          "Fix: run 'moeplug generate' directly, not under torchrun")
    target = D.resolve_device(cfg)
    if carried is not None:
        tokenizer = HFTokenizer.load(carried, field=f"--ckpt {path!r} tokenizer")
    else:  # the run's tokenizer: cached, or rebuilt from its data
        tokenizer = prepare_corpus(cfg.data).tokenizer
    want = meta.get("tokenizer")
    if want is not None and tokenizer.fingerprint() != want:
        raise CheckpointError(
            f"--ckpt {path!r}: the tokenizer built from the run's data config (corpus "
            f"{cfg.data.corpus!r}, {cfg.data.tokenizer}) differs from the one it trained with, "
            f"so its ids would decode to the wrong text. Fix: restore the corpus files the run "
            f"trained on (data.corpus)")
    rows = meta.get("model_vocab_size") or cfg.model_vocab_size(tokenizer.vocab_size)
    model = build_model(cfg, PluginHost.load(block=cfg.plugins.block), rows)
    load_checkpoint(path, model, optimizer=None, restore_rng=False)  # any layout's shards
    return LoadedModel(model.to(target).eval(), tokenizer, cfg, path, int(meta["step"]))


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
                 seed: int = 0, stop_id: int | None = None) -> list[int]:
    """The (up to) ``max_new_tokens`` ids that follow ``prompt_ids`` (non-empty), one forward
    each; ``stop_id`` (the tokenizer's EOS) ends the text early and is not returned."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits_V = next_token_logits(model, ids, context_len, vocab_size)
        if temperature == 0:
            ids.append(int(logits_V.argmax()))
            if ids[-1] == stop_id:
                return ids[len(prompt_ids):-1]
            continue
        logits_V = logits_V.cpu() / temperature
        if 0 < top_k < vocab_size:
            kth = torch.topk(logits_V, top_k).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, -math.inf)
        ids.append(int(torch.multinomial(torch.softmax(logits_V, -1), 1, generator=gen)))
        if ids[-1] == stop_id:
            return ids[len(prompt_ids):-1]
    return ids[len(prompt_ids):]


def cmd_generate(args: argparse.Namespace) -> int:
    from moeplug.data.dataset import WORK_SEPARATOR

    _check_args(args)
    loaded = load_checkpoint_model(args.ckpt, args.device)
    tok = loaded.tokenizer
    text_ids = tok.encode(args.prompt)
    # The prompt where training puts a document's text: after the BOS where the tokenizer adds
    # one; an empty one at a document's start: after BOS, the previous document's EOS, or the
    # works' separator.
    head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    prompt_ids = head + text_ids or ([tok.eos_id] if tok.eos_id is not None
                                     else tok.encode(WORK_SEPARATOR))
    mode = ("greedy" if args.temperature == 0 else
            f"temperature {args.temperature}, top-k {args.top_k or 'all'}, seed {args.seed}")
    # first, so a long generation shows what runs
    print(f"moeplug generate: {loaded.path} (step {loaded.step}), {mode}, "
          f"{args.max_new_tokens} new tokens", file=sys.stderr, flush=True)
    new_ids = generate_ids(loaded.model, prompt_ids, args.max_new_tokens,
                           loaded.cfg.train.seq_len, tok.vocab_size, args.temperature,
                           args.top_k, args.seed, stop_id=tok.eos_id)
    print(args.prompt + continuation(tok, text_ids, new_ids))
    return 0


def continuation(tok: Any, text_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after ``text_ids``: decoded together, less the prompt's own text
    (a tokenizer may decode a token differently at a text's start, e.g. sentencepiece's
    leading space); byte-level tokenizers give the new ids' text alone either way."""
    head = tok.decode(text_ids)
    whole = tok.decode(text_ids + new_ids)
    return whole[len(head):] if whole.startswith(head) else tok.decode(new_ids)
