"""Point-to-point messages between pipeline stages: tagged, statically shaped, sends never block.

Why tags and asynchronous sends (instead of Megatron's paired ``send_forward_recv_backward``):
a rank posts every send with ``isend`` and moves on, and blocks only in ``recv`` for the one
tensor its next compute step needs, matched by a tag unique to (direction, sending virtual stage,
micro-batch). A rank therefore waits only on real data dependencies, so any schedule whose
compute order is consistent with those dependencies cannot deadlock, and the order in which
messages of different kinds cross the same pair of ranks (at PP = 2, activations of the
wrap-around chunk and gradients share the rank 1 -> rank 0 link) does not matter.

Shapes are known statically (micro-batch x sequence x hidden), so no shape is ever exchanged.
Ranks are *global* ranks (``torch.distributed`` p2p takes global ranks even with a subgroup).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moeplug.observability.timing import stage

FORWARD, BACKWARD = 0, 1  # message directions: activations downstream, gradients upstream


def message_tag(direction: int, sender_stage: int, microbatch: int, num_virtual_stages: int,
                num_microbatches: int) -> int:
    """A tag unique within one pipeline step to (direction, sending virtual stage, micro-batch).

    The receiver computes the same tag from what it expects (the previous/next virtual stage), so
    a recv can only ever match the message it is waiting for."""
    if direction not in (FORWARD, BACKWARD):
        raise ValueError(f"direction = {direction!r}: must be p2p.FORWARD (0) or p2p.BACKWARD "
                         "(1). Fix: pass one of the module constants")
    if not 0 <= sender_stage < num_virtual_stages or not 0 <= microbatch < num_microbatches:
        raise ValueError(f"sender_stage = {sender_stage}, microbatch = {microbatch}: must lie in "
                         f"[0, {num_virtual_stages}) and [0, {num_microbatches}). Fix: pass the "
                         "virtual stage and micro-batch indices of this step")
    return (direction * num_virtual_stages + sender_stage) * num_microbatches + microbatch


def send_async(x: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
    """Post a send of ``x`` to global rank ``dst``; return the work handle (``wait()`` it before
    the step ends). ``x`` is detached and made contiguous: p2p carries values, not autograd."""
    return dist.isend(x.detach().contiguous(), dst=dst, group=group, tag=tag)


def recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, group: Any, tag: int) -> torch.Tensor:
    """Block until the message tagged ``tag`` from global rank ``src`` arrives; return it."""
    buf = torch.empty(shape, dtype=dtype)
    with stage("comm_wait"):
        dist.recv(buf, src=src, group=group, tag=tag)
    return buf


def wait_all(works: list[Any]) -> None:
    """Wait for every posted send, so buffers are free and no message outlives the step."""
    with stage("comm_wait"):
        for w in works:
            w.wait()
    works.clear()
