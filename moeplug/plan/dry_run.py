"""``moeplug plan --dry-run``: one rank of a large job built and stepped on this CPU, measured.

For rank R of a W-rank job (W up to 1,024) this joins torch's ``fake`` process group at world
W (collectives return at once and move no data), builds the rank's real model and optimizer
through moeplug train's own build (``moeplug.training.distributed.build_rank_model``, which
builds the whole model and copies the rank's shard, and ``trainer.build_rank_optimizer``) on
the **meta device** (shapes, dtypes, no storage: nothing the size of the model is allocated),
and runs one real ``train_step`` (every micro-batch's forward and backward through the
pipeline schedule, gradient reduce-scatter, clip, optimizer step, all-gather) under
:class:`moeplug.plan.fake_step.DryStepMode`. Meta rather than FakeTensorMode: a fake CUDA
tensor on a CPU-only torch fails in torch's own Python bindings (indexing, ``to``), and a fake
module cannot be moved (``Module.to`` swaps payloads, which a fake parameter refuses).

Path: a meta tensor is not a CPU tensor, so every op takes moeplug's GPU path: torch ops with
torch's meta kernels (grouped GEMM; attention as the fused kernel, moeplug.plan.dry_attention);
the CUDA extension's SwiGLU and permute / unpermute row kernels through their fake kernels
(torch.library ops with ``register_fake``, moeplug.ops.cuda_ops), so they save what they save on
a GPU; the norms are moeplug's own (torch ops, as on a GPU). Host-side bookkeeping (row counts,
the chunk sort's index) runs on real CPU tensors or on the shadows of meta ones, the C++
runtime included: the chunk sort (``moeplug_plugins::move_row_chunks``) is a torch.library op
too, whose fake kernel gives the meta tensor while the shadows get the kernel's values. The
report names the path.

Routing: fake collectives move no data, so every MoE layer's expert ids are replaced by the
balanced oracle's (:func:`balanced_ids`): token t's k-th choice is expert ``(t*K + k) mod E``,
so every expert gets T*K/E rows from every rank; the router itself still runs (its logits,
scores and losses are computed and kept as in training). The row counts, splits and the count
all-to-all's result come from the oracle's values (DryStepMode's shadows).

What it measures, per rank: parameter, gradient (at their peak: the fp32 sums of bf16 grads
included) and optimizer-state bytes (distinct storages); the peak of everything else alive
during the forward and backward (activations, temporaries, the dispatcher's and pipeline's
buffers: every storage the step's ops create, counted while it lives); the bytes this rank
hands to each kind of collective. What it cannot: NCCL's own buffers, CUDA-graph pools, the
caching allocator's rounding and fragmentation, timing; FP8 recipes and the combined-1F1B
helper thread are not traced (moeplug.plan.dry_check plans those rows without them).

Offloading (model.offload, ``--offload``) runs the GPU tier's logic on meta tensors
(moeplug.modules.offload): a named tensor's storage is let go in forward and made again at its
prefetch in backward, so the peak is the device's; the bytes moved to host memory are reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from moeplug.config import ConfigError

# moeplug plan's options -> the run's config (the same levers, as moeplug train's fields).
_PRECISION_PLUGIN = {"bf16": "bf16", "fp8": "bf16", "fp32": "fp32"}


@dataclass
class RankMeasure:
    """What one dry-run rank measured (bytes)."""
    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations_peak: int     # the step's peak of everything but weights, grads and state
    grads_peak: int           # gradients at their peak (fp32 sums of bf16 grads included)
    comm: dict = field(default_factory=dict)
    comm_calls: dict = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss: int = 0
    path: str = ""
    precision_note: str = ""
    offloaded: int = 0        # bytes model.offload moved to host memory in the step


def run_config(name: str | None, config: str | None, mp: Any, opt: Any,
               vocab_size: int = 0) -> Any:
    """The RootConfig moeplug train would run ``mp`` (a plan Mapping) and ``opt`` (plan Options)
    with: the model of a preset, a planner model or a YAML config; the mapping's degrees and
    pipeline split; its micro-batch, sequence and micro-batches per step; bf16 weights with
    fp32 master weights and Adam state (the planner's convention) and the distributed
    optimizer; the recompute modules."""
    from moeplug.config import load_config
    from moeplug.plan.models import PLAN_MODELS
    from moeplug.plan.split import _given, plan_layout
    from moeplug.config.presets import PRESETS, preset
    import copy
    if config:
        base, path = None, config
    elif name in PLAN_MODELS:
        base, path = copy.deepcopy(PLAN_MODELS[name]), None
    elif name in PRESETS:
        base, path = preset(name), None
    else:
        from moeplug.plan.models import model_names
        raise ConfigError(f"--preset {name!r}: unknown model. Fix: use one of "
                          f"{', '.join(model_names())}")
    root0 = load_config(path, [], base=base)
    _, needs = plan_layout(root0.model, mp)
    split = _given(mp) or needs
    sets = [f"parallel.{k}={v}" for k, v in dict(
        tp=mp.tp, cp=mp.cp, pp=mp.pp, ep=mp.ep, etp=mp.etp, vpp=mp.vpp, dp=mp.dp,
        sequence_parallel=mp.tp > 1,
        distributed_optimizer=opt.distributed_optimizer).items()]
    sets += [f"parallel.{k}={v}" for k, v in split.items()]
    sets += [f"train.micro_batch_size={mp.mbs}", f"train.seq_len={mp.seq}",
             f"train.grad_accum_steps={mp.microbatches}",
             f"plugins.precision={_PRECISION_PLUGIN[opt.precision]}"]
    if opt.precision != "fp32":
        sets += ["train.param_dtype=bf16", "train.master_dtype=fp32"]
    if vocab_size and not root0.model.vocab_size:  # a config sized by its tokenizer
        sets.append(f"model.vocab_size={vocab_size}")
    if root0.model.max_seq_len < mp.seq:
        sets.append(f"model.max_seq_len={mp.seq}")
    if opt.offload:
        sets.append(f"model.offload=[{','.join(opt.offload)}]")
    if opt.full_recompute:
        sets.append("model.recompute.granularity=full")
    elif opt.recompute:
        sets += ["model.recompute.granularity=selective",
                 f"model.recompute.modules=[{','.join(opt.recompute)}]"]
    return load_config(path, sets, base=base)


def balanced_ids(T: int, K: int, E: int) -> torch.Tensor:
    """The oracle's expert ids [T, K]: choice (t, k) -> expert (t*K + k) mod E. A token's K ids
    are K consecutive experts (distinct when K <= E); every expert gets T*K/E of them when E
    divides T*K (else the counts differ by one)."""
    return (torch.arange(T * K, dtype=torch.int64, device="cpu") % E).view(T, K)


def _oracle_router(layer: Any, mode: Any) -> None:
    """``layer`` routes with the balanced oracle's ids (its router still runs)."""
    from moeplug.moe.layer import MoELayer
    original = MoELayer.router_and_preprocess

    def router_and_preprocess(self, x_TD, num_sequences):
        routing = original(self, x_TD, num_sequences)
        T, K = routing.ids_TK.shape
        with torch.utils._python_dispatch._disable_current_modes():
            real = balanced_ids(T, K, self.router.num_experts)
        ids = torch.empty((T, K), dtype=torch.int64, device=routing.ids_TK.device)
        return dataclasses.replace(routing, ids_TK=mode.shadow(ids, real))
    layer.router_and_preprocess = types.MethodType(router_and_preprocess, layer)


def _meta_autocast(precision: Any) -> Any:
    """The recipe with autocast off on the meta device (torch has no meta autocast): the
    dry run's weights are already in the compute dtype (bf16 parameters), so the GEMMs and
    the tensors they save have the dtype autocast would give them."""
    autocast = precision.autocast

    def meta_autocast(device_type: str):
        return contextlib.nullcontext() if device_type == "meta" else autocast(device_type)
    precision.autocast = meta_autocast
    return precision


def _moe_layers(model: Any) -> list:
    from moeplug.moe.layer import MoELayer
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _optimizer_tensors(optimizer: Any) -> list:
    """Every tensor the optimizer holds that the model does not: its state and master copies
    (torch's AdamW state dict, or a moeplug optimizer's own attributes, walked)."""
    out, seen = [], set()

    def walk(x, depth=0):
        if depth > 6 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)):
            for v in vars(x).values():
                walk(v, depth + 1)
    walk(optimizer)
    return out


def measure_rank(cfg: Any, rank: int, world: int) -> RankMeasure:
    """Build and step rank ``rank`` of ``cfg``'s job at ``world`` ranks (see the module)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moeplug.parallel import ParallelGroups
    from moeplug.ops import discard
    from moeplug.plan.dry_attention import FusedAttentionMode
    from moeplug.plan.fake_step import DryStepMode
    from moeplug.plugin_host import check_plugins, load_host
    from moeplug.training import distributed as D
    from moeplug.training.trainer import build_rank_optimizer, stash_runtime, train_step

    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        host = load_host(cfg)
        with torch.device("meta"):  # its one instance of each component: never allocated
            precision = _meta_autocast(check_plugins(host, cfg))
        mode = DryStepMode()
        tc = cfg.train
        with mode, FusedAttentionMode(), _grad_marks(mode), discard.observing(mode.discarded):
            torch.manual_seed(tc.seed)
            with torch.device("meta"):  # every parameter and buffer, never allocated
                model = D.build_rank_model(cfg, host, cfg.model.vocab_size, groups,
                                           device="meta")
            for layer in _moe_layers(model):
                _oracle_router(layer, mode)
            optimizer = build_rank_optimizer(model, cfg, groups)
            _watch(model, optimizer, mode)
            params = list(model.parameters())
            param_bytes = mode.category_bytes(params)
            # Micro-batches of this DP rank: token ids (any in-vocabulary values will do), the
            # targets the next tokens of one window, as multi-token prediction checks; the
            # zeros are shadowed (small integer tensors carry host values), so it can.
            shape = (tc.micro_batch_size, tc.seq_len + 1)
            windows = [torch.zeros(shape, dtype=torch.int64, device="meta")
                       for _ in range(tc.grad_accum_steps)]
            batches = [(w[:, :-1], w[:, 1:]) for w in windows]
            mode.rebase()
            mode.category = "step"
            train_step(model, optimizer, batches, tc, precision, groups)
            mode.category = "after"
            grads = [p.grad for p in params if p.grad is not None]
            grads += _main_grads(optimizer, params)
            grad_bytes = mode.category_bytes(grads)
            held = {id(t.untyped_storage()) for t in params + grads}
            state = [t for t in _optimizer_tensors(optimizer)
                     if id(t.untyped_storage()) not in held]
            opt_bytes = mode.category_bytes(state)
            offloader = getattr(stash_runtime(model), "offloader", None)  # None: no offload
            offloaded = 0 if offloader is None else offloader.bytes_offloaded
        if mode.peak_live:
            from collections import Counter
            agg = Counter()
            for b, c in mode.peak_live:
                agg[c] += b
            for c, b in agg.most_common(25):
                print(f"  peak: {b / 2**30:8.3f} GiB  {c}")
        stage = groups.rank_in("pp") if groups.pp is not None else 0
        return RankMeasure(
            rank=rank, stage=stage, params=param_bytes, grads=grad_bytes, optimizer=opt_bytes,
            activations_peak=mode.peak["step"], grads_peak=mode.peak["grad"],
            comm=dict(mode.comm),
            comm_calls=dict(mode.comm_calls), seconds=time.perf_counter() - t0,
            offloaded=offloaded,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            path="the GPU path on meta tensors: torch ops and torch's meta kernels (grouped GEMM, "
                 "memory-efficient attention); SwiGLU and permute as the CUDA extension's kernels "
                 "through their fake kernels; the C++ runtime's kernels ran only on the host's "
                 "real row counts")
    finally:
        dist.destroy_process_group()


def _main_grads(optimizer: Any, params: list) -> list:
    """Gradient copies an optimizer keeps apart from ``.grad`` (none today: DistributedAdamW
    reduce-scatters into temporaries of its step)."""
    return []


@contextlib.contextmanager
def _grad_marks(mode: Any, model: Any = None):
    """Gradients count as ``grad``, not as the step's activations: each ``.grad`` once autograd
    has accumulated it, the fp32 sums of bf16 grads (Fp32GradAccumulation) once made. The
    optimizer's work (reduce-scatter, clip, step, all-gather) counts as ``optim``."""
    from moeplug.training.grad_accumulation import Fp32GradAccumulation
    add, move = Fp32GradAccumulation.add, Fp32GradAccumulation.move
    autocast = torch.autocast

    def meta_autocast(device_type: str, *args, **kwargs):
        # torch has no autocast on meta; the ops' own "autocast off" regions are no-ops there.
        if device_type == "meta":
            return contextlib.nullcontext()
        return autocast(device_type, *args, **kwargs)
    torch.autocast = meta_autocast
    from moeplug.parallel import p2p
    recv = p2p.recv

    def meta_recv(shape, dtype, src, group, tag):
        # moeplug's pipeline receives into host buffers (it runs on the CPU only so far); on
        # the meta device the buffer is where the activations are, as on a GPU it would be.
        buf = torch.empty(shape, dtype=dtype, device="meta")
        torch.distributed.recv(buf, src=src, group=group, tag=tag)
        return buf
    p2p.recv = meta_recv
    enabled = torch.is_autocast_enabled

    def meta_enabled(*args):
        return False if args and args[0] == "meta" else enabled(*args)
    torch.is_autocast_enabled = meta_enabled

    def marked_move(self, p):  # the sums, made in the backward's hooks or after it
        category, mode.category = mode.category, "grad"  # born a gradient, never an activation
        try:
            move(self, p)
        finally:
            mode.category = category

    def marked_add(self, last):  # the grads written back from the sums
        add(self, last)
        mode.mark([p.grad for p in self.params], "grad")
    Fp32GradAccumulation.add, Fp32GradAccumulation.move = marked_add, marked_move
    try:
        yield
    finally:
        Fp32GradAccumulation.add, Fp32GradAccumulation.move = add, move
        torch.autocast = autocast
        p2p.recv = recv
        torch.is_autocast_enabled = enabled


def _watch(model: Any, optimizer: Any, mode: Any) -> None:
    """The hooks :func:`_grad_marks` describes, on this model and optimizer."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: mode.mark([q.grad], "grad"))
    for name in ("reduce_gradients", "clip_grad_norm", "step"):
        method = getattr(optimizer, name, None)
        if method is None:
            continue

        def in_optim(*a, _m=method, **k):
            mode.category = "optim"
            return _m(*a, **k)
        setattr(optimizer, name, in_optim)


def stage_ranks(cfg: Any, world: int) -> list[int]:
    """One global rank of every pipeline stage: the pipeline group of rank 0."""
    from moeplug.parallel.groups import layout_rank_groups
    tables = layout_rank_groups(cfg.parallel.layout().resolve(world))
    return sorted(next(g for g in tables["pp"] if 0 in g))


def dry_run(name: str, config: str | None, model_cfg: Any, mp: Any, opt: Any,
            ranks: list[int] | None) -> list[RankMeasure]:
    """Measure ``ranks`` (default :func:`stage_ranks`) of ``mp`` and print each beside the
    plan (moeplug.plan.dry_report)."""
    from moeplug.plan import dry_report
    cfg = run_config(name, config, mp, opt, vocab_size=model_cfg.vocab_size)
    for r in ranks or ():
        if r >= mp.world:
            raise ConfigError(f"--rank {r}: the job has ranks 0 .. {mp.world - 1}. Fix: pass "
                              f"a rank below --gpus {mp.world}")
    ranks = ranks or stage_ranks(cfg, mp.world)
    print(f"dry run: {len(ranks)} rank(s) of {mp.world} under torch's fake process group, on "
          "the meta device; routing from the balanced oracle")
    measures = []
    for r in ranks:
        m = measure_rank(cfg, r, mp.world)
        measures.append(m)
        print(dry_report.rank_text(m))
    print(f"path: {measures[0].path}")
    print(dry_report.comparison_text(dry_report.comparison_rows(model_cfg, mp, opt, measures)))
    return measures
