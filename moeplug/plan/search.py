"""Enumerate the mappings a cluster allows, keep those that fit in memory, rank by TFLOP/s.

Validity is moeplug's own layout rules (ParallelConfig.resolve + validate_model through
memory.check_model: the world tiles, TP with EP needs sequence parallelism, heads/experts/
sequence split evenly) plus the batch: the global batch must split into whole micro-batches
per DP rank. TP stays inside the NVLink domain (as every published mapping does).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeplug.config import ConfigError, ModelConfig
from moeplug.plan.cluster import Cluster
from moeplug.plan.memory import (GB, Mapping, MemoryBreakdown, Options, calibrated_cpu_memory,
                                  check_model, peak_memory)
from moeplug.plan.perf import StepTime, step_time

# Headroom kept free of the planned bytes: the allocator's fragmentation, CUDA context and
# workspaces (cuBLAS, NCCL) are not in the model.
MEMORY_HEADROOM = 0.9


@dataclass
class Candidate:
    mapping: Mapping
    memory: MemoryBreakdown
    step: StepTime

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.limit

    limit: float = 0.0


def _divisors(n: int, cap: int | None = None) -> list[int]:
    return [d for d in range(1, (cap or n) + 1) if n % d == 0]


def evaluate(cfg: ModelConfig, mp: Mapping, opt: Options, c: Cluster) -> Candidate:
    check_model(cfg, mp)
    # A CPU calibrated for one run (cluster.costs) has its units' measured bytes.
    memory = (peak_memory(cfg, mp, opt) if c.costs is None
              else calibrated_cpu_memory(cfg, mp, opt, c.costs))
    return Candidate(mapping=mp, memory=memory, step=step_time(cfg, mp, opt, c),
                     limit=c.hbm_gb * GB * MEMORY_HEADROOM)


def search(cfg: ModelConfig, opt: Options, c: Cluster, *, gbs: int, seq: int,
           mbs_choices=(1, 2), vpp_choices=(1, 2, 4), fsdp_choices=(0, 1)) -> list[Candidate]:
    """Every valid mapping, best predicted TFLOP/s first (fitting ones before the others).
    FSDP (``fsdp=1``: parameters, gradients and AdamW state sharded over DP, in place of
    ZeRO-1) is tried beside each mapping where moeplug train accepts it (check_fsdp); not with
    the combined 1F1B (``opt.a2a_overlap``) or bf16 AdamW moments, which train refuses beside
    FSDP (moeplug.config.modes.fsdp)."""
    world, out = c.num_gpus, []
    fsdps = (0,) if opt.a2a_overlap or opt.bf16_moments else fsdp_choices
    for tp in _divisors(world, min(c.gpus_per_node, c.nvlink_domain, 8)):
        for pp in _divisors(world // tp, min(16, cfg.num_layers)):
            for ep in _divisors(world // pp):
                for vpp in (vpp_choices if pp > 1 else (1,)):
                    for mbs in mbs_choices:
                        dp = world // (tp * pp)
                        if gbs % (dp * mbs):
                            continue
                        for fsdp in fsdps:
                            try:
                                mp = Mapping(world=world, tp=tp, pp=pp, ep=ep, vpp=vpp,
                                             mbs=mbs, gbs=gbs, seq=seq, fsdp=fsdp)
                                out.append(evaluate(cfg, mp, opt, c))
                            except ConfigError:
                                continue
    out.sort(key=lambda k: (not k.fits, -k.step.tflops_per_gpu))
    return out
