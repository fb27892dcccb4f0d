"""Command line: ``moeplug train | plugins`` and ``moeplug --version``.

``train`` validates everything cheap first — config, plugin names, availability and options —
and only then prepares data, builds the model and trains, so a typo costs a second, not a run.
Every configuration problem (``ConfigError``, which ``PluginError`` and ``CheckpointError``
subclass) exits with status 2 and one paragraph naming the field, the value and the fix.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from typing import Sequence

import moeplug
from moeplug.config import ConfigError, RootConfig, load_config

EXIT_CONFIG = 2


def default_config_path() -> str:
    return str(resources.files("moeplug").joinpath("configs", "default.yaml"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeplug", description=__doc__.splitlines()[0])
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
    t.add_argument("--nproc", type=int, metavar="N", help="run on N processes: re-executes this "
                   "command under torchrun (layout: the parallel.* config section)")
    from moeplug.convert.cli import add_convert_parser
    add_convert_parser(sub)
    from moeplug.observability.cli import add_plot_parsers
    add_plot_parsers(sub)
    from moeplug.generate import add_generate_parser
    add_generate_parser(sub)
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
    return out


def _load_host(cfg: RootConfig):
    from moeplug.plugin_host import PluginHost
    return PluginHost.load(block=cfg.plugins.block)


def check_plugins(host, cfg: RootConfig):
    """Fail fast (PluginError) if a chosen plugin is unknown, unavailable or has bad options.

    The host has no build-free check, so one instance of each component is created (one layer's
    worth: cheap next to data preparation). Returns the precision recipe, which is reused.
    """
    p, m = cfg.plugins, cfg.model
    host.create("router", p.router, dict(p.router_options), m)
    dispatcher = host.create("dispatcher", p.dispatcher, dict(p.dispatcher_options), m, None)
    host.create("experts", p.experts, dict(p.experts_options), m, dispatcher.num_local_experts)
    return host.create("precision", p.precision, dict(p.precision_options))


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
    return 0


def cmd_train(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    # 1. config, 2. plugins (checked, nothing built) — all cheap and all before any heavy work.
    base = None
    if args.preset:
        from moeplug.presets import preset
        base = preset(args.preset)
    # A preset replaces the packaged default.yaml (whose model would override the preset's).
    path = args.config or (None if base else default_config_path())
    cfg = load_config(path, _overrides(args), base=base)
    host = _load_host(cfg)
    precision = check_plugins(host, cfg)
    from moeplug.training.checkpoint import check_resume, resolve_resume
    resume_from = resolve_resume(cfg.train.resume, cfg.train.out_dir)
    if cfg.train.tensorboard:  # a missing optional package fails here too
        from moeplug.observability.tensorboard import summary_writer_class
        summary_writer_class()
    # Layout vs world size: checked here, before any process or process group exists.
    from moeplug.training import distributed as D
    from moeplug.training import launch
    world = D.world_from_env() if launch.under_torchrun() else (args.nproc or 1)
    if args.nproc is not None and (args.nproc < 1 or (launch.under_torchrun()
                                                      and args.nproc != world)):
        raise ConfigError(f"--nproc {args.nproc}: must be >= 1 and, under torchrun, equal "
                          f"its world size ({world}). Fix: pass --nproc N >= 1, or leave it out "
                          "when launching with torchrun yourself")
    layout = None
    if D.is_parallel(cfg, world):
        layout = D.planned_layout_manifest(cfg, D.resolve_layout(cfg, world), world)
    if resume_from:
        # A checkpoint of another layout or model, or already at train.steps, fails here (once,
        # before --nproc launches any rank), not after the model is built.
        source = " + ".join([f"--preset {args.preset}"] * bool(args.preset)
                            + [f"--config {args.config}"] * bool(args.config)) \
            or f"the packaged {path}"
        check_resume(resume_from, cfg, source, layout)
    # train.device=cuda without (enough) GPUs fails here, before --nproc starts any rank.
    device = D.resolve_device(cfg, None if launch.under_torchrun() else world)
    # 3. heavy work: data, model, loop. Imports are here so `--version`/`plugins` stay fast.
    from moeplug.data import prepare_corpus
    from moeplug.training.trainer import seed_everything, train

    if world > 1 and not launch.under_torchrun():
        prepare_corpus(cfg.data)  # once, here: the ranks then only read the cache
        return launch.relaunch(world, argv)
    groups = D.init_distributed(cfg)
    try:
        if not D.is_main_rank(groups):  # rank 0 prepares the cache, the others then read it
            D.barrier(groups)
        corpus = prepare_corpus(cfg.data)
        if D.is_main_rank(groups):
            D.barrier(groups)
        seed_everything(cfg.train.seed)  # same seed everywhere: every rank builds the same init
        model = D.build_rank_model(cfg, host, corpus.vocab_size, groups, device)
        plugin_names = {k: getattr(cfg.plugins, k) for k in ("router", "dispatcher", "experts", "precision")}
        summary = train(cfg, model, corpus, precision, plugin_names, groups=groups)
    finally:
        D.shutdown(groups)
    if not D.is_main_rank(groups):
        return 0
    verdict = "below" if summary.val_loss < summary.unigram_entropy else "NOT below"
    print(f"done: {summary.steps} steps, {summary.tokens_per_s:.0f} tokens/s, "
          f"final train loss {summary.final_train_loss:.4f}")
    print(f"validation loss {summary.val_loss:.4f} nats/token vs unigram entropy "
          f"{summary.unigram_entropy:.4f} nats/token ({verdict})")
    print(f"checkpoint: {summary.checkpoint}\nmetrics: {summary.metrics_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.version:
            return cmd_version()
        if args.command == "plugins":
            return cmd_plugins()
        if args.command == "train":
            return cmd_train(args, argv)
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
    except ConfigError as e:
        print(f"moeplug: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    _parser().print_help()
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
