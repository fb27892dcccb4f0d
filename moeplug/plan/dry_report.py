"""``moeplug plan --dry-run``'s output: each measured rank beside what the planner predicts for
it, and the ratio (dry run / planner), flagged outside +-10 %."""

from __future__ import annotations

import resource
from typing import Any

GIB = 2 ** 30
TOLERANCE = 0.10


def planner_rank(cfg: Any, mp: Any, opt: Any, stage: int) -> dict:
    """The planner's bytes for one rank of pipeline stage ``stage``: weights, gradients,
    optimizer state, activations (saved tensors + the dispatcher's buffers) and the bytes it
    sends in all-to-alls per step (moeplug.plan.perf.a2a_step_bytes)."""
    from moeplug.plan.memory import stage_memory
    from moeplug.plan.perf import a2a_step_bytes
    from moeplug.plan.split import rank_parts
    parts = rank_parts(cfg, mp)
    mem = stage_memory(cfg, mp, opt, stage, parts)
    per_param = opt.param_bytes + opt.grad_bytes
    return {"weights": mem.weights_grads * opt.param_bytes / per_param,
            "grads": mem.weights_grads * opt.grad_bytes / per_param + mem.grad_landing,
            "optimizer": mem.optimizer,
            "activations": mem.activations_total + mem.comm_buffers,
            "all-to-all": a2a_step_bytes(cfg, mp, opt, stage, parts)}


def measured_rank(m: Any) -> dict:
    return {"weights": m.params, "grads": m.grads_peak, "optimizer": m.optimizer,
            "activations": m.activations_peak, "all-to-all": m.comm.get("all-to-all", 0)}


def rank_text(m: Any) -> str:
    comm = ", ".join(f"{k} {v / GIB:.3f} GiB ({m.comm_calls.get(k, 0)} calls)"
                     for k, v in sorted(m.comm.items()))
    return (f"rank {m.rank} (pipeline stage {m.stage}): {m.seconds:.1f} s, "
            f"peak RSS {m.peak_rss / GIB:.2f} GiB\n"
            f"  weights {m.params / GIB:.2f} GiB  grads {m.grads / GIB:.2f} GiB at the end, "
            f"{m.grads_peak / GIB:.2f} at their peak  optimizer state {m.optimizer / GIB:.2f} GiB"
            f"  activations peak {m.activations_peak / GIB:.2f} GiB\n"
            f"  sent per step: {comm or 'nothing'}"
            + (f"\n  offloaded to host memory: {m.offloaded / GIB:.2f} GiB" if m.offloaded else ""))


def comparison_rows(cfg: Any, mp: Any, opt: Any, measures: list) -> list[tuple]:
    """(rank, stage, part, dry-run bytes, planner bytes, ratio) for every measured rank."""
    rows = []
    for m in measures:
        plan, got = planner_rank(cfg, mp, opt, m.stage), measured_rank(m)
        for part in plan:
            p, g = plan[part], got[part]
            ratio = g / p if p else (1.0 if not g else float("inf"))
            rows.append((m.rank, m.stage, part, g, p, ratio))
    return rows


def comparison_text(rows: list[tuple]) -> str:
    out = [f"{'rank':>5} {'stage':>5} {'part':<12} {'dry run GiB':>12} {'planner GiB':>12} "
           f"{'ratio':>7}"]
    for rank, stage, part, got, plan, ratio in rows:
        flag = "" if abs(ratio - 1) <= TOLERANCE else "  <-- outside +-10 %"
        out.append(f"{rank:>5} {stage:>5} {part:<12} {got / GIB:>12.3f} {plan / GIB:>12.3f} "
                   f"{ratio:>7.3f}{flag}")
    return "\n".join(out)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
