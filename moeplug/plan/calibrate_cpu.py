"""Calibrate "this CPU" for one run: what each piece of its step costs here, now.

GPU entries carry datasheet peaks and efficiencies fitted once to published rows; a CPU step is
made of different things (eager PyTorch on one thread per rank, gloo over loopback), so its
entry is measured, at the run's own shapes, inside the process and with the process groups that
then train, so the measurement and the run see the same load from the rest of the machine:

  units        the pieces a rank runs per micro-batch, each built alone at this rank's local
               shapes (heads and dense FFN / TP, experts / EP, the MoE block on tokens / TP,
               vocabulary / TP) with the run's recompute: ``attn`` (norm + attention),
               ``mlp`` (norm + dense SwiGLU), ``moe`` (norm + router, permute, experts,
               unpermute) and ``head`` (embedding + final norm + head + loss). One forward +
               backward of each runs under a dispatch trace; every aten op it issued is then
               replayed alone on copies of its actual arguments and timed:
                   gemm         mm / addmm / bmm (GEMM efficiency at the actual shapes)
                   attention    the SDPA kernels, forward and backward
                   elementwise  every other aten op (norms, RoPE, activations, softmax, ...)
               moeplug's C++ kernels (permute, unpermute, SwiGLU), called by pointer and so
               invisible to the trace, are timed in that same run (``kernels``). With process
               groups the seconds come from the same units on the rank's own parallel modules
               (``_rank_unit_fns``: the wrappers' work on top of the local shapes is timed with
               them), the bytes from the local ones.
  host         what no kernel shows: Python, module calls, autograd bookkeeping. Measured as a
               unit's forward + backward wall time at a tiny batch (its kernels cost ~nothing
               there) minus the same replay + kernel timing at that tiny batch.
  collectives  the run's own process groups: latency and bandwidth of each collective kind
               (all-to-all, all-gather, reduce-scatter, all-reduce) from two message sizes;
               which calls a step makes (and their bytes) comes from a dispatch trace of one
               real micro-batch + the gradient sync on this rank's model.
  grad sync    with process groups: the ops of the gradient sync and the global norm on a
               real step's grads, replayed (its collectives are in ``collectives``).
  optimizer    seconds per parameter of one step of the run's optimizer class.

Nothing here looks at the run's own step time: the plan composes these costs (per layer kind,
layers per stage, micro-batches, collectives, optimizer) and is compared against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm"}
COLLECTIVE_SIZES_ORDER = ("all_gather", "all_reduce", "all_to_all", "reduce_scatter")
KERNELS = ("permute", "unpermute", "unpermute_backward", "swiglu_forward", "swiglu_backward",
           "move_row_chunks")
COLLECTIVE_KIND = {"alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
                   "allgather_": "all_gather", "_allgather_base_": "all_gather",
                   "allgather_into_tensor_coalesced_": "all_gather",
                   "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
                   "reduce_scatter_tensor_coalesced_": "reduce_scatter",
                   "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
                   "broadcast_": "all_reduce"}


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _kind(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name:
        return "attention"
    return "elementwise"


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(y) for y in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple:
    def sig(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(sig(y) for y in x)
        return repr(x)
    return (str(func), sig(args), sig(tuple(sorted(kwargs.items()))))


class _OpTrace(TorchDispatchMode):
    """Records each distinct aten call (with copies of its arguments) and how often it ran;
    collectives are recorded by kind and bytes instead (they are costed from the links)."""

    def __init__(self, keep_args: bool = True) -> None:
        super().__init__()
        self.ops: dict[tuple, list] = {}   # signature -> [func, args, kwargs, count]
        self.collectives: list[tuple[str, int]] = []
        self.keep_args = keep_args
        # Bytes of the storages ops allocated that are still referenced (views and in-place
        # results share their input's storage and are not new), and the most ever live.
        self.live: dict[int, list] = {}
        self.current = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.current -= entry[0]

    def _track(self, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = {t.untyped_storage().data_ptr()
                  for t in _tensors((args, tuple(kwargs.values())))}
        for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0 or (ptr in inputs and ptr not in self.live):
                continue
            if ptr not in self.live:
                self.live[ptr] = [st.nbytes(), 0]
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":
            kind = COLLECTIVE_KIND.get(name)
            if kind is not None:
                self.collectives.append((kind, _collective_bytes(kind, args)))
        elif self.keep_args and func is not aten.as_strided.default:
            # (as_strided is a view: nothing to time. And it may address its input's storage
            # past the input's own elements - the grouped ops view a buffer's spare rows
            # (moeplug.ops._grouped.with_spare_rows) - which a copy of the input lacks.)
            key = _signature(func, args, kwargs)
            if key in self.ops:
                self.ops[key][3] += 1
            else:
                self.ops[key] = [func, _clone(args), _clone(kwargs), 1]
        out = func(*args, **kwargs)
        self._track(args, kwargs, out)
        return out


class _TimedCore:
    """The C++ runtime with its kernels timed (a stand-in for moeplug.runtime._core)."""

    def __init__(self, core: Any) -> None:
        self._core, self.seconds = core, 0.0
        self.calls: dict[str, int] = {}  # kernel name -> calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if name not in KERNELS:
            return attr

        def timed(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            t0 = _clock()
            try:
                return attr(*a, **k)
            finally:
                self.seconds += _clock() - t0
        return timed


@contextlib.contextmanager
def _timed_kernels():
    from moeplug import runtime
    real = runtime.get_runtime()
    timed = _TimedCore(real)
    runtime._core = timed
    try:
        yield timed
    finally:
        runtime._core = real


_FLUSH = None
# Process CPU time, not wall time: on a machine shared with other jobs a wall clock measures
# their load; the CPU seconds an op or a step costs this process do not depend on it (the
# measured run is timed the same way, moeplug.plan.measure).
_clock = time.process_time


def _flush_l2() -> None:
    # In a step an op's inputs were written many ops ago: they come from the last-level cache
    # (or memory), not from L2 as in a back-to-back replay. Writing 8 MB (> this L2) first.
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(2 << 20)
    _FLUSH.fill_(1.0)


def _best_time(fn: Callable[[], Any], repeats: int = 3, cold: bool = False) -> float:
    fn()  # warm-up: packing buffers, thread pool, first-touch pages
    samples = []
    for _ in range(repeats):
        if cold:
            _flush_l2()
        t0 = _clock()
        fn()
        samples.append(_clock() - t0)
    # The least-disturbed repeat: other jobs on this machine (a busy SMT sibling, evicted
    # caches) only ever add time; the measured run is compared at its best step likewise.
    return min(samples)


def replay(trace: _OpTrace, cold: bool = True) -> dict[str, float]:
    """Seconds per kind (gemm / attention / elementwise) of every traced op, each replayed on
    copies of its own arguments (best of three, times how often it ran)."""
    out = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0}
    with torch.no_grad():
        for func, args, kwargs, count in trace.ops.values():
            name = func.overloadpacket.__name__
            t = _best_time(lambda: func(*args, **kwargs), cold=cold)
            out[_kind(name)] += count * t
    return out


@dataclasses.dataclass
class UnitCost:
    """Seconds of one forward + backward of one unit on one micro-batch, by part."""
    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    kernels: float = 0.0
    host: float = 0.0
    gemm_flops: float = 0.0
    saved_bytes: int = 0   # held for backward at the end of the forward (autograd + checkpoints)
    peak_bytes: int = 0    # most bytes the unit's ops held at once over forward + backward
    saved_plain_bytes: int = 0  # saved_bytes without the run's full-block checkpointing
    # The ops' workspace cache (moeplug.runtime.workspace): its footprint after the unit's forward +
    # backward from empty (kept, free, once the backward is done), and the part of saved_bytes
    # that lives in it.
    pool_bytes: int = 0
    saved_pool_bytes: int = 0

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.kernels + self.host


def _gemm_flops(trace: _OpTrace) -> float:
    total = 0.0
    for func, args, _, count in trace.ops.values():
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm"):
            a, b = args[0], args[1]
        elif name in ("addmm", "baddbmm"):
            a, b = args[1], args[2]
        else:
            continue
        total += count * 2 * a.numel() * b.shape[-1]
    return total


def _run_traced(fn: Callable[[], Any], keep_args: bool = True) -> tuple[_OpTrace, float]:
    trace = _OpTrace(keep_args)
    with _timed_kernels() as core, trace:
        fn()
    return trace, core.seconds


def _peak_bytes(fn: Callable[[], Any]) -> int:
    """Most bytes ``fn``'s ops held at once. The ops' workspace cache is bypassed here: warm,
    it hands out buffers no op of the trace allocates, and they would not be counted (the MoE
    unit's [S, .] rows, ~2/3 of its peak). The run's cache holds no more than the bytes its
    buffers hold live at once (moeplug.runtime.workspace), which is what this counts."""
    from moeplug.runtime import workspace
    with workspace.bypassed():
        trace, _ = _run_traced(fn, keep_args=False)
    return trace.peak


def _pool_bytes(fn: Callable[[], Any]) -> tuple[int, int]:
    """(footprint of the ops' workspace cache after one ``fn`` from empty, bytes of the saved
    tensors that live in it). The cache is emptied after, as it was found."""
    from moeplug.runtime import workspace
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() in {b.data_ptr() for b in workspace.cached_buffers()}:
            saved[st.data_ptr()] = st.nbytes()
        return t
    workspace.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    footprint = workspace.cached_bytes()
    workspace.clear()
    return footprint, sum(saved.values())


def _saved_bytes(fn: Callable[[], Any], params: Any) -> int:
    """Bytes autograd holds for backward at the end of ``fn``'s forward (what stays between a
    layer's forward and its backward): the meter's high-water mark."""
    from moeplug.training.memory import ActivationMeter
    meter = ActivationMeter(params)
    with meter.active():
        fn()
    return meter.peak


def measure_unit(make_fn: Callable[[int], Callable[[], Any]], tokens_scale: int,
                 tiny_scale: int = 1, params: Any = None,
                 timed_make: Callable[[int], Callable[[], Any]] | None = None) -> UnitCost:
    """Cost of ``make_fn(scale)()`` (one forward + backward) at ``tokens_scale``; ``host`` from
    the same at ``tiny_scale``. ``timed_make``: where the seconds come from instead (the same
    unit on the rank's own parallel modules, see :func:`_rank_unit_fns`); bytes always come
    from ``make_fn``. Collective calls made under ``timed_make`` are not replayed (they are
    costed from the links); all ranks must then call this together, in the same order."""
    timed = timed_make or make_fn
    fn = timed(tokens_scale)
    fn()  # warm-up outside the trace
    trace, kernels = _run_traced(fn)
    parts = replay(trace)
    flops = _gemm_flops(trace)
    del trace
    tiny = timed(tiny_scale)
    wall = _best_time(tiny, repeats=5)
    tiny_trace, tiny_kernels = _run_traced(tiny)
    tiny_parts = replay(tiny_trace, cold=False)  # a tiny unit's ops stay in cache anyway
    host = max(0.0, wall - sum(tiny_parts.values()) - tiny_kernels)
    if timed is not make_fn:
        fn = make_fn(tokens_scale)
        fn()  # warm-up, as above
    peak = _peak_bytes(fn)
    pool, saved_pool = _pool_bytes(fn)
    saved = _saved_bytes(fn, params)
    # What the unit saves when not checkpointed: under full recompute the backward rebuilds a
    # whole block at once, so a block's attention tensors live while its MLP runs backward.
    plain = _saved_bytes(make_fn(tokens_scale, plain=True), params)
    return UnitCost(gemm=parts["gemm"], attention=parts["attention"],
                    elementwise=parts["elementwise"], kernels=kernels, host=host,
                    gemm_flops=flops, saved_bytes=saved, peak_bytes=peak,
                    saved_plain_bytes=plain, pool_bytes=pool, saved_pool_bytes=saved_pool)


# ---------------------------------------------------------------- collectives

def measure_link(kind: str, group: Any, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """(latency seconds, bytes per second) of one ``kind`` collective over ``group``: the time
    of a 64-byte call, and the slope up to ``nbytes`` (the run's typical message)."""
    n = dist.get_world_size(group)

    def call(size: int) -> Callable[[], None]:
        elems = max(n, size // 4 // n * n)
        x = torch.ones(elems)
        if kind == "all_to_all":
            y = torch.empty_like(x)
            return lambda: dist.all_to_all_single(y, x, group=group)
        if kind == "all_gather":
            y = torch.empty(elems * n)
            return lambda: dist.all_gather_into_tensor(y, x, group=group)
        if kind == "reduce_scatter":
            y = torch.empty(elems // n)
            return lambda: dist.reduce_scatter_tensor(y, x, group=group)
        return lambda: dist.all_reduce(x, group=group)

    small = _best_time(call(64), repeats)
    big_bytes = max(nbytes, 1 << 16)
    big = _best_time(call(big_bytes), repeats)
    return small, big_bytes / max(big - small, 1e-9)


def trace_collectives(fn: Callable[[], Any]) -> list[tuple[str, int]]:
    """Run ``fn`` and return (kind, bytes entering the collective on this rank) of every
    collective it made, in order (a dispatch trace: every process-group call is seen)."""
    trace = _OpTrace(keep_args=False)
    with trace:
        fn()
    return trace.collectives


def _collective_bytes(kind: str, args: tuple) -> int:
    # The message is the input: a2a / gather / scatter take it second, all-reduce first.
    src = args[1] if kind in ("all_to_all", "all_gather", "reduce_scatter") else args[0]
    return sum(t.numel() * t.element_size() for t in _tensors(src))


# ---------------------------------------------------------------- the run

@dataclasses.dataclass
class CpuCosts:
    """This CPU, calibrated for one run (see the module docstring). Seconds are per micro-batch
    for ``units``, per call for ``links`` (latency, bytes/s), per step for ``collectives``."""
    units: dict                 # "attn" / "mlp" / "moe" / "head" -> UnitCost
    links: dict                 # collective kind -> (latency s, bytes per s)
    collectives: list           # (kind, bytes) of one optimizer step on this rank
    optimizer_s_per_param: float
    peak_tflops: float          # the best GEMM rate measured (bounded_peak): MFU's reference
    grad_sync: float = 0.0      # per step: ops of the gradient sync and global norm (ranks > 1)
    matmul_tflops: float = 0.0  # the 512^2 fp32 matmul alone (_peak_tflops)

    def mean(self, other: "CpuCosts") -> "CpuCosts":
        """The average of two calibrations (one before and one after a run brackets the load
        the run saw)."""
        def avg(a, b):
            return (a + b) / 2
        units = {n: UnitCost(**{f.name: avg(getattr(u, f.name), getattr(other.units[n], f.name))
                                for f in dataclasses.fields(UnitCost)})
                 for n, u in self.units.items()}
        links = {k: (avg(v[0], other.links[k][0]), avg(v[1], other.links[k][1]))
                 for k, v in self.links.items()}
        matmul = avg(self.matmul_tflops, other.matmul_tflops)
        return CpuCosts(units=units, links=links, collectives=self.collectives,
                        optimizer_s_per_param=avg(self.optimizer_s_per_param,
                                                  other.optimizer_s_per_param),
                        peak_tflops=bounded_peak(max(matmul, avg(self.peak_tflops,
                                                                 other.peak_tflops)), units),
                        grad_sync=avg(self.grad_sync, other.grad_sync), matmul_tflops=matmul)

    def gemm_efficiency(self, unit: str) -> float:
        u = self.units[unit]
        return u.gemm_flops / max(u.gemm, 1e-12) / (self.peak_tflops * 1e12)

    def collective_seconds(self) -> float:
        return sum(self.links[k][0] + b / self.links[k][1] for k, b in self.collectives)


def _local_root(root: Any, tp: int, ep: int) -> Any:
    """The run's config with this rank's shard shapes, for one process."""
    m = root.model
    moe = dataclasses.replace(m.moe, num_experts=m.moe.num_experts // ep)
    model = dataclasses.replace(
        m, kv_channels=m.head_dim, num_heads=m.num_heads // tp,
        num_kv_heads=max(1, m.num_kv_heads // tp),
        dense_ffn_hidden_size=m.dense_ffn_hidden_size // tp, moe=moe)
    return dataclasses.replace(root, model=model,
                               parallel=dataclasses.replace(root.parallel, tp=1, ep=1, cp=1,
                                                            pp=1, dp=0))


def _block_unit(fwd: Callable, hidden: int, tokens_div: int, full: bool,
                precision: Any) -> Callable:
    """make_fn((batch, seq), plain=False) -> one forward + backward of ``fwd`` (x -> (y, extra))
    on [batch, seq // tokens_div, hidden]; checkpointed under full recompute unless ``plain``."""
    from torch.utils.checkpoint import checkpoint

    def make(shape, plain: bool = False):
        b, s = shape
        x = torch.randn(b, max(1, s // tokens_div), hidden, requires_grad=True)
        g = torch.randn_like(x)

        def run():
            with precision.autocast("cpu"):
                y, extra = (checkpoint(fwd, x, use_reentrant=False) if full and not plain
                            else fwd(x))
            # backward(g), not sum(y * g): a loss op would save g, which no layer keeps
            if isinstance(extra, torch.Tensor):
                torch.autograd.backward([y, extra], [g, torch.ones_like(extra)])
            else:
                y.backward(g)
        return run
    return make


def _head_unit(model: Any, vocab: int, precision: Any) -> Callable:
    """make_fn((batch, seq), plain=False) -> embedding, head and loss forward + backward (never
    checkpointed)."""
    def make(shape, plain: bool = False):
        b, s = shape
        tokens = torch.randint(0, vocab, (b, s))
        targets = torch.randint(0, vocab, (b, s))

        def run():
            with precision.autocast("cpu"):
                out = model.head_and_loss(model.embed_tokens(tokens), tokens, targets)
            out.lm_loss.backward()
        return run
    return make


def _unit_fns(model: Any, root: Any, precision: Any, tp: int) -> dict:
    """unit name -> make_fn((batch, seq)) -> one forward + backward of that unit."""
    full = root.model.recompute.granularity == "full"
    h = root.model.hidden_size
    blocks = list(model.blocks)
    moe_i = next((i for i, b in enumerate(blocks) if root.model.moe_layer_pattern[i]), None)
    dense_i = next((i for i, b in enumerate(blocks) if not root.model.moe_layer_pattern[i]),
                   None)

    def attn(x):
        blk = blocks[0]
        return x + blk.attn(blk.attn_norm(x)), 0.0

    def ffn(i):
        blk = blocks[i]

        def f(x):
            out = blk.ffn(blk.ffn_norm(x))
            if isinstance(out, tuple):
                return x + out[0], out[1].float()
            return x + out, 0.0
        return f

    units = {"attn": _block_unit(attn, h, 1, full, precision),
             "head": _head_unit(model, model.output_weight().shape[0], precision)}
    if dense_i is not None:
        units["mlp"] = _block_unit(ffn(dense_i), h, 1, full, precision)
    if moe_i is not None:
        units["moe"] = _block_unit(ffn(moe_i), h, tp, full, precision)
    return units


def _rank_unit_fns(model: Any, root: Any, precision: Any, vocab: int, groups: Any) -> dict:
    """The units of :func:`_unit_fns` on this rank's own model (built with the run's process
    groups), as TransformerBlock.forward runs them: what the parallel wrappers add to the
    ep=1 / tp=1 shapes is then in the unit's ops and host time -- the EP dispatcher's count
    exchange, split bookkeeping and re-sort of received rows (and their backward), TP's region
    entries and exits, the MoE layer's token scatter / gather over TP, the vocabulary-parallel
    loss. Their collectives are costed from the links, not here. Timed, never sized: the
    units' bytes still come from :func:`_unit_fns` (at ep=1 / tp=1 no buffer is held twice).
    Under sequence parallelism the blocks take this rank's sequence chunk."""
    full = root.model.recompute.granularity == "full"
    h = root.model.hidden_size
    blocks = list(model.blocks)
    pattern = root.model.moe_layer_pattern
    moe_i = next((i for i in range(len(blocks)) if pattern[i]), None)
    dense_i = next((i for i in range(len(blocks)) if not pattern[i]), None)
    chunk = (groups.size("tp") if root.parallel.sequence_parallel else 1) * groups.size("cp")

    def attn(x):
        blk = blocks[0]
        return x + blk.attn(blk.attn_norm(x)), 0.0

    def mlp(x):
        blk = blocks[dense_i]
        return x + blk.ffn(blk.ffn_norm(x)), 0.0

    def moe(x):
        blk = blocks[moe_i]
        out = blk.ffn(blk.wiring.moe_tokens_in(blk.ffn_norm(x)))
        return x + blk.wiring.moe_tokens_out(out[0]), out[1].float()

    units = {"attn": _block_unit(attn, h, chunk, full, precision),
             "head": _head_unit(model, vocab, precision)}
    if dense_i is not None:
        units["mlp"] = _block_unit(mlp, h, chunk, full, precision)
    if moe_i is not None:
        units["moe"] = _block_unit(moe, h, chunk, full, precision)
    return units


def _optimizer_s_per_param(model: Any, root: Any) -> float:
    from moeplug.training.optim import build_optimizer
    params = [p for p in model.parameters()]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt = build_optimizer(model, root.train)
    t = _best_time(opt.step)
    return t / sum(p.numel() for p in params)


def _step_collectives(root: Any, model: Any, vocab: int, groups: Any,
                      precision: Any) -> tuple[list, float]:
    """(kind, bytes) of every collective one real optimizer step of this rank makes, from a
    traced step of ``model``, a throw-away copy of the run's model (same layout, same
    micro-batches); and the seconds of the ops around the gradient sync (see
    :func:`_grad_sync_seconds`)."""
    from moeplug.training.trainer import build_rank_optimizer, train_step
    tc = root.train
    opt = build_rank_optimizer(model, root, groups)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, vocab, (tc.micro_batch_size, tc.seq_len), generator=gen),
                torch.randint(0, vocab, (tc.micro_batch_size, tc.seq_len), generator=gen))
               for _ in range(tc.grad_accum_steps)]
    trace = _OpTrace(keep_args=False)
    with trace:
        train_step(model, opt, batches, tc, precision, groups)
    return trace.collectives, _grad_sync_seconds(model, opt, tc, groups)


def _grad_sync_seconds(model: Any, opt: Any, tc: Any, groups: Any) -> float:
    """Seconds of the ops a parallel step runs between the backward and the optimizer: the
    gradient sync's flatten / scale / copy-back and the global norm over the shards
    (moeplug.parallel.grad_sync, or ZeRO-1's reduce-scatter into slices), on ``model``'s grads
    of a real step. One pass under the trace (every rank calls it, its collectives are costed
    from the links), then each op replayed as in :func:`replay`."""
    if hasattr(opt, "reduce_gradients"):
        def fn():
            opt.reduce_gradients()
            opt.clip_grad_norm(tc.grad_clip)
    else:
        from moeplug.parallel.grad_sync import clip_grad_norm, sync_gradients

        def fn():
            sync_gradients(model, groups)
            clip_grad_norm(model, groups, tc.grad_clip)
    trace, kernels = _run_traced(fn)
    return sum(replay(trace).values()) + kernels


def _peak_tflops(n: int = 512) -> float:
    """The 512^2 fp32 matmul (moeplug.training.flops' reference GEMM) per CPU second: the
    better of the run's threads and one thread. Every op here is timed in process CPU time, in
    which a multi-threaded GEMM also pays its threads' synchronisation and spinning (and, on a
    shared machine, a sibling's wait for a descheduled one); a GEMM small enough for one
    thread pays none of it, so the run's threads alone under-read what a CPU second does."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def rate() -> float:
        return 2 * n ** 3 / _best_time(lambda: torch.mm(a, b), repeats=5) / 1e12
    best, threads = rate(), torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        try:
            best = max(best, rate())
        finally:
            torch.set_num_threads(threads)
    return best


def bounded_peak(matmul_tflops: float, units: dict) -> float:
    """This CPU's peak: the best GEMM rate measured, the reference matmul's or any unit's
    (its GEMM FLOPs over its GEMMs' seconds). A peak below a rate the run's own GEMMs reach
    made the plan's MFU exceed 100 % (2026-12: a tiny model at 118 %, its units' GEMMs at
    1.4-1.7x the 512^2 matmul on two threads): the model FLOPs are Megatron's count, never
    more than the GEMMs that run (tests/test_plan.py), so the peak was what read low."""
    rates = [u.gemm_flops / u.gemm / 1e12 for u in units.values() if u.gemm > 0]
    return max([matmul_tflops, *rates])


def calibrate_run(root: Any, host: Any, vocab: int, groups: Any = None,
                  precision: Any = None) -> CpuCosts:
    """Measure this CPU for ``root`` (a RootConfig) on this rank; call on every rank of the run
    at once when ``groups`` is given (the collectives are measured over them)."""
    from moeplug.build import build_model
    if root.parallel.pp > 1:
        from moeplug.config import ConfigError
        raise ConfigError("plan --cluster cpu: pipeline layouts are not calibrated (the units "
                          "are; the schedule's sends are not traced). Fix: use pp: 1")
    if precision is None:
        from moeplug.plugin_host import check_plugins, load_host as _load_host
        precision = check_plugins(host or _load_host(root), root)
    tp = groups.size("tp") if groups is not None else 1
    ep = groups.size("ep") if groups is not None else 1
    local = _local_root(root, tp, ep)
    vocab_local = -(-vocab // tp)
    model = build_model(local, host, vocab_local)
    tc = root.train
    timed: dict = {}
    rank_model = None
    if groups is not None:
        from moeplug.training import distributed as D
        rank_model = D.build_rank_model(root, host, vocab, groups, "cpu")
        timed = _rank_unit_fns(rank_model, root, precision, vocab, groups)
    units = {name: measure_unit(make, (tc.micro_batch_size, tc.seq_len), (1, 16), model,
                                timed_make=timed.get(name))
             for name, make in _unit_fns(model, local, precision, tp).items()}
    opt_s = _optimizer_s_per_param(model, local)
    del model
    collectives, links, grad_sync = [], {}, 0.0
    if groups is not None:
        collectives, grad_sync = _step_collectives(root, rank_model, vocab, groups, precision)
        del rank_model
        sizes: dict[str, int] = {}
        for kind, nbytes in collectives:
            sizes[kind] = max(sizes.get(kind, 0), nbytes)
        for kind in sorted(COLLECTIVE_SIZES_ORDER):  # the same calls, sizes, order on all ranks
            size = torch.tensor([sizes.get(kind, 0)], dtype=torch.int64)
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
            if int(size):
                links[kind] = measure_link(kind, None, int(size))
    matmul = _peak_tflops()
    return CpuCosts(units=units, links=links, collectives=collectives,
                    optimizer_s_per_param=opt_s, peak_tflops=bounded_peak(matmul, units),
                    grad_sync=grad_sync, matmul_tflops=matmul)


def calibrate_config(path: str) -> CpuCosts:
    """One process's calibration for the YAML config at ``path`` (``moeplug plan --config
    PATH --cluster cpu``), with the threads the run would use."""
    from moeplug.plugin_host import check_plugins, load_host as _load_host
    from moeplug.config import load_config
    from moeplug.data import prepare_corpus
    root = load_config(path)
    if root.train.threads:
        torch.set_num_threads(root.train.threads)
    host = _load_host(root)
    precision = check_plugins(host, root)
    return calibrate_run(root, host, prepare_corpus(root.data).vocab_size, None, precision)
