"""Multi-process training setup: process group, layout, this rank's model and its data slice.

Launch: ``torchrun --nproc-per-node N -m moeplug train ...`` (or ``moeplug train --nproc N``,
which re-executes itself under torchrun). torchrun sets WORLD_SIZE/RANK/LOCAL_RANK/MASTER_ADDR/
PORT; one process with every degree 1 never creates a process group and takes the unchanged
single-process path.

Device (:func:`resolve_device`): ``train.device`` auto/cuda puts rank r of a node on
``cuda:LOCAL_RANK``; CPU tensors then go over gloo and CUDA tensors over NCCL.

Equivalence contract (tests/test_parallel_train.py proves it per layout): a run with
data-parallel size DP and ``train.grad_accum_steps = A`` equals one process with
``grad_accum_steps = DP * A`` and the same seed, because

* init: every rank builds the *full* single-process model from the seed (same RNG on every
  rank), then copies its shard into its own model or pipeline chunks (TP/EP/ETP slices by
  :func:`moeplug.parallel.sharding.load_parallel_shard`, pipeline chunks keep the full
  model's names). Cost: the whole model exists once per rank during setup; gain: no broadcast
  and initial weights identical to the single-process run whatever the layout.
* data: step ``s`` draws ``DP * A`` micro-batches from the (seed, s) generator, in the order one
  process would draw them; DP rank r takes micro-batches ``r*A .. (r+1)*A - 1``. Slicing whole
  micro-batches (not rows of one big batch) keeps the per-micro-batch aux loss identical.
  TP ranks of one DP rank get the same micro-batches; CP ranks then take their
  :func:`~moeplug.parallel.context_parallel.shard_sequence` of them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeplug.config import ConfigError, RootConfig
from moeplug.config.modes import check_modes


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name} = {raw!r} is not an integer. Fix: launch with torchrun "
                          f"(it sets {name}) or unset it") from None


def world_from_env() -> int:
    """The number of processes torchrun started (1 when not launched by torchrun)."""
    return _env_int("WORLD_SIZE", 1)


def resolve_device(cfg: RootConfig, num_local: int | None = None) -> torch.device:
    """This process's device from ``train.device``: ``auto`` is cuda when torch sees a GPU, else
    cpu; ``cuda`` is ``cuda:LOCAL_RANK`` (one GPU per rank; 0 outside torchrun). ``num_local``:
    the processes on this node (default: torchrun's $LOCAL_WORLD_SIZE, else 1). Raises
    ConfigError when the GPUs asked for do not exist: the CLI calls it before any work."""
    want = cfg.train.device
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    field = f"TrainConfig.device = {want!r}"
    if not torch.cuda.is_available():
        raise ConfigError(f"{field}: torch {torch.__version__} sees no CUDA device (CUDA build: "
                          f"{torch.version.cuda or 'no'}). Fix: --set train.device=cpu, or "
                          "install torch's CUDA build for your driver (docs/runtime.md, 'GPU')")
    num_local = num_local or _env_int("LOCAL_WORLD_SIZE", 1)
    count = torch.cuda.device_count()
    if ":" in want and num_local > 1:
        raise ConfigError(f"{field}: with {num_local} processes on this node each one uses "
                          "cuda:LOCAL_RANK. Fix: set train.device to cuda or auto")
    if num_local > count:
        raise ConfigError(f"{field}: {num_local} processes on this node but torch sees {count} "
                          f"GPU(s), one per process. Fix: run at most {count} processes per "
                          "node (--nproc / torchrun --nproc-per-node), or --set train.device=cpu")
    index = int(want.partition(":")[2] or _env_int("LOCAL_RANK", 0))
    if index >= count:
        raise ConfigError(f"{field}: cuda:{index} does not exist, torch sees {count} GPU(s). "
                          f"Fix: pick one of cuda:0 .. cuda:{count - 1}")
    # What a GPU does not run yet (pipeline parallelism, the CPU-only expert modes): the modes'
    # device rules (moeplug.config.modes), here because auto resolves to a GPU only now.
    check_modes(cfg, device="cuda")
    return torch.device("cuda", index)


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` (a model or a pipeline rank's ModuleList of chunks) lives. A pipeline
    rank whose stages hold nothing (a layout's empty stages) has no tensor: the CPU, where
    its chunks were built."""
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return torch.device("cpu") if tensor is None else tensor.device


def to_device(batches: list, device: torch.device) -> list:
    """(tokens, targets[, positions]) micro-batches moved to ``device``. They are drawn on the
    CPU from the CPU generator, so every device sees the same batches for the same seed."""
    return [tuple(t.to(device, non_blocking=True) for t in batch) for batch in batches]


def is_parallel(cfg: RootConfig, world_size: int) -> bool:
    p = cfg.parallel
    return world_size > 1 or any(v > 1 for v in (p.tp, p.cp, p.pp, p.ep, p.etp, p.dp))


def resolve_layout(cfg: RootConfig, world_size: int) -> Any:
    """The resolved ParallelConfig for ``world_size`` (dp/edp filled). Raises ConfigError when
    the degrees do not tile the world: call it before any process group or rank exists."""
    return cfg.parallel.layout().resolve(world_size)


def layout_manifest(cfg: RootConfig, groups: Any) -> dict:
    """The layout a checkpoint shard depends on; resume needs exactly the same one."""
    return planned_layout_manifest(cfg, groups.config, groups.world_size)


SPLIT_FIELDS = ("pipeline_layout", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split")


def planned_layout_manifest(cfg: RootConfig, pc: Any, world_size: int) -> dict:
    """:func:`layout_manifest` from the resolved ParallelConfig (:func:`resolve_layout`), before
    any process group exists: the CLI checks a checkpoint against it before launching ranks."""
    return {"world_size": world_size, "tp": pc.tp, "cp": pc.cp, "dp": pc.dp, "pp": pc.pp,
            "ep": pc.ep, "etp": pc.etp, "edp": pc.edp, "sequence_parallel": pc.sequence_parallel,
            "order": pc.order, "vpp": cfg.parallel.vpp,
            "num_layers_in_first_stage": cfg.parallel.num_layers_in_first_stage,
            "num_layers_in_last_stage": cfg.parallel.num_layers_in_last_stage,
            "distributed_optimizer": cfg.parallel.distributed_optimizer,
            # The other split fields only when set: manifests of the splits that predate them
            # stay equal, and the same split reads only this rank's files.
            **{k: getattr(cfg.parallel, k) for k in SPLIT_FIELDS
               if getattr(cfg.parallel, k) not in (None, False)}}


def init_distributed(cfg: RootConfig) -> Any:
    """Join torchrun's process group and build every parallel group; None on the plain
    single-process path. The layout is validated before the process group is created."""
    from moeplug.parallel import ParallelGroups

    world = world_from_env()
    if not is_parallel(cfg, world):
        return None
    resolve_layout(cfg, world)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    if not dist.is_initialized():
        # CPU tensors go over gloo; on GPUs, CUDA tensors over NCCL, each rank on its own GPU.
        device = resolve_device(cfg)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)  # env:// rendezvous set by torchrun
    return ParallelGroups.build(cfg.parallel.layout(), dist.get_world_size(), dist.get_rank(),
                                timeout=timeout)


def heartbeat(groups: Any) -> Any:
    """This rank's moeplug.training.faults.Heartbeat in the rendezvous store (None: one process
    or no store)."""
    from moeplug.training.faults import Heartbeat
    if groups is None or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    return Heartbeat(store, groups.rank, groups.world_size)


def first_located(where: str, groups: Any) -> str:
    """The non-finite location to report (moeplug.training.faults.NonFiniteWatch): the lowest
    rank's ``output of`` a block (a pipeline's first stages have the lowest ranks), else this
    rank's own. A collective: call it on every rank, only on a non-finite step."""
    if groups is None:
        return where
    found: list[Any] = [None] * groups.world_size
    dist.all_gather_object(found, where)
    return next((w for w in found if w.startswith("output of")), where)


def is_main_rank(groups: Any) -> bool:
    return groups is None or groups.rank == 0


def build_rank_model(cfg: RootConfig, host: Any, vocab_size: int, groups: Any,
                     device: torch.device | str = "cpu") -> nn.Module:
    """This rank's model: the MoETransformer, or ``nn.ModuleList`` of its pipeline chunks when
    pp > 1, initialised with its shard of the single-process model (see the module docstring),
    on ``device``, sharded by FSDP with ``parallel.fsdp``. Call after seeding the RNG;
    ``groups=None`` is exactly
    ``build_model(cfg, host, vocab).to(device)``. Initialised on the CPU whatever the device, so
    the initial weights of a seed are the same on every device."""
    from moeplug.training.optim import apply_param_dtype  # bf16 weights (param/master_dtype)
    model = _build_rank_model(cfg, host, vocab_size, groups)
    if model_device(model) != torch.device(device):  # (a no-op there; a fake model can't swap)
        model = model.to(device)
    model = apply_param_dtype(model, cfg.train)
    if groups is not None and cfg.parallel.fsdp:
        # FSDP2 from outside the modules, over the layout just applied (moeplug.parallel.fsdp);
        # the recipe only decides the dtype the parameters are gathered in.
        from moeplug.parallel.fsdp import apply_fsdp
        precision = host.create("precision", cfg.plugins.precision,
                                dict(cfg.plugins.precision_options))
        apply_fsdp(model, groups, precision, cfg.parallel.fsdp_reshard_after_forward)
    return model


def _build_rank_model(cfg: RootConfig, host: Any, vocab_size: int, groups: Any) -> nn.Module:
    from moeplug.build import build_model, build_stage_modules
    from moeplug.parallel.sharding import load_parallel_shard

    if groups is None:
        return build_model(cfg, host, vocab_size)
    full_state = build_model(cfg, host, vocab_size).state_dict()
    if groups.size("pp") > 1:
        chunks = build_stage_modules(cfg, host, vocab_size, groups, cfg.parallel.pipeline())
        for chunk in chunks:  # chunk parameter names are the full model's
            load_parallel_shard(chunk, full_state, groups)
        return nn.ModuleList(chunks)
    model = build_model(cfg, host, vocab_size, groups=groups)
    load_parallel_shard(model, full_state, groups)
    return model


def pipeline_chunks(model: nn.Module) -> list | None:
    """The pipeline chunks if ``model`` is a pipeline rank's ModuleList, else None."""
    from moeplug.parallelize.pipeline import PipelineChunk
    if isinstance(model, nn.ModuleList) and all(isinstance(c, PipelineChunk) for c in model):
        return list(model)
    return None


def dp_slice(num_micro: int, groups: Any) -> range:
    """Indices (into the step's DP * A micro-batches) that this rank trains on."""
    if groups is None:
        return range(num_micro)
    r = groups.rank_in("dp")
    return range(r * num_micro, (r + 1) * num_micro)


def local_sequence(batch: tuple, groups: Any) -> tuple:
    """This CP rank's shard of a micro-batch, every tensor of it: (tokens_BS, targets_BS) and,
    with packed documents, positions_BS (identity without context parallelism)."""
    if groups is None or groups.size("cp") == 1:
        return tuple(batch)
    from moeplug.parallel.context_parallel import shard_sequence
    cp, r = groups.size("cp"), groups.rank_in("cp")
    return tuple(shard_sequence(t, cp, r) for t in batch)


def mean_over_dp(values: list[float], groups: Any) -> list[float]:
    """Average per-rank scalars over DP (every rank of a DP group computed its own batch's; TP
    and CP ranks already agree, pipeline ranks too after forward_backward_pipeline)."""
    return _mean_over(values, None if groups is None else groups.dp)


def mean_router_metrics(moe: dict, groups: Any) -> dict:
    """``moe`` (observability.moe_metrics) with each layer's dropped fraction and router losses
    averaged over the ranks of this pipeline stage (tp_dp_cp). A rank reports its own
    micro-batches (DP, EP) or its chunk of their tokens (CP, SP), and each value is a mean over
    equally many tokens (aux losses: global expert counts times this rank's mean score), so the
    ranks' mean is one process's value. Losses a layer did not report (None) stay None."""
    group = None if groups is None else groups.tp_dp_cp
    names = sorted(moe["router_losses"])
    rows = [moe["dropped_fraction"], *(moe["router_losses"][k] for k in names)]
    if group is None or not any(rows):
        return moe
    flat = _mean_over([math.nan if v is None else v for row in rows for v in row], group)
    per_layer = len(rows[0])
    rows = [[None if math.isnan(v) else v for v in flat[i:i + per_layer]]
            for i in range(0, len(flat), per_layer)]
    return {**moe, "dropped_fraction": rows[0], "router_losses": dict(zip(names, rows[1:]))}


def _mean_over(values: list[float], group: Any) -> list[float]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def global_expert_counts(counts: list[torch.Tensor], groups: Any,
                         layers: list[int] | None = None) -> list[torch.Tensor]:
    """Per MoE layer of the whole model, tokens routed to each expert over every rank: local
    counts summed over the ranks of one pipeline stage (distinct tokens), the stages' put in
    the model's layer order by ``layers`` (each local count's layer, :func:`moe_layer_order`;
    None: stages concatenated in rank order, which is layer order without VPP or a layout)."""
    if groups is None or not counts and groups.pp is None:
        return counts
    if counts and groups.tp_dp_cp is not None:
        flat = torch.stack(counts).to(torch.int64)
        dist.all_reduce(flat, group=groups.tp_dp_cp)
        counts = list(flat.unbind(0))
    if groups.pp is None:
        return counts
    per_stage: list[Any] = [None] * groups.size("pp")
    mine = [c.tolist() for c in counts]
    ordered = list(zip(layers, mine)) if layers is not None else list(enumerate(mine))
    dist.all_gather_object(per_stage, ordered, group=groups.pp)
    pairs = [pair for stage in per_stage for pair in stage]
    if layers is not None:
        pairs.sort(key=lambda pair: pair[0])
    return [torch.tensor(c, dtype=torch.int64) for _, c in pairs]


def moe_layer_order(chunks: list) -> list[int]:
    """The model's index of each MoE block of a pipeline rank's ``chunks``, in the order their
    expert counts come (chunk by chunk, its layers, then its MTP blocks, numbered after the
    layers): the order :func:`global_expert_counts` sorts the stages' counts into."""
    out = []
    for chunk in chunks:
        pattern, n = chunk.cfg.moe_layer_pattern, chunk.cfg.num_layers
        out += [i for i in chunk.layers if pattern[i]]
        if chunk.runs_mtp:  # the chunk its MTP blocks run in
            out += [n + k for k in range(len(chunk.mtp)) if pattern[-1]]
    return out


def single_process_equivalent(cfg: RootConfig, dp: int) -> RootConfig:
    """The one-process config a parallel run with data-parallel size ``dp`` equals."""
    from moeplug.config import ParallelConfig
    return dataclasses.replace(
        cfg, parallel=ParallelConfig(),
        train=dataclasses.replace(cfg.train, grad_accum_steps=cfg.train.grad_accum_steps * dp))


def barrier(groups: Any) -> None:
    """Sync point of every rank (no-op in one process)."""
    if groups is not None:
        dist.barrier()


def shutdown(groups: Any) -> None:
    """Leave the process group (every rank, also on errors, so torchrun sees clean exits)."""
    if groups is not None and dist.is_initialized():
        dist.destroy_process_group()
