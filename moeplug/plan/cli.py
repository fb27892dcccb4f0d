"""``moeplug plan``: per-rank memory, step time and TFLOP/s of a mapping, or the best mappings.

    moeplug plan --preset deepseek_v3 --cluster gb200 --gpus 256 --mapping tp=1,ep=64,pp=4
    moeplug plan --preset qwen3_235b --cluster h100 --gpus 256 --search --out search.png
    moeplug plan --config run.yaml --cluster cpu      # the config's model, parallel and batch
"""

from __future__ import annotations

import argparse

from moeplug.config import ConfigError

MAPPING_KEYS = ("tp", "cp", "pp", "ep", "etp", "vpp", "mbs", "fsdp", "fsdp_reshard")
SWITCH_KEYS = ("fsdp", "fsdp_reshard")  # 0 or 1 (parallel.fsdp, _reshard_after_forward)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict per-rank memory and step time of a parallel "
                       "mapping, or search the mappings that fit")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help="model: a preset or a planner model "
                     "(qwen3_235b, mixtral_8x22b, qwen2_57b)")
    src.add_argument("--config", metavar="FILE", help="YAML config: its model, and (without "
                     "--mapping) its parallel section and batch")
    p.add_argument("--cluster", default="h100", help="h100, h200, gb200, gb300 or cpu "
                   "(this machine, measured now); default h100")
    p.add_argument("--gpus", type=int, metavar="N", help="device count (default: one node, "
                   "or the config's world)")
    p.add_argument("--mapping", metavar="K=V,..", help=f"keys {', '.join(MAPPING_KEYS)}, "
                   "and last layout=STRING (Megatron's pipeline layout, which may hold commas); "
                   "e.g. tp=2,ep=8,pp=4,vpp=2 or 'pp=8,ep=32,layout=Et*3|(tt|)*29m|L'; "
                   "fsdp=1 plans FSDP2 (parallel.fsdp), fsdp_reshard=0 keeps the gathered "
                   "parameters from forward to backward")
    p.add_argument("--search", action="store_true", help="rank every valid mapping")
    p.add_argument("--gbs", type=int, metavar="N", help="global batch in sequences "
                   "(default: 8 per data-parallel rank ... the config's)")
    p.add_argument("--seq", type=int, metavar="N", help="sequence length (default 4096)")
    p.add_argument("--precision", default=None, help="GEMM precision: bf16 (default on GPUs), "
                   "fp8, fp32 (default on cpu)")
    p.add_argument("--recompute", default="", metavar="M,..", help="recomputed modules "
                   "(Megatron recompute_modules: layernorm, mla_up_proj, moe_act, mlp, moe, ...), "
                   "or full (whole blocks, Megatron's granularity full)")
    p.add_argument("--offload", default="", metavar="M,..", help="offloaded activations "
                   "(expert_fc1, moe_act, ...)")
    p.add_argument("--dispatcher", default="flex", help="flex (DeepEP/HybridEP) or alltoall")
    p.add_argument("--a2a-overlap", action="store_true", help="combined-1F1B EP overlap")
    p.add_argument("--token-budget", type=float, default=None, metavar="F",
                   help="plan sync-free MoE (runtime.sync_free) with this token budget "
                   "(default: the config's, else off)")
    p.add_argument("--out", metavar="PNG", help="with --search: plot of the search")
    p.add_argument("--dry-run", action="store_true", help="also build each measured rank's "
                   "real model and optimizer under torch's fake process group and fake tensors "
                   "and run one train step: its measured bytes beside the plan's "
                   "(docs/planning.md, 'Dry run')")
    p.add_argument("--rank", type=int, action="append", metavar="R", help="with --dry-run: "
                   "the global rank to measure (repeatable; default one rank of every "
                   "pipeline stage)")


def _parse_mapping(text: str) -> dict:
    out = {}
    head, sep, layout = text.partition("layout=")
    if sep:  # the layout takes the rest: Megatron's strings may contain commas
        if head and not head.endswith(","):
            raise ConfigError(f"--mapping {text!r}: bad item {head.split(',')[-1] + sep!r}. "
                              "Fix: write layout=STRING as the last item, e.g. "
                              "--mapping 'pp=8,ep=32,layout=Et*3|(tt|)*29m|L'")
        out["layout"] = layout
        text = head
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key in SWITCH_KEYS and sep and value.strip() not in ("0", "1"):
            raise ConfigError(f"--mapping {text!r}: bad item {item!r}: {key} is a switch. "
                              f"Fix: write {key}=1 (on) or {key}=0 (off)")
        if not sep or key not in MAPPING_KEYS or not value.strip().isdigit() \
                or (int(value) < 1 and key not in SWITCH_KEYS):
            # (a 0 degree once reached a ZeroDivisionError traceback)
            raise ConfigError(f"--mapping {text!r}: bad item {item!r}. Fix: write "
                              f"key=integer pairs (each >= 1) with keys "
                              f"{', '.join(MAPPING_KEYS)} (fsdp and fsdp_reshard 0 or 1), e.g. "
                              "--mapping tp=2,ep=8,pp=4")
        out[key] = int(value)
    return out


def _inputs(args: argparse.Namespace):
    """(model config, mapping fields from the config or {}, options overrides, world)."""
    from moeplug.plan.models import model_config
    if args.config:
        return config_inputs(args.config)
    return model_config(args.preset or "deepseek_v3"), {}, {}, None


def config_inputs(path: str):
    """What a YAML config says for the planner: (model config with its vocabulary, mapping
    fields, Options fields, world size or None when its dp is derived)."""
    from moeplug.config import load_config
    root = load_config(path)
    par, tr = root.parallel, root.train
    if tr.threads:  # "this CPU" is measured with the threads the run would use
        import torch
        torch.set_num_threads(tr.threads)
    world = par.tp * par.cp * par.pp * par.dp if par.dp else None
    fields = dict(tp=par.tp, cp=par.cp, pp=par.pp, ep=par.ep, etp=par.etp, vpp=par.vpp,
                  mbs=tr.micro_batch_size, seq=tr.seq_len,
                  gbs_per_dp=tr.micro_batch_size * tr.grad_accum_steps,
                  first_stage_layers=par.num_layers_in_first_stage,
                  last_stage_layers=par.num_layers_in_last_stage,
                  fsdp=int(par.fsdp), fsdp_reshard=int(par.fsdp_reshard_after_forward))
    if par.pipeline_layout is not None or par.account_for_embedding_in_pipeline_split \
            or par.account_for_loss_in_pipeline_split:  # the config's split, as a layout
        fields["layout"] = par.layer_layout(root.model.num_layers,
                                            root.model.mtp_num_layers).text()
    prec = "fp32" if root.plugins.precision == "fp32" else "bf16"
    opts = dict(precision=prec, distributed_optimizer=par.distributed_optimizer,
                dispatcher="allgather" if root.plugins.dispatcher == "allgather" else "alltoall",
                param_bytes=4 if prec == "fp32" else 2)
    # The config's memory levers, as its run would use them (flags given override them).
    rc = root.model.recompute
    opts["recompute"] = ("full",) if rc.granularity == "full" else tuple(rc.modules)
    opts["offload"] = tuple(root.model.offload)
    opts["a2a_overlap"] = par.overlap_moe_expert_parallel_comm
    if root.runtime.sync_free:
        opts["token_budget"] = float(root.runtime.token_budget)
    router = root.plugins.router_options
    if router.get("num_groups"):  # group-limited routing bounds the nodes a token reaches
        opts["route_groups"] = int(router.get("group_topk", 0))
    cfg = root.model
    if not cfg.vocab_size:  # the tokenizer's vocabulary, as build_model sizes it
        import dataclasses

        from moeplug.data import prepare_corpus
        cfg = dataclasses.replace(cfg, vocab_size=prepare_corpus(root.data).vocab_size)
    return cfg, fields, opts, world


def cmd_plan(args: argparse.Namespace) -> int:
    from moeplug.plan import report
    from moeplug.plan.cluster import get_cluster
    from moeplug.plan.memory import GB, Mapping, Options
    from moeplug.plan.split import plan_layout
    from moeplug.plan.models import route_groups
    from moeplug.plan.search import evaluate, search

    _check_flags(args)
    if args.out:  # before any calibration or search: a missing extra stops the command here
        report.require_png(args.out)
    cfg, fields, opts, world = _inputs(args)
    if not (args.gpus or world) and fields:  # the config's layout on its smallest world
        world = max(fields["tp"] * fields["cp"], fields["ep"] * fields["etp"]) * fields["pp"]
    cluster = get_cluster(args.cluster, args.gpus or world or
                          (1 if args.cluster == "cpu" else None))
    if cluster.name == "cpu" and args.config and cluster.num_gpus == 1 and not args.search:
        # One process: calibrate "this CPU" for this config (moeplug.plan.calibrate_cpu).
        # Parallel layouts need their process groups: moeplug.plan.measure calibrates those.
        import dataclasses

        from moeplug.plan.calibrate_cpu import calibrate_config
        costs = calibrate_config(args.config)
        cluster = dataclasses.replace(cluster, costs=costs,
                                      peak_tflops={"fp32": costs.peak_tflops,
                                                   "bf16": costs.peak_tflops})
    split = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    precision = args.precision or opts.pop("precision", None) or \
        ("fp32" if cluster.name == "cpu" else "bf16")
    opts.pop("precision", None)
    opts.setdefault("dispatcher", args.dispatcher)
    if cluster.name == "cpu":
        opts.setdefault("param_bytes", 4)
    opts.setdefault("route_groups", route_groups(args.preset or ""))
    for name in ("recompute", "offload"):  # a flag given replaces the config's list
        if getattr(args, name):
            opts[name] = split(getattr(args, name))
    opts["a2a_overlap"] = args.a2a_overlap or opts.get("a2a_overlap", False)
    if args.token_budget is not None:
        opts["token_budget"] = args.token_budget
    opt = Options(precision=precision, **opts)
    cluster.peak(precision)  # a precision this cluster has no peak for fails here
    seq = args.seq if args.seq is not None else fields.pop("seq", 4096)
    fields.pop("seq", None)
    world = cluster.num_gpus
    name = args.preset or args.config
    print(f"moeplug plan: {name} on {world} x {cluster.name} ({cluster.hbm_gb:.0f} GB, "
          f"{precision}), seq {seq}")
    levers = [f"recompute {','.join(opt.recompute)}" if opt.recompute else "",
              f"offload {','.join(opt.offload)}" if opt.offload else "",
              "EP overlap (combined 1F1B)" if opt.a2a_overlap else "",
              f"sync-free, token budget {opt.token_budget:g}" if opt.token_budget else ""]
    if any(levers):
        print("levers: " + "; ".join(x for x in levers if x))
    if args.mapping or not args.search:
        given = _parse_mapping(args.mapping or "")
        if given.keys() & {"pp", "vpp", "layout"}:  # a new pipeline: the config's split goes
            for k in ("layout", "first_stage_layers", "last_stage_layers"):
                fields.pop(k, None)
        fields.update(given)
        tp, cp, pp = (fields.get(k, 1) for k in ("tp", "cp", "pp"))
        dp = max(1, world // (tp * cp * pp))
        gbs = args.gbs if args.gbs is not None else fields.pop("gbs_per_dp", 8) * dp
        fields.pop("gbs_per_dp", None)
        mp = Mapping(world=world, seq=seq, gbs=gbs, **fields)
        cand = evaluate(cfg, mp, opt, cluster)
        print(f"mapping {mp.short()}  DP{mp.dp} EDP{mp.edp}  GBS {mp.gbs} "
              f"({mp.microbatches} micro-batches per DP rank)")
        layout, needs = plan_layout(cfg, mp)
        if mp.pp > 1:
            print(f"pipeline layout {layout.text()} (layers per pipeline rank "
                  f"{layout.rank_layer_counts()})")
        if needs:
            # Layers that do not split evenly: moeplug train runs them with the uneven first /
            # last stages or the layout proposed here, which its config must then set.
            print("moeplug train needs " + ", ".join(f"parallel.{k}={v}"
                                                     for k, v in needs.items()))
        print(report.memory_text(cand.memory, cluster.hbm_gb))
        print(report.step_text(cand.step))
        if cluster.costs is not None:
            print(report.calibration_text(cluster.costs))
        if not cand.fits:
            print(f"does NOT fit: {cand.memory.total / GB:.1f} GB > {cand.limit / GB:.1f} GB "
                  "(90 % of the device)")
        if args.dry_run:
            from moeplug.plan.dry_run import dry_run
            dry_run(args.preset or "deepseek_v3", args.config, cfg, mp, opt, args.rank)
    if args.search:
        gbs = args.gbs if args.gbs is not None else 8 * world
        cands = search(cfg, opt, cluster, gbs=gbs, seq=seq)
        print(f"search: GBS {gbs}, memory limit {cluster.hbm_gb * 0.9:.0f} GB per rank")
        print(report.search_table(cands))
        if args.out:
            report.search_png(cands, args.out, f"{name} on {world} x {cluster.name}, GBS {gbs}")
            print(f"plot: {args.out}")
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The flags' own rules, before any model is built, calibrated or searched."""
    for flag, value, fix in (("--gpus", args.gpus, "pass the device count, e.g. --gpus 8"),
                             ("--gbs", args.gbs, "pass the global batch in sequences, e.g. "
                              "--gbs 256, or leave it out (8 per data-parallel rank)"),
                             ("--seq", args.seq, "pass the sequence length in tokens, e.g. "
                              "--seq 4096, or leave it out (4096, or the config's)")):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be a positive integer. Fix: {fix}")
    if args.out and not args.search:
        raise ConfigError(f"--out {args.out}: the PNG plots a search. Fix: add --search")
    if args.dry_run and args.search:
        raise ConfigError("--dry-run with --search: the dry run measures one mapping. Fix: "
                          "drop --search and pass --mapping")
    if args.rank and not args.dry_run:
        raise ConfigError(f"--rank {args.rank[0]}: ranks are measured by the dry run only. "
                          "Fix: add --dry-run, or drop --rank")
    for r in args.rank or ():
        if r < 0:
            raise ConfigError(f"--rank {r}: must be a rank >= 0. Fix: pass a global rank "
                              "below --gpus, e.g. --rank 0")
