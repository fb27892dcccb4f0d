"""Runtime-owned CUDA graphs (``moeplug._runtime_cuda.Graph``): capture a sync-free callable once
on a runtime stream, replay it every step with one launch.

Two forms:

    replay = capture(fn, x, w)        # fn (which may run its own backward) as one graph
    outs = replay(x2, w2)             # copies into the static inputs, one cudaGraphLaunch

    piece = GraphedPieces()           # runtime.capture on CUDA (moeplug.runtime.syncfree)
    outs = piece(owner, fn, *args)    # fn under autograd: a forward graph and a backward graph

The recordings read and write fixed addresses: the static input tensors made here, and what
the callable allocates during the capture, which comes from a private ``torch.cuda.MemPool`` kept
alive by the recording (no other allocation reuses those blocks). Every allocation on the
device goes to that pool while a capture is open, whatever thread makes it: the backward runs
on autograd's device thread, which ``torch.cuda.use_mem_pool`` (this thread only) would miss.
The callable must be sync-free (moeplug.moe.budgeted; CUDA refuses a host sync inside a
capture).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from moeplug.runtime import get_cuda_runtime


@contextlib.contextmanager
def _allocations_to(pool: Any) -> Iterator[None]:
    # Like torch.cuda.use_mem_pool, but for every thread (the filter takes every stream): the
    # autograd engine runs CUDA backward ops on its own device thread.
    device = torch.cuda.current_device()
    torch._C._cuda_beginAllocateToPool(device, pool.id)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(device, pool.id)
        torch._C._cuda_releasePool(device, pool.id)


def _launch(graph: Any, stream: Any) -> None:
    # Replay after the current stream's work (the input copies), and before what follows on it.
    current = torch.cuda.current_stream()
    stream.wait_stream(current.cuda_stream)
    graph.replay(stream.handle)
    current.wait_stream(torch.cuda.ExternalStream(stream.handle))


def _warm_up(stream: Any, run: Callable[[], Any], times: int) -> None:
    # Lazy init (cuBLAS handles, workspaces) outside the capture: ``run`` a few times on the
    # capture stream, after the current stream's work, and wait until it is done.
    torch_stream = torch.cuda.ExternalStream(stream.handle)
    stream.wait_stream(torch.cuda.current_stream().cuda_stream)
    with torch.cuda.stream(torch_stream):
        for _ in range(times):
            run()
    torch_stream.synchronize()


@contextlib.contextmanager
def _recording(graph: Any, stream: Any) -> Iterator[None]:
    graph.begin_capture(stream.handle)
    try:
        yield
    finally:
        if graph.capturing:
            graph.end_capture()


class Replay:
    """A captured callable: ``replay(*inputs)`` -> the static outputs, refreshed in place."""

    def __init__(self, graph: Any, stream: Any, inputs: Sequence[torch.Tensor], outputs: Any,
                 pool: Any):
        self.graph, self.stream, self.inputs = graph, stream, tuple(inputs)
        self.outputs, self._pool = outputs, pool  # the pool keeps the graph's blocks reserved

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"Replay: captured with {len(self.inputs)} inputs, called with "
                             f"{len(inputs)}. Fix: pass the same arguments as to capture()")
        for static, new in zip(self.inputs, inputs):
            if static.shape != new.shape or static.dtype != new.dtype:
                raise ValueError(f"Replay: input {tuple(new.shape)} {new.dtype} differs from the "
                                 f"captured {tuple(static.shape)} {static.dtype}. Fix: capture "
                                 f"again for the new shape (static shapes only)")
            static.copy_(new)
        _launch(self.graph, self.stream)
        return self.outputs


def capture(fn: Callable[..., Any], *example: torch.Tensor, warmup: int = 2) -> Replay:
    """Warm ``fn`` up on the runtime's "capture" stream, then record one call of it."""
    cuda = get_cuda_runtime()
    stream = cuda.stream("capture")
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in example]
    _warm_up(stream, lambda: fn(*inputs), warmup)
    pool = torch.cuda.MemPool()
    graph = cuda.Graph()
    with _allocations_to(pool), torch.cuda.stream(torch.cuda.ExternalStream(stream.handle)):
        with _recording(graph, stream):
            outputs = fn(*inputs)
    return Replay(graph, stream, inputs, outputs, pool)


# ---- runtime.capture on CUDA: a pure piece under autograd, as a forward and a backward graph ---

MAX_IN_FLIGHT = 8  # recordings of one piece whose backward has not run yet (pipeline depth)


def _own_saved_tensors() -> contextlib.AbstractContextManager:
    return torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, lambda t: t)


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


class _Recording:
    """``fn`` at one signature, recorded as a forward graph and a backward graph over static
    tensors. Parameters are used in place (the optimizer updates them where the graph reads
    them); every other tensor input is copied into a static twin before the forward replay.
    ``busy`` from a forward whose backward has not replayed yet: its saved tensors are live."""

    def __init__(self, fn: Callable, args: tuple, warmup: int = 2):
        cuda = get_cuda_runtime()
        self.stream = cuda.stream("capture")
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.args = list(args)
        self.inputs = [a if isinstance(a, torch.nn.Parameter)
                       else a.detach().clone().requires_grad_(a.requires_grad)
                       for a in (args[i] for i in slots)]
        for i, t in zip(slots, self.inputs):
            self.args[i] = t
        self.diff_in = [j for j, t in enumerate(self.inputs) if t.requires_grad]
        # Autocast as at the call, without its weight-cast cache: a cast cached before the
        # capture would be read from its old address at every replay instead of redone.
        amp = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))

        def run() -> tuple[torch.Tensor, ...]:
            with torch.autocast("cuda", dtype=amp[1], enabled=amp[0], cache_enabled=False):
                return fn(*self.args)

        def backward(outs: tuple, grads: Sequence[torch.Tensor]) -> tuple:
            diff = [o for o in outs if o.requires_grad]
            if not diff or not self.diff_in:
                return ()
            return torch.autograd.grad(diff, [self.inputs[j] for j in self.diff_in], grads,
                                       retain_graph=True, allow_unused=True)

        def run_both() -> None:
            outs = _as_tuple(run())
            backward(outs, [torch.ones_like(o) for o in outs if o.requires_grad])

        torch_stream = torch.cuda.ExternalStream(self.stream.handle)
        # The recording keeps its saved tensors itself: an enclosing saved-tensor hook (a
        # checkpoint dropping them, offloading) would take them out of the backward graph's
        # reach. Only the innermost hooks apply; these keep each tensor (detached, so a saved
        # output makes no reference cycle with its grad_fn).
        with _own_saved_tensors():
            _warm_up(self.stream, run_both, warmup)
        self.pool = torch.cuda.MemPool()
        self.forward_graph, self.backward_graph = cuda.Graph(), cuda.Graph()
        with _allocations_to(self.pool), _own_saved_tensors(), torch.cuda.stream(torch_stream):
            with _recording(self.forward_graph, self.stream):
                out = run()
            self.single = not isinstance(out, tuple)
            self.outputs = _as_tuple(out)
            self.grad_outputs = [torch.empty_like(o) for o in self.outputs if o.requires_grad]
            with _recording(self.backward_graph, self.stream):
                grads = backward(self.outputs, self.grad_outputs)
        self.grad_inputs: list[torch.Tensor | None] = [None] * len(self.inputs)
        for j, g in zip(self.diff_in, grads):
            self.grad_inputs[j] = g
        self.busy = False

    def forward(self, tensors: Sequence[torch.Tensor]) -> None:
        for static, new in zip(self.inputs, tensors):
            if static is not new:
                static.copy_(new)
        _launch(self.forward_graph, self.stream)

    def backward(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        for static, g in zip(self.grad_outputs, grads):
            static.copy_(g)
        _launch(self.backward_graph, self.stream)
        self.busy = False
        # A parameter's grad is handed over as the static tensor itself: AccumulateGrad sees it
        # shared and copies (or adds) it, so .grad never aliases what the next replay rewrites.
        # Other inputs' grads are cloned: a view of them could still be stolen into a .grad.
        return [g if g is None or isinstance(t, torch.nn.Parameter) else g.clone()
                for t, g in zip(self.inputs, self.grad_inputs)]


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rec: _Recording, *tensors: torch.Tensor):
        rec.forward(tensors)
        ctx.rec = rec
        outs = tuple(o.detach() for o in rec.outputs)
        ctx.mark_non_differentiable(*(d for d, o in zip(outs, rec.outputs)
                                      if not o.requires_grad))
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        rec: _Recording = ctx.rec
        diff = [g for g, o in zip(grads, rec.outputs) if o.requires_grad]
        return (None, *rec.backward(diff))


def _signature(args: tuple) -> tuple:
    key: list = [torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.dtype, a.device, a.requires_grad,
                        a.data_ptr() if isinstance(a, torch.nn.Parameter) else None))
        else:
            key.append(a)
    return tuple(key)


class GraphedPieces:
    """``runtime.capture`` on CUDA: each (owner, piece, signature) recorded once, replayed every
    step under autograd. The owner (an MoE layer) keeps its own recordings, whose saved tensors
    are static: a layer's next forward before its backward (pipeline micro-batches in flight,
    the recompute of a checkpointed forward) takes another recording, up to MAX_IN_FLIGHT.
    Without grad (evaluation), and in a checkpoint's recompute, the piece runs eagerly."""

    def __init__(self) -> None:
        self._recordings: dict[tuple, list[_Recording]] = {}

    @property
    def recordings(self) -> int:
        return sum(len(r) for r in self._recordings.values())

    @property
    def replays(self) -> int:
        return sum(r.forward_graph.replays for rs in self._recordings.values() for r in rs)

    def __call__(self, owner: Any, fn: Callable, *args: Any) -> Any:
        # Eager without grad (nothing would consume a recording) and inside a backward: that
        # is a checkpoint's recompute, whose outputs only refill saved tensors; the forward's
        # own recording still holds what the backward replays.
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return fn(*args)
        recs = self._recordings.setdefault((id(owner), fn, _signature(args)), [])
        rec = next((r for r in recs if not r.busy), None)
        if rec is None:
            if len(recs) >= MAX_IN_FLIGHT:
                raise RuntimeError(
                    f"runtime.capture: {len(recs)} forwards of {fn.__name__} on one layer are "
                    f"waiting for their backward; each holds a CUDA graph's memory. Fix: run "
                    f"backward after each forward (or fewer pipeline micro-batches in flight), "
                    f"or set runtime.capture: false")
            rec = _Recording(fn, args)
            recs.append(rec)
        outs = _Replayed.apply(rec, *(a for a in args if isinstance(a, torch.Tensor)))
        rec.busy = any(o.requires_grad for o in outs)
        return outs[0] if rec.single else outs
