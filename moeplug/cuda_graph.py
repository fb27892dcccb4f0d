"""Runtime-owned CUDA graphs (``moeplug._runtime_cuda.Graph``): capture a sync-free callable once
on a runtime stream, replay it every step with one launch.

    replay = capture(fn, x, w)      # runs fn once to warm up, then records it
    outs = replay(x2, w2)           # copies into the static inputs, one cudaGraphLaunch

The recording reads and writes fixed addresses: the static input tensors made here, and what
``fn`` allocates during the capture, which comes from a private ``torch.cuda.MemPool`` kept
alive by the Replay (no other allocation reuses those blocks). ``fn`` must be sync-free
(moeplug.modules.static_moe; CUDA refuses a host sync inside a capture) and may run
forward *and* backward (``torch.autograd.grad`` inside ``fn``).

Status: compiled on every CI run; the tests that run it (tests/test_sync_free_cuda.py, marked
``cuda``) have not run on a GPU yet. The MoE layer's ``runtime.capture`` uses moeplug.syncfree
(torch.compile) on every device until they have.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from moeplug.runtime import get_cuda_runtime


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
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current.cuda_stream)  # after the input copies
        self.graph.replay(self.stream.handle)
        current.wait_stream(torch.cuda.ExternalStream(self.stream.handle))
        return self.outputs


def capture(fn: Callable[..., Any], *example: torch.Tensor, warmup: int = 2) -> Replay:
    """Warm ``fn`` up on the runtime's "capture" stream, then record one call of it."""
    cuda = get_cuda_runtime()
    stream = cuda.stream("capture")
    torch_stream = torch.cuda.ExternalStream(stream.handle)
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in example]
    stream.wait_stream(torch.cuda.current_stream().cuda_stream)
    with torch.cuda.stream(torch_stream):
        for _ in range(warmup):  # lazy init (cuBLAS handles, workspaces) outside the capture
            fn(*inputs)
    torch_stream.synchronize()
    pool = torch.cuda.MemPool()
    graph = cuda.Graph()
    with torch.cuda.use_mem_pool(pool), torch.cuda.stream(torch_stream):
        graph.begin_capture(stream.handle)
        try:
            outputs = fn(*inputs)
        finally:
            if graph.capturing:
                graph.end_capture()
    return Replay(graph, stream, inputs, outputs, pool)
