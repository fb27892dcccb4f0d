"""The symmetric shared-memory heap of one machine's ranks (C++: runtime_cpp/.../shm_heap.h).

Every rank of a torch.distributed group owns one POSIX shared-memory segment of the same size and
maps all the others', so a rank writes rows straight into a peer's memory and tells it so with a
flag - no collective, no host round trip. Set-up is collective over the group (the only time the
group is used) and leaves nothing behind, even after a crash:

    1. each rank creates its segment under a unique name       (/dev/shm/moeplug-<tag>-r<rank>-...)
    2. all_gather_object over the group: every rank's name, size and machine id
       (ranks on different machines: ValueError naming them, before anything is mapped)
    3. each rank maps every peer's segment; a second all_gather_object is the barrier
    4. every rank shm_unlinks every name: /dev/shm is empty again, the mappings live on, and the
       kernel frees the memory when the last rank holding a mapping exits - also on SIGKILL.

An op on the heap is collective in the same order on every rank, like a torch.distributed
collective; each op takes a sequence number and moves through two flags per rank:

    seq = heap.arrive(row_bytes, extra)  write own slots, store-release ARRIVE=seq, wait for all:
                                          every peer has finished reading its area from op seq-1
    ... write rows into peers' data regions (moeplug.parallel.shm_rows) ...
    heap.done(seq)                        store-release DONE=seq, wait for all: my area is full

A wait that outlasts ``timeout_s`` or whose peer process is gone raises ``PeerError`` naming that
rank, instead of hanging.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import threading
from typing import Any

import torch

ARRIVE, DONE = 0, 1  # flag indices (the C++ heap has ShmHeap::kNumFlags)
SLOT_ROW_BYTES = 0    # slot 0 of every op: the row bytes it moves (must agree on every rank)
MiB = 1 << 20


def machine_id() -> str:
    """This machine: hostname plus the kernel's boot id (two containers may share a hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def check_one_machine(machines: list[str], what: str = "the shared-memory heap") -> None:
    """ValueError naming the ranks on each machine unless all ``machines`` are the same."""
    if len(set(machines)) <= 1:
        return
    by_machine: dict[str, list[int]] = {}
    for r, m in enumerate(machines):
        by_machine.setdefault(m.split("/")[0], []).append(r)
    where = "; ".join(f"ranks {ranks} on {host}" for host, ranks in by_machine.items())
    raise ValueError(f"{what} needs every rank of its group on one machine, but {where}. Fix: "
                     f"use dispatcher alltoall (or a hierarchical dispatcher) across machines")


class SymmetricHeap:
    """One rank's handle on the heap of a group (``None``: a one-rank heap, no group).

    ``data_bytes`` per rank; ``num_slots`` int64 payload slots per rank (slot 0 is the op's row
    bytes). The heap can :meth:`grow` (collectively, with new segments); the op counter carries
    over, so callers never see the swap.
    """

    def __init__(self, group: Any, data_bytes: int, num_slots: int, timeout_s: float = 300.0,
                 tag: str = ""):
        self.group = group
        self.num_slots = int(num_slots)
        self.timeout_s = float(timeout_s)
        self.tag = tag
        self._seq = 0
        self._core = _create(group, int(data_bytes), self.num_slots, tag)

    # ---- facts -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world(self) -> int:
        return self._core.world

    @property
    def data_bytes(self) -> int:
        return self._core.data_bytes

    @property
    def name(self) -> str:
        return self._core.name

    def data_ptr(self, rank: int) -> int:
        return self._core.data_ptr(rank)

    def data(self, rank: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        """uint8 view of ``rank``'s data region [offset, offset + nbytes), valid until the next op
        on this heap writes there (copy what you keep)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.data_bytes:
            raise ValueError(f"heap.data: bytes [{offset}, {offset + nbytes}) are outside the "
                             f"{self.data_bytes}-byte data region")
        return _view(self._core.data_ptr(rank) + offset, nbytes)

    def slots(self, rank: int) -> torch.Tensor:
        """int64 view of ``rank``'s payload slots."""
        return _view(self._core.slots_ptr(rank), 8 * self.num_slots).view(torch.int64)

    # ---- an op -------------------------------------------------------------------------
    def arrive(self, row_bytes: int, extra: list[int] | torch.Tensor = ()) -> int:
        """Start the next op: write [row_bytes, *extra] into this rank's slots, publish ARRIVE and
        wait for every rank's. Returns the op's sequence number. Every rank must pass the same
        row_bytes (the receivers' areas are laid out from it): a mismatch raises on every rank."""
        extra = torch.as_tensor(extra, dtype=torch.int64).reshape(-1)
        if 1 + extra.numel() > self.num_slots:
            raise ValueError(f"heap.arrive: {1 + extra.numel()} slot values, the heap has "
                             f"{self.num_slots}")
        self._seq += 1
        own = self.slots(self.rank)
        own[0] = int(row_bytes)
        own[1:1 + extra.numel()] = extra
        self._core.publish(ARRIVE, self._seq)
        self._core.wait_all(ARRIVE, self._seq, self.timeout_s, "arrive")
        got = [int(self.slots(r)[0]) for r in range(self.world)]
        if len(set(got)) != 1:
            raise ValueError(f"shared-memory heap op #{self._seq}: the ranks move rows of "
                             f"different sizes {got} bytes; every rank must pass tensors of the "
                             f"same dtype and trailing shape")
        return self._seq

    def read_slots(self, n: int) -> torch.Tensor:
        """[world, n] copy of slots 1..n of every rank (after :meth:`arrive`)."""
        return torch.stack([self.slots(r)[1:1 + n].clone() for r in range(self.world)])

    def done(self, seq: int) -> None:
        """This rank has written everything of op ``seq``; wait until every rank has."""
        self._core.publish(DONE, seq)
        self._core.wait_all(DONE, seq, self.timeout_s, "rows written")

    def ensure(self, need_bytes: int, fixed: bool, option: str) -> None:
        """Make the data region hold ``need_bytes`` (the largest need of any rank: every rank
        passes the same value). Grows collectively by 25 % headroom, or when ``fixed`` raises
        naming ``option`` - on every rank alike, so none is left waiting."""
        if need_bytes <= self.data_bytes:
            return
        if fixed:
            raise ValueError(f"{option} = {self.data_bytes} is too small: this op needs "
                             f"{need_bytes} bytes per rank. Fix: set {option} >= "
                             f"{-(-need_bytes // MiB) * MiB} (or 0: sized from the model and "
                             f"grown on demand)")
        new_bytes = -(-(need_bytes * 5 // 4) // MiB) * MiB
        # Every rank is past arrive() of this op and reads nothing more from the old segments;
        # set-up's own barrier orders the swap, and the old mappings go with the old core.
        self._core = _create(self.group, new_bytes, self.num_slots, self.tag)
        for flag in (ARRIVE, DONE):
            self._core.publish(flag, self._seq - 1)


def _view(address: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _create(group: Any, data_bytes: int, num_slots: int, tag: str) -> Any:
    """Steps 1-4 of the module docstring; a failure on any rank raises on every rank."""
    from moeplug.runtime import get_runtime
    core = get_runtime()
    if group is None:
        world, rank = 1, 0
    else:
        import torch.distributed as dist
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    name = f"/moeplug-{tag + '-' if tag else ''}r{rank}-{os.getpid()}-{secrets.token_hex(4)}"
    heap, error = None, ""
    try:
        heap = core.ShmHeap(name, data_bytes, num_slots, rank, world)
    except (RuntimeError, ValueError) as exc:
        error = str(exc)
    if world == 1:
        if heap is None:
            raise RuntimeError(error)
        heap.attach([name])
        heap.unlink_all()
        return heap
    infos = _all_gather(group, (machine_id(), name, error))
    errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(infos) if e]
    if errors:
        raise RuntimeError("shared-memory heap set-up failed: " + "; ".join(errors))
    check_one_machine([m for m, _, _ in infos])  # the same verdict on every rank
    try:
        heap.attach([n for _, n, _ in infos])
    except (RuntimeError, ValueError) as exc:
        error = str(exc)
    # The barrier: nobody unlinks before everyone has mapped every segment.
    errors = [f"rank {r}: {e}" for r, e in enumerate(_all_gather(group, error)) if e]
    heap.unlink_all()  # every rank unlinks every name: a rank dying here leaves nothing either
    if errors:
        raise RuntimeError("shared-memory heap set-up failed: " + "; ".join(errors))
    return heap


def _all_gather(group: Any, obj: Any) -> list[Any]:
    import torch.distributed as dist
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ---- one heap per group -----------------------------------------------------------------------
# Dispatchers of every MoE layer share their group's heap (ops are collective and ordered, so
# they never overlap). The cache holds the group object itself, so its id() cannot be reused by
# a later group while the entry lives.
_heaps: dict[tuple[int, int], tuple[Any, SymmetricHeap]] = {}
_heaps_lock = threading.Lock()


def heap_for(group: Any, data_bytes: int, num_slots: int,
             timeout_s: float = 300.0) -> SymmetricHeap:
    """The heap of ``group`` (created collectively on first use; ``None``: a one-rank heap)."""
    key = (id(group), int(num_slots))
    with _heaps_lock:
        entry = _heaps.get(key)
        if entry is None:
            entry = _heaps[key] = (group, SymmetricHeap(group, data_bytes, num_slots, timeout_s))
    return entry[1]
