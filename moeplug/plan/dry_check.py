"""The planner against the dry run on the published rows: ``python -m moeplug.plan.dry_check``.

For every P26 row and Parallel Folding's Mixtral-8x22B row (moeplug.plan.models), one rank
(default rank 0: the first pipeline stage, which holds the most in-flight micro-batches) is
dry-run (moeplug.plan.dry_run) and printed beside ``moeplug plan``'s bytes for it. What both
sides then plan, so that they compare the same run:

* ``--microbatches`` per DP rank (default 8) instead of the row's global batch: the in-flight
  activations stop growing at Megatron's warm-up depth, and the step's time grows with it;
* BF16 GEMMs for the FP8 rows (the FP8 recipes' quantized tensors are not traced on meta);
* the alltoall dispatcher (moeplug's; the token-based flex dispatcher's dedup is a bandwidth
  saving the all-to-all bytes do not count), no combined-1F1B overlap (its helper thread's
  twin groups: not traced); the row's activation offloading as published (traced).

    python -m moeplug.plan.dry_check                 # every row, rank 0
    python -m moeplug.plan.dry_check --row 2 --rank 0 --rank 224
    python -m moeplug.plan.dry_check --stages        # every row, a rank of every stage
    python -m moeplug.plan.dry_check --row 1 --offload attn_norm,expert_fc1   # other offload
"""

from __future__ import annotations

import argparse
import dataclasses


def rows() -> list:
    from moeplug.plan.models import P26_ROWS, PF_ROWS
    return [*P26_ROWS, PF_ROWS[0]]


def row_plan(row, microbatches: int):
    """(Mapping, Options) of ``row`` as the check runs it (see the module)."""
    from moeplug.plan.memory import Mapping, Options
    from moeplug.plan.models import model_config
    from moeplug.plan.split import split_config
    dp = row.gpus // (row.tp * row.cp * row.pp)
    mp = Mapping(world=row.gpus, tp=row.tp, cp=row.cp, pp=row.pp, ep=row.ep, vpp=row.vpp,
                 mbs=row.mbs, gbs=dp * row.mbs * microbatches, seq=row.seq)
    if row.split:  # the published split, as the layout string both sides then run
        model = model_config(row.model)
        text = split_config(mp, **row.split).layer_layout(model.num_layers,
                                                          model.mtp_num_layers).text()
        mp = dataclasses.replace(mp, layout=text)
    opt = Options(precision="bf16", recompute=tuple(row.recompute), offload=tuple(row.offload),
                  dispatcher="alltoall")
    return mp, opt


def check_row(row, ranks: list[int] | None, microbatches: int,
              stages: bool = False, offload: tuple | None = None) -> list[tuple]:
    from moeplug.plan import dry_report
    from moeplug.plan.dry_run import measure_rank, run_config, stage_ranks
    from moeplug.plan.models import model_config
    if offload is not None:  # --offload: these names instead of the published ones
        row = dataclasses.replace(row, offload=offload)
    mp, opt = row_plan(row, microbatches)
    cfg = run_config(row.model, None, mp, opt)
    model = model_config(row.model)
    ranks = stage_ranks(cfg, mp.world) if stages else (ranks or [0])
    measures = [measure_rank(cfg, r, mp.world) for r in ranks]
    for m in measures:
        print(dry_report.rank_text(m))
    return dry_report.comparison_rows(model, mp, opt, measures)


def main(argv: list[str] | None = None) -> int:
    from moeplug.config import ConfigError
    from moeplug.plan import dry_report
    p = argparse.ArgumentParser(prog="python -m moeplug.plan.dry_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", type=int, action="append", help="row index (repeatable; "
                   "default every row)")
    p.add_argument("--rank", type=int, action="append", help="global rank (default 0)")
    p.add_argument("--stages", action="store_true", help="a rank of every pipeline stage "
                   "(as moeplug plan --dry-run measures by default)")
    p.add_argument("--microbatches", type=int, default=8, help="per DP rank (default 8)")
    p.add_argument("--offload", default=None, metavar="M,..", help="offload these modules "
                   "instead of the row's published ones ('' for none)")
    args = p.parse_args(argv)
    table = rows()
    for i in args.row or range(len(table)):
        row = table[i]
        print(f"== row {i}: {row.source} {row.label}")
        try:
            offload = None if args.offload is None else \
                tuple(n for n in args.offload.split(",") if n)
            table_rows = check_row(row, args.rank, args.microbatches, args.stages, offload)
        except ConfigError as e:  # a layout moeplug train refuses: said, the others still run
            print(f"not run: {e}", flush=True)
            continue
        print(dry_report.comparison_text(table_rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
