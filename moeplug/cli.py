"""Command line: ``moeplug train | plugins | convert | plot-load | data`` and ``moeplug --version``.

``train`` validates everything cheap first — config, plugin names, availability and options,
resume target, run directory, process count and layout — and only then prepares data, builds
the model and trains, so a typo costs a second, not a run. Every configuration problem
(``ConfigError``, which ``PluginError`` and ``CheckpointError`` subclass) exits with status 2
and one line per problem naming the field, the value and the fix, all problems of the command
at once. A fault during training (a non-finite step under ``train.nonfinite: stop``, a peer
rank that died or hung) exits with status 3 and one line (moeplug.training.faults).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from importlib import resources
from typing import Sequence

import moeplug
from moeplug.config import ConfigError, Problems, RootConfig
from moeplug.plugin_host import check_plugins, load_host as _load_host

EXIT_CONFIG = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what `cat`/`yes` report when the reader went away
# The commands are listed by argparse below it (a hand-written list here fell behind).
DESCRIPTION = ("Train Mixture-of-Experts language models. `moeplug COMMAND --help` lists a "
               "command's options.")


def default_config_path() -> str:
    return str(resources.files("moeplug").joinpath("configs", "default.yaml"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeplug", description=DESCRIPTION)
    p.add_argument("--version", action="store_true", help="print versions and build flags")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("plugins", help="list plugins per kind with their package and availability")
    t = sub.add_parser("train", help="train a model (defaults: moeplug/configs/default.yaml)")
    t.add_argument("--config", help="YAML config file (default: the packaged default.yaml, "
                   "or nothing when --preset is given)")
    t.add_argument("--preset", metavar="NAME", help="start from a model preset (mixtral, qwen3_moe, "
                   "deepseek_v3 and their *_tiny variants); --config and --set go on top")
    for kind in ("router", "dispatcher", "experts", "precision"):
        t.add_argument(f"--{kind}", metavar="NAME", help=f"{kind} plugin (plugins.{kind})")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, repeatable: --set model.moe.num_experts=8")
    t.add_argument("--steps", type=int, help="train.steps")
    t.add_argument("--out", metavar="DIR", help="train.out_dir (checkpoints + metrics.jsonl)")
    t.add_argument("--resume", metavar="DIR|auto", help="train.resume")
    t.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events "
                   "to OUT_DIR/tb (train.tensorboard)")
    t.add_argument("--wandb", action="store_true", help="also log to Weights & Biases "
                   "(train.wandb; train.wandb_mode=offline needs no network)")
    t.add_argument("--overwrite", action="store_true", help="replace the run already in --out "
                   "(its metrics.jsonl, checkpoints and latest are deleted first)")
    t.add_argument("--nproc", type=int, metavar="N", help="run on N processes: re-executes this "
                   "command under torchrun (layout: the parallel.* config section); data "
                   "parallelism multiplies the global batch")
    from moeplug.convert.cli import add_convert_parser
    add_convert_parser(sub)
    from moeplug.observability.cli import add_plot_parsers
    add_plot_parsers(sub)
    from moeplug.generate import add_generate_parser
    add_generate_parser(sub)
    from moeplug.data.cli import add_data_parser
    add_data_parser(sub)
    from moeplug.plan.cli import add_plan_parser
    add_plan_parser(sub)
    return p


def _overrides(args: argparse.Namespace) -> list[str]:
    # Dedicated flags come after --set: the more specific spelling wins.
    out = list(args.overrides)
    for kind in ("router", "dispatcher", "experts", "precision"):
        if getattr(args, kind) is not None:
            out.append(f"plugins.{kind}={getattr(args, kind)}")
    if args.steps is not None:
        out.append(f"train.steps={args.steps}")
    if args.out is not None:
        out.append(f"train.out_dir={args.out}")
    if args.resume is not None:
        out.append(f"train.resume={args.resume}")
    if args.tensorboard:
        out.append("train.tensorboard=true")
    if args.wandb:
        out.append("train.wandb=true")
    return out


def cmd_version() -> int:
    from moeplug.runtime import REBUILD_COMMAND, runtime_info
    print(f"moeplug {moeplug.__version__}")
    info = runtime_info()
    if not info.get("available"):
        # Still exit 0: --version reports state; training is what needs the extension.
        print(f"runtime core: NOT AVAILABLE ({info.get('error', 'unknown error')})")
        print(f"rebuild it with: {REBUILD_COMMAND}")
        return 0
    build = "CUDA" if info.get("cuda") else "CPU"
    rest = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("version", "available"))
    print(f"runtime core {info.get('version', '?')} ({build} build): {rest}")
    return 0


def cmd_plugins() -> int:
    from moeplug.plugin_host import PluginHost
    host = PluginHost.load()
    by_kind: dict[str, list] = {}
    for info in host.infos():  # already ordered by kind (router first), then name
        by_kind.setdefault(info.kind, []).append(info)
    for kind, infos in by_kind.items():
        print(f"{kind}:")
        for info in infos:
            status = "available" if info.available else f"unavailable: {info.reason}"
            print(f"  {info.name:<16} [{info.dist}]  {status}"
                  + (f"  — {info.description}" if info.description else ""))
    if host.skipped:  # blocked or autoload off: their components are not listed above
        print("entry points not loaded:")
        for s in host.skipped:
            print(f"  {s.entry_point:<16} [{s.dist}]  {s.reason}")
    return 0


def _nproc_error(nproc: int) -> str:
    return (f"--nproc {nproc}: must be >= 1. Fix: pass --nproc N with N >= 1, or leave it out "
            "to train in this one process")


def _world_size(cfg: RootConfig, nproc: int | None) -> int:
    """Processes the command runs on; ConfigError for a bad ``--nproc`` or a layout that needs
    more processes than one when ``--nproc`` is missing."""
    from moeplug.training import distributed as D
    from moeplug.training import launch
    if nproc is not None and nproc < 1:
        raise ConfigError(_nproc_error(nproc))
    if launch.under_torchrun():
        world = D.world_from_env()
        if nproc is not None and nproc != world:
            raise ConfigError(f"--nproc {nproc}: torchrun started {world} processes. Fix: leave "
                              f"--nproc out when launching with torchrun yourself, or pass "
                              f"--nproc {world}")
        return world
    needed = 1 if nproc is not None else cfg.parallel.layout().min_world_size()
    if needed > 1:
        p = cfg.parallel
        degrees = ", ".join(f"parallel.{n} = {getattr(p, n)}"
                            for n in ("tp", "cp", "dp", "pp", "ep", "etp") if getattr(p, n) > 1)
        raise ConfigError(f"{degrees}: needs {needed} processes, but without --nproc this "
                          f"command runs one. Fix: add --nproc {needed} (or launch with "
                          "torchrun), or set the parallel degrees to 1")
    return nproc or 1


def cmd_train(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    # 1. config, 2. plugins, resume, run directory, layout (checked, nothing built) — all cheap
    # and all before any heavy work or process; every problem found is reported together.
    base = None
    if args.preset:
        from moeplug.config.presets import preset
        base = preset(args.preset)
    # A preset replaces the packaged default.yaml (whose model would override the preset's).
    path = args.config or (None if base else default_config_path())
    problems = Problems()
    try:
        cfg, resume_from, meta = _resolve_config(args, base, problems)
        resume_failed = bool(problems.errors)
    except ConfigError as e:  # the fields' problems, with a bad --nproc (needs no config)
        nproc = [] if args.nproc is None or args.nproc >= 1 else [_nproc_error(args.nproc)]
        raise ConfigError(*(e.errors or [str(e)]), *nproc) from None
    from moeplug.training import distributed as D
    from moeplug.training import launch
    from moeplug.training.checkpoint import check_resume
    from moeplug.training.run_dir import LOCKED_ENV, check_run_dir, clear_run, lock_run_dir
    # A model that cannot fit is refused first: the plugin check below already allocates.
    from moeplug.training.memory_floor import check_fits
    check_fits(cfg, 1 if launch.under_torchrun() else args.nproc or 1)
    with problems.check():
        host = _load_host(cfg)
        precision = check_plugins(host, cfg)
    if cfg.train.tensorboard:
        with problems.check():  # a missing optional package fails here too
            from moeplug.observability.tensorboard import summary_writer_class
            summary_writer_class()
    if cfg.train.wandb:
        with problems.check():
            from moeplug.observability.wandb_writer import wandb_module
            wandb_module()
    if not resume_failed:  # (a train.resume that does not resolve said so already)
        with problems.check():  # may this run write there?
            check_run_dir(cfg.train.out_dir, cfg.train.resume, resume_from, args.overwrite)
    tokenizer = None
    with problems.check():  # a Hugging Face tokenizer read now: a broken one fails here
        tokenizer = _cheap_tokenizer(cfg)
        if tokenizer is not None and resume_from is None:  # (a resume: check_tokenizer below)
            cfg.model_vocab_size(tokenizer.vocab_size)  # ids past model.vocab_size: refused
    world, layout = None, None
    with problems.check():  # layout vs world size: before any process or process group exists
        world = _world_size(cfg, args.nproc)
        if D.is_parallel(cfg, world):
            layout = D.planned_layout_manifest(cfg, D.resolve_layout(cfg, world), world)
    if resume_from and world is not None and not problems.errors:
        with problems.check():
            # A checkpoint of another layout or model, or already at train.steps, fails here
            # (once, before --nproc launches any rank), not after the model is built.
            source = " + ".join([f"--preset {args.preset}"] * bool(args.preset)
                                + [f"--config {args.config}"] * bool(args.config)) \
                or f"the checkpoint's own config over the packaged {path}"
            check_resume(resume_from, cfg, source, layout,
                         lambda name, opts: host.defining_options("router", name, opts))
            if tokenizer is not None:  # the same ids as the embedding was trained on
                from moeplug.training.resume import check_tokenizer
                check_tokenizer(resume_from, meta, cfg, tokenizer)
    if world is not None:
        with problems.check():  # train.device=cuda without (enough) GPUs, before any rank starts
            device = D.resolve_device(cfg, None if launch.under_torchrun() else world)
    if problems.errors:
        raise ConfigError(*problems.errors)
    # One live run per out dir: the launcher (or a process alone) holds its lock; its ranks
    # skip it; under a plain torchrun, rank 0 takes it.
    if not launch.under_torchrun() or os.environ.get("RANK") == "0":
        lock_run_dir(cfg.train.out_dir)
    if world > 1 and not launch.under_torchrun():
        os.environ[LOCKED_ENV] = os.path.realpath(cfg.train.out_dir)
    # 3. heavy work: data, model, loop. Imports are here so `--version`/`plugins` stay fast.
    from moeplug.data import prepare_corpus

    if world > 1 and not launch.under_torchrun():
        # once, here: the ranks then only read the cache
        corpus = prepare_corpus(cfg.data, host, log=print)
        _check_corpus(cfg, corpus, resume_from, meta)
        if args.overwrite:
            clear_run(cfg.train.out_dir)
        return launch.relaunch(cfg, world, argv)
    groups = D.init_distributed(cfg)
    from moeplug.runtime.stash import StashOverflowError
    from moeplug.training.faults import (EXIT_FAULT, Stopped, TrainingFault,
                                         exit_on_stop_signals, is_peer_failure,
                                         rank_failure_line, stop_on_signals, stopped_line)
    if groups is not None:
        exit_on_stop_signals(D.heartbeat(groups), groups.rank)
    try:
        with contextlib.nullcontext() if groups is not None else stop_on_signals():
            summary = _train_rank(cfg, args, host, precision, groups, device, resume_from,
                                  meta)
    except Stopped as e:  # one process, Ctrl-C or SIGTERM (ranks: exit_on_stop_signals)
        from moeplug.training.checkpoint import find_latest
        out = cfg.train.out_dir
        print(stopped_line(e.signum, find_latest(out) if os.path.isdir(out) else None),
              file=sys.stderr)
        return 128 + e.signum
    except (TrainingFault, StashOverflowError) as e:  # a non-finite step under
        # train.nonfinite=stop, runtime.stash_overflow=fail, ...
        print(f"moeplug: {e}", file=sys.stderr)
        if groups is None:
            return EXIT_FAULT
        # The fault was found by a collective just before (first_located's all_gather_object).
        _leave_rank(groups, EXIT_FAULT)
    except RuntimeError as e:  # gloo/NCCL: a collective failed because a peer died or hung
        if groups is None or not is_peer_failure(e):
            raise
        print(rank_failure_line(e, groups.rank, D.heartbeat(groups)), file=sys.stderr)
        sys.stdout.flush()
        os._exit(EXIT_FAULT)  # skip teardown: it would wait on the failed peer again
    finally:
        D.shutdown(groups)
    if D.is_main_rank(groups):
        verdict = "below" if summary.val_loss < summary.unigram_entropy else "NOT below"
        print(f"done: {summary.steps} steps, {summary.tokens_per_s:.0f} tokens/s, "
              f"final train loss {summary.final_train_loss:.4f}")
        print(f"validation loss {summary.val_loss:.4f} nats/token vs unigram entropy "
              f"{summary.unigram_entropy:.4f} nats/token ({verdict})")
        print(f"checkpoint: {summary.checkpoint}\nmetrics: {summary.metrics_path}")
    if groups is not None:
        _leave_rank(groups, 0)
    return 0


def _resolve_config(args: argparse.Namespace, base: dict | None, problems: Problems):
    """(config, checkpoint to resume or None, its meta.json or None). A resume takes what the
    command does not give (no --config/--preset/--set names it) from its checkpoint: the model,
    router and tokenizer (moeplug.training.resume). ConfigError for the config's problems; a
    bad train.resume is recorded in ``problems``."""
    from moeplug.config import config_from_dict, load_config_dict, merge_config_dicts
    from moeplug.training.checkpoint import read_meta, resolve_resume
    from moeplug.training.resume import from_checkpoint
    from moeplug.config import TrainConfig
    given = load_config_dict(args.config, _overrides(args), base=base)
    fallback = {} if args.config or base else load_config_dict(default_config_path())
    merged = merge_config_dicts(fallback, given)
    # Where to resume from, read before the whole config is checked: the checkpoint's model
    # may be what makes the rest valid (a layout the packaged model's heads do not split).
    train = merged.get("train") if isinstance(merged.get("train"), dict) else {}
    resume, out = train.get("resume", ""), train.get("out_dir", TrainConfig().out_dir)
    resume_from = meta = None
    if isinstance(resume, str) and isinstance(out, str):
        with problems.check():  # a bad train.resume fails here, not later
            resume_from = resolve_resume(resume, out)
            if resume_from is not None:
                meta = read_meta(resume_from)
    if meta is None:
        return config_from_dict(merged), resume_from, None
    taken = from_checkpoint(resume_from, meta)
    return (config_from_dict(merge_config_dicts(merge_config_dicts(fallback, taken), given)),
            resume_from, meta)


def _cheap_tokenizer(cfg: RootConfig):
    """The run's tokenizer when it needs no corpus (a Hugging Face one, bytes), else None."""
    from moeplug.data.tokenizer import ByteTokenizer, HFTokenizer, is_hf_tokenizer
    if is_hf_tokenizer(cfg.data.tokenizer):
        return HFTokenizer.load(cfg.data.tokenizer)
    return ByteTokenizer() if cfg.data.tokenizer == "bytes" else None


def _check_corpus(cfg: RootConfig, corpus, resume_from: str | None, meta: dict | None) -> int:
    """Once the tokenizer is built (a BPE is trained on the corpus), before any rank starts or
    the model is built: a resumed checkpoint was trained with the same tokenizer and data
    order, every id has a row in the model (the rows split over TP), and data.document_mask
    finds the tokenizer's EOS. Returns the model's vocabulary rows."""
    from moeplug.data.corpus import check_run_data
    from moeplug.data.documents import document_eod
    if resume_from is not None and meta is not None:  # first: it names the checkpoint
        from moeplug.training.resume import check_tokenizer
        check_tokenizer(resume_from, meta, cfg, corpus.tokenizer)
    rows = cfg.model_vocab_size(corpus.vocab_size)
    check_run_data(corpus, cfg, resume_from, meta)
    document_eod(cfg, corpus.tokenizer)
    return rows


def _train_rank(cfg: RootConfig, args: argparse.Namespace, host, precision, groups, device,
                resume_from: str | None = None, meta: dict | None = None):
    """This process's part of the run: data, model, loop; train()'s summary."""
    from moeplug.data import prepare_corpus
    from moeplug.training import distributed as D
    from moeplug.training.run_dir import clear_run
    from moeplug.training.trainer import seed_everything, train
    if not D.is_main_rank(groups):  # rank 0 prepares the cache, the others then read it
        D.barrier(groups)
    corpus = prepare_corpus(cfg.data, host, log=print if D.is_main_rank(groups) else None)
    if D.is_main_rank(groups):
        D.barrier(groups)
        print(corpus.description)
    # the launcher checked these before the ranks started; one process (or a plain torchrun)
    # here
    rows = _check_corpus(cfg, corpus, resume_from, meta)
    seed_everything(cfg.train.seed)  # same seed everywhere: every rank builds the same init
    model = D.build_rank_model(cfg, host, rows, groups, device)
    plugin_names = {k: getattr(cfg.plugins, k)
                    for k in ("router", "dispatcher", "experts", "precision")}
    if args.overwrite and D.is_main_rank(groups):  # the last moment: data and model built
        clear_run(cfg.train.out_dir)
    return train(cfg, model, corpus, precision, plugin_names, groups=groups)


def _leave_rank(groups, code: int) -> None:
    """A rank under torchrun leaves without interpreter teardown. A gloo worker thread may
    still be dropping a finished collective's tensors, which takes the GIL, and a thread that
    takes the GIL while the interpreter finalizes is pthread_exit'ed through a noexcept
    destructor: SIGABRT instead of the exit status (a fault stop at EP2 ~1 run in 25, CI at
    9922f33, core dump; a clean DP2 run's rank 1 in CI at f780329). Nothing is lost: train()
    closed its writers, checkpoints were renamed into place, the shm heap and the spill tier's
    files are unlinked at creation; the runtime streams are drained here (atexit would)."""
    from moeplug.runtime import drain_streams
    from moeplug.training import distributed as D
    D.shutdown(groups)
    drain_streams()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        status = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at interpreter exit
        return status
    except BrokenPipeError:  # `moeplug --version | head -1`: the reader has all it wants
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.version:
            return cmd_version()
        if args.command == "plugins":
            return cmd_plugins()
        if args.command == "train":
            from moeplug.training.run_dir import release_run_dirs
            try:
                return cmd_train(args, argv)
            finally:  # in-process callers (tests, notebooks) may train there again
                release_run_dirs()
        if args.command == "convert":
            from moeplug.convert.cli import cmd_convert
            return cmd_convert(args)
        if args.command in ("plot", "plot-load"):
            from moeplug.observability.cli import cmd_plot
            return cmd_plot(args)
        if args.command == "generate":
            from moeplug.generate import cmd_generate
            return cmd_generate(args)
        if args.command == "plan":
            from moeplug.plan.cli import cmd_plan
            return cmd_plan(args)
        if args.command == "data":
            from moeplug.data.cli import cmd_data
            return cmd_data(args)
    except ConfigError as e:
        for error in e.errors or [str(e)]:  # one line each, all of this command's problems
            print(f"moeplug: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    _parser().print_help()
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
