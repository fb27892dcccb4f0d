"""moeplug as a library: build a model, train it on batches of your own.

    from moeplug import library

    built = library.build("my.yaml", overrides=["model.moe.num_experts=16"])  # a fresh model
    built = library.build(checkpoint="runs/imported")  # any checkpoint or `convert import`
    summary = library.train(built, batches, out_dir="runs/mine", steps=200)

:func:`build` makes the model the way ``moeplug train`` does (the same config validation,
plugins, seed and initialisation; a checkpoint's weights loaded into it, and its tokenizer
where it carries one). :func:`train` runs the very trainer of ``moeplug train``
(moeplug.training.trainer.train: the LR schedule, clipping, checkpoints and metrics.jsonl in
``out_dir``, non-finite handling), fed with your batches instead of the corpus': an iterable of
micro-batches, each a ``(tokens_BS, targets_BS)`` pair of int64 tensors or one ``[B, S + 1]``
tensor (inputs and targets shifted by one), ``train.grad_accum_steps`` of them per optimizer
step. One process; the checkpoints it writes resume with ``moeplug train --resume``, and
generate and export like any run's (with a Hugging Face tokenizer, which they carry).

Legend: B micro-batch size, S sequence length.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from moeplug.config import (ConfigError, RootConfig, apply_overrides, config_from_dict,
                            load_config, merge_config_dicts)


@dataclass(frozen=True)
class Built:
    """What :func:`build` returns: the validated config, the model (train mode, on the CPU, or
    ``train.device``), the tokenizer when known (None: a local BPE that was not trained here),
    and the checkpoint its weights came from."""

    cfg: RootConfig
    model: torch.nn.Module
    tokenizer: Any
    checkpoint: str | None = None


def _config(config: Any, overrides: Sequence[str], base: dict | None) -> RootConfig:
    if isinstance(config, RootConfig):
        return config_from_dict(apply_overrides(config.to_dict(), list(overrides)))
    if isinstance(config, dict):
        data = merge_config_dicts(base or {}, copy.deepcopy(config))
        return config_from_dict(apply_overrides(data, list(overrides)))
    if config is None and base is not None:
        return config_from_dict(apply_overrides(copy.deepcopy(base), list(overrides)))
    if config is None:
        from moeplug.cli import default_config_path
        config = default_config_path()
    return load_config(str(config), list(overrides), base=base)


def build(config: str | dict | RootConfig | None = None, *, checkpoint: str | None = None,
          overrides: Sequence[str] = (), vocab_size: int | None = None) -> Built:
    """A model as ``moeplug train`` builds it.

    ``config``: a YAML path, a nested dict, or a RootConfig (default: the packaged
    default.yaml; with ``checkpoint``: the checkpoint's own config), ``overrides`` (dotted
    ``key=value``) on top. ``checkpoint``: a step or run directory of ``moeplug train`` or
    ``convert import``, whose weights are loaded (a config given with it must define the same
    model). ``vocab_size``: the tokenizer's vocabulary where none is known without training
    one (``data.tokenizer: bpe``); the model pads it as ``model.vocab_size: 0`` says."""
    from moeplug.data.tokenizer import ByteTokenizer, HFTokenizer, is_hf_tokenizer
    from moeplug.build import build_model
    from moeplug.plugin_host import check_plugins, load_host
    from moeplug.training import distributed as D
    from moeplug.training.checkpoint import (config_dict, find_checkpoint, load_checkpoint,
                                             read_meta, CheckpointError)
    from moeplug.training.trainer import seed_everything

    path = meta = None
    base = None
    if checkpoint is not None:
        path = find_checkpoint(checkpoint)
        if path is None:
            raise CheckpointError(f"build(checkpoint={checkpoint!r}): no checkpoint there. Fix: "
                                  f"pass a step_* directory or a run directory of moeplug train "
                                  f"or moeplug convert import")
        meta = read_meta(path)
        base = config_dict(path, meta)
    cfg = _config(config, overrides, base if config is None else None)
    if base is not None and config is not None:
        from moeplug.config import model_differences
        host = load_host(cfg)
        diffs = model_differences(config_from_dict(base), cfg,
                                  lambda n, o: host.defining_options("router", n, o))
        if diffs:
            raise CheckpointError(f"build(checkpoint={path!r}): the config defines another model "
                                  f"({'; '.join(f'{k}: {a!r} vs {b!r}' for k, a, b in diffs)}). "
                                  f"Fix: leave config out (the checkpoint's is taken)")
    spec = cfg.data.tokenizer
    tokenizer = (HFTokenizer.load(spec) if is_hf_tokenizer(spec)
                 else ByteTokenizer() if spec == "bytes" else None)
    saved_rows = (meta or {}).get("model_vocab_size")  # a checkpoint's embedding: its rows
    tokens = (vocab_size or (tokenizer.vocab_size if tokenizer is not None else None)
              or saved_rows or cfg.model.vocab_size)
    if not tokens:
        raise ConfigError("build: data.tokenizer = 'bpe' is trained on the corpus, so its "
                          "vocabulary is not known here. Fix: pass vocab_size=N, set "
                          "model.vocab_size, or use a Hugging Face tokenizer (data.tokenizer: "
                          "a path) or 'bytes'")
    if saved_rows and tokens > saved_rows:
        raise ConfigError(f"build: the tokenizer's {tokens} ids exceed the {saved_rows} "
                          f"embedding rows of checkpoint {path!r}. Fix: build it with the "
                          f"tokenizer it was trained with (leave data.tokenizer and vocab_size "
                          f"out)")
    host = load_host(cfg)
    check_plugins(host, cfg)
    seed_everything(cfg.train.seed)
    model = build_model(cfg, host, saved_rows or cfg.model_vocab_size(tokens))
    if path is not None:
        load_checkpoint(path, model, optimizer=None, restore_rng=False)
    model = model.to(D.resolve_device(cfg)).train()
    return Built(cfg, model, tokenizer, path)


def _micro_batch(item: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(item, torch.Tensor) and item.dim() == 2 and item.shape[1] > 1:
        return item[:, :-1].contiguous(), item[:, 1:].contiguous()
    if isinstance(item, (tuple, list)) and len(item) == 2 and all(
            isinstance(t, torch.Tensor) and t.dim() == 2 for t in item) \
            and item[0].shape == item[1].shape:
        return item[0], item[1]
    shown = (f"a tensor of shape {tuple(item.shape)}" if isinstance(item, torch.Tensor)
             else type(item).__name__)
    raise ConfigError(f"library.train: batch {index} is {shown}, not a micro-batch. Fix: yield "
                      f"(tokens_BS, targets_BS) pairs of equal [B, S] int64 tensors, or [B, S + 1] "
                      f"tensors (inputs and targets shifted by one)")


def micro_batches(batches: Iterable) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` as (tokens_BS, targets_BS) pairs, each checked as it is drawn."""
    for i, item in enumerate(batches):
        yield _micro_batch(item, i)


def train(built: Built, batches: Iterable, *, out_dir: str, steps: int | None = None,
          val_batches: Iterable | None = None, overrides: Sequence[str] = (),
          log: Any = print) -> Any:
    """Train ``built.model`` in place on ``batches`` with the trainer of ``moeplug train``
    (its ``train`` section; ``steps`` and ``overrides`` on top); its TrainSummary. ``out_dir``
    receives metrics.jsonl and the checkpoints (refused if it holds another run);
    ``val_batches`` (a finite iterable, default none) are evaluated at train.eval_interval and
    at the end. Training starts at step 0 from the model's weights (a checkpoint's, for a
    fine-tune), with a fresh optimizer."""
    from moeplug.plugin_host import check_plugins, load_host
    from moeplug.training.run_dir import check_run_dir, lock_run_dir, release_run_dirs
    from moeplug.training.trainer import train as run_trainer

    extra = [f"train.out_dir={out_dir}", "train.resume=''"]
    if steps is not None:
        extra.append(f"train.steps={steps}")
    cfg = config_from_dict(apply_overrides(built.cfg.to_dict(), [*overrides, *extra]))
    check_run_dir(cfg.train.out_dir, "", None, False)
    precision = check_plugins(load_host(cfg), cfg)
    plugin_names = {k: getattr(cfg.plugins, k)
                    for k in ("router", "dispatcher", "experts", "precision")}
    val = [] if val_batches is None else list(micro_batches(val_batches))
    lock_run_dir(cfg.train.out_dir)
    try:
        return run_trainer(cfg, built.model, None, precision, plugin_names, log=log,
                           batches=micro_batches(batches), val_batches=val,
                           tokenizer=built.tokenizer)
    finally:
        release_run_dirs()


__all__ = ["Built", "build", "micro_batches", "train"]
