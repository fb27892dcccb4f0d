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

    seq = heap.arrive(row_bytes, extra)  write own slots (and the largest free run of own data
                                          region), store-release ARRIVE=seq, wait for all
    area, addr_W = heap.receive_area(seq, nbytes_W)
                                          no wait: every rank takes nbytes_W[rank] from the start
                                          of the free run it published, so every rank knows where
                                          each rank's rows go (addr_W) without another exchange
    ... write rows into peers' areas (moeplug.parallel.shm_rows) ...
    heap.done(seq)                        store-release DONE=seq, wait for all: my area is full
                                          (= heap.publish_done(seq), later heap.wait_done(seq))

Two ops in flight (the split of ``done``, for overlap): a rank may publish DONE=seq, return, and
start op seq+1 (or more) before it waits for op seq's DONE from every rank; op seq's rows are
then read only after wait_done(seq). This is safe because
  * flags only grow and waits are ``>= seq``: a peer already at op seq+2 still reads as done
    with seq, and a rank writes all its rows of an op before publishing DONE, its ops in order;
  * the slots come in two banks, op seq's in bank seq % 2: a rank writes op seq+1's slots while
    a slower peer may still read its op seq slots (other bank), and it reaches op seq+2 (the
    same bank again) only past arrive(seq+1), i.e. once every peer is done with op seq's start;
  * each op's receive area is taken at that op's arrive and held by the tensors over it (the
    pending op keeps them), so a later op in flight never lands on it.

A receive area is a torch uint8 tensor over this rank's segment: the rows arrive where the caller
uses them (x_SD is a view of the heap, no copy out). Its bytes go back to the rank's free list
when the last tensor over them dies - autograd keeping x_SD for backward keeps the area too - so
no later op writes there while anything can still read it. Each rank allocates only in its own
segment (a free list, _Arena: each area from the start of the largest free run), so nothing
but the offsets crosses ranks.

A wait that outlasts ``timeout_s`` or whose peer process is gone raises ``PeerError`` naming that
rank, instead of hanging.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import secrets
import socket
import threading
import weakref
from typing import Any

import torch

from moeplug.runtime import workspace

ARRIVE, DONE = 0, 1  # flag indices (the C++ heap has ShmHeap::kNumFlags)
# The heap's own slots, after the caller's: this rank's largest free run and its held bytes.
FREE_AT, FREE_BYTES, HELD, NUM_HEAP_SLOTS = 0, 1, 2, 3
SLOT_ROW_BYTES = 0    # slot 0 of every op: the row bytes it moves (must agree on every rank)
MiB = 1 << 20
PAGE = 4096  # receive areas start on a page: tensors over them are page-aligned


def _rounded(nbytes: int) -> int:
    """Area sizes on a ladder (pages, then 64 steps per power of two; <= 1/32 waste): a tensor
    over an area needs a ctypes array type of its length, and a ladder keeps those few."""
    step = max(PAGE, 1 << max(0, nbytes.bit_length() - 6))
    return -(-nbytes // step) * step


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

    ``data_bytes`` per rank; ``num_slots`` int64 payload slots per rank for the caller (slot 0 is
    the op's row bytes), plus the heap's own (where this rank's next receive area goes). The
    heap grows (collectively, with new segments) when a rank's area does not fit; the op counter
    carries over, so callers never see the swap, and areas still alive keep their old segment
    mapped. ``pids``: every rank's process; ``single_copy``: every rank may read every peer's
    private memory (process_vm_readv, probed at set-up), the same verdict on every rank.
    """

    def __init__(self, group: Any, data_bytes: int, num_slots: int, timeout_s: float = 300.0,
                 tag: str = ""):
        self.group = group
        self.num_slots = int(num_slots)
        self.timeout_s = float(timeout_s)
        self.tag = tag
        self._seq = 0
        self._core, self.pids, self.single_copy = _create(
            group, int(data_bytes), 2 * (self.num_slots + NUM_HEAP_SLOTS), tag)
        self._arena = _Arena(self._core, self._core.data_bytes)
        self._held = _Held()

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

    @property
    def held_bytes(self) -> int:
        """Bytes of receive areas still alive on this rank (old segments' included)."""
        return self._held.bytes

    def data_ptr(self, rank: int) -> int:
        return self._core.data_ptr(rank)

    def data(self, rank: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        """uint8 view of ``rank``'s data region [offset, offset + nbytes), outside any receive
        area's lifetime (tests and tools; ops use :meth:`receive_area`)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.data_bytes:
            raise ValueError(f"heap.data: bytes [{offset}, {offset + nbytes}) are outside the "
                             f"{self.data_bytes}-byte data region")
        return _view(self._core.data_ptr(rank) + offset, nbytes)

    def slots(self, rank: int, seq: int | None = None) -> torch.Tensor:
        """int64 view of ``rank``'s payload slots of op ``seq`` (default: the latest arrived):
        the caller's num_slots, then the heap's, in bank seq % 2 (see the module docstring)."""
        n = self.num_slots + NUM_HEAP_SLOTS
        bank = (self._seq if seq is None else seq) % 2
        return _view(self._core.slots_ptr(rank) + 8 * n * bank, 8 * n).view(torch.int64)

    # ---- an op -------------------------------------------------------------------------
    def arrive(self, row_bytes: int, extra: list[int] | torch.Tensor = ()) -> int:
        """Start the next op: write [row_bytes, *extra] into this rank's slots, publish ARRIVE and
        wait for every rank's. Returns the op's sequence number. Every rank must pass the same
        row_bytes (the receivers' areas are laid out from it): a mismatch raises on every rank."""
        # Written through numpy views of the slots: a tensor element assignment wraps each
        # Python int in a fresh tensor (ops run inside the MoE layer, which allocates nothing).
        values = extra.reshape(-1).numpy() if isinstance(extra, torch.Tensor) else list(extra)
        if 1 + len(values) > self.num_slots:
            raise ValueError(f"heap.arrive: {1 + len(values)} slot values, the heap has "
                             f"{self.num_slots}")
        self._seq += 1
        own = self.slots(self.rank).numpy()
        own[0] = int(row_bytes)
        own[1:1 + len(values)] = values
        # Where this op's receive area will start: published now, taken in receive_area. Only
        # this rank allocates in its region and frees only widen the run, so it stays valid.
        at, size = self._arena.largest()
        own[self.num_slots + FREE_AT] = at
        own[self.num_slots + FREE_BYTES] = size
        own[self.num_slots + HELD] = self._held.bytes
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
        return torch.stack([self.slots(r)[1:1 + n] for r in range(self.world)],
                           out=workspace.empty((self.world, n), torch.int64))

    def receive_area(self, seq: int, nbytes_W: list[int], fixed: bool, option: str
                     ) -> tuple[torch.Tensor, list[int]]:
        """Step 2 of op ``seq`` (after arrive; every rank passes the same ``nbytes_W``): take
        ``nbytes_W[rank]`` bytes of this rank's data region, at the start of the free run it
        published at arrive, and compute every rank's the same way - no wait. Returns (this
        rank's area: a uint8 tensor whose bytes stay this rank's until the last tensor over them
        dies, every rank's area address). When a rank's run is too short the heap grows
        collectively (25 % headroom over what that rank holds plus its need), or, ``fixed``,
        raises naming ``option`` - on every rank alike, so none is left waiting."""
        k = self.num_slots
        peers = [self.slots(r, seq)[k:k + NUM_HEAP_SLOTS].tolist() for r in range(self.world)]
        need = int(nbytes_W[self.rank])
        short = [held + int(n) for (_, free, held), n in zip(peers, nbytes_W)
                 if _rounded(int(n)) > free]
        if not short:
            at = peers[self.rank][FREE_AT]
            self._arena.take_at(at, need)
            return (self._arena.area(at, need, self._held),
                    [self._core.data_ptr(r) + p[FREE_AT] for r, p in enumerate(peers)])
        want = max(short + [int(n) for n in nbytes_W])
        if fixed:
            raise ValueError(f"{option} = {self.data_bytes} is too small: this op needs "
                             f"{want} bytes per rank (the rows it brings plus those earlier ops' "
                             f"tensors still hold). Fix: set {option} >= "
                             f"{-(-want // MiB) * MiB} (or 0: sized from the model and grown on "
                             f"demand)")
        new_bytes = -(-(want * 5 // 4) // MiB) * MiB
        # Every rank is past arrive() and before its first row of this op: nobody writes into
        # the old segments any more, and set-up's own barrier orders the swap. Live areas keep
        # the old mappings (their _Arena holds the old core).
        self._core, self.pids, self.single_copy = _create(
            self.group, new_bytes, 2 * (self.num_slots + NUM_HEAP_SLOTS), self.tag)
        self._arena = _Arena(self._core, self._core.data_bytes)
        for flag, value in ((ARRIVE, seq), (DONE, seq - 1)):
            self._core.publish(flag, value)
        # A fresh arena's free run starts at 0 on every rank: no exchange needed.
        self._arena.take_at(0, need)
        return (self._arena.area(0, need, self._held),
                [self._core.data_ptr(r) for r in range(self.world)])

    def done(self, seq: int) -> None:
        """This rank has written everything of op ``seq``; wait until every rank has."""
        self.publish_done(seq)
        self.wait_done(seq)

    def publish_done(self, seq: int) -> None:
        """This rank has written everything of op ``seq`` (store-release DONE=seq); no wait."""
        self._core.publish(DONE, seq)

    def wait_done(self, seq: int) -> None:
        """Wait until every rank has published DONE >= ``seq``: op ``seq``'s rows are all in
        this rank's area (and every peer is done reading what it read of this rank). Another op
        may have started since (see the module docstring); after a grow the new segments' DONE
        already reads seq - 1, and every rank publishes seq there once it has written."""
        self._core.wait_all(DONE, seq, self.timeout_s, "rows written")


class _Held:
    """Bytes of live receive areas on this rank, over every segment it has had."""

    def __init__(self) -> None:
        self.bytes = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n


class _Arena:
    """Free list over one segment's data region (this rank's only): an op's area is cut from the
    start of the largest free run, published at arrive. Holds the core, so the segment stays
    mapped while any area over it lives."""

    def __init__(self, core: Any, nbytes: int):
        self.core = core
        self.free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (offset, size)
        self.lock = threading.Lock()

    def largest(self) -> tuple[int, int]:
        """(offset, bytes) of the largest free run, the first of equals; (0, 0): none."""
        with self.lock:
            return max(self.free, key=lambda run: (run[1], -run[0]), default=(0, 0))

    def take_at(self, offset: int, nbytes: int) -> None:
        """Make [offset, offset + nbytes (rounded up the ladder)) this rank's; it must lie in
        one free run (the one :meth:`largest` named, perhaps widened by frees since)."""
        size = _rounded(nbytes)
        if size == 0:
            return
        with self.lock:
            i = bisect.bisect(self.free, (offset, float("inf"))) - 1
            at, have = self.free[i] if i >= 0 else (0, 0)
            if i < 0 or offset + size > at + have:
                raise RuntimeError(f"shared-memory heap: bytes [{offset}, {offset + size}) are "
                                   f"not free (free runs {self.free}); this is a bug")
            self.free[i:i + 1] = [r for r in ((at, offset - at),
                                              (offset + size, at + have - offset - size)) if r[1]]

    def give_back(self, offset: int, nbytes: int) -> None:
        size = _rounded(nbytes)
        if size == 0:
            return
        with self.lock:
            i = bisect.bisect(self.free, (offset, 0))
            self.free.insert(i, (offset, size))
            # Coalesce with the neighbours, so big areas come back whole.
            if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:
                self.free[i:i + 2] = [(offset, size + self.free[i + 1][1])]
            if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
                self.free[i - 1:i + 1] = [(self.free[i - 1][0],
                                           self.free[i - 1][1] + self.free[i][1])]

    def area(self, offset: int, nbytes: int, held: _Held) -> torch.Tensor:
        """The uint8 tensor over [offset, offset + nbytes); its bytes come back to the free list
        when its storage dies (torch.frombuffer holds the exporter until then)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        region = _Region.of(_rounded(nbytes)).from_address(
            self.core.data_ptr(self.core.rank) + offset)
        held.add(nbytes)
        weakref.finalize(region, _release, self, offset, nbytes, held)
        return torch.frombuffer(region, dtype=torch.uint8)[:nbytes]


def _release(arena: _Arena, offset: int, nbytes: int, held: _Held) -> None:
    arena.give_back(offset, nbytes)
    held.add(-nbytes)


class _Region:
    """ctypes array types by length: unlike the plain ones, their instances take weak refs."""
    _types: dict[int, type] = {}

    @classmethod
    def of(cls, n: int) -> type:
        t = cls._types.get(n)
        if t is None:
            t = cls._types[n] = type(f"HeapRegion{n}", (ctypes.Array,),
                                     {"_type_": ctypes.c_uint8, "_length_": n})
        return t


def _view(address: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _create(group: Any, data_bytes: int, num_slots: int, tag: str
            ) -> tuple[Any, list[int], bool]:
    """Steps 1-4 of the module docstring; a failure on any rank raises on every rank. Returns
    (the core heap, every rank's pid, whether every rank may read every peer's private memory
    with process_vm_readv: the single-copy combine, probed here so all ranks agree)."""
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
        return heap, [os.getpid()], True
    # Private bytes each peer tries to read back: the cross-memory-attach probe (alive in this
    # frame until after the second all-gather, when every peer has tried).
    token = secrets.token_bytes(16)
    probe = ctypes.create_string_buffer(token, 16)
    infos = _all_gather(group, (machine_id(), name, error, os.getpid(),
                                ctypes.addressof(probe), token))
    errors = [f"rank {r}: {info[2]}" for r, info in enumerate(infos) if info[2]]
    if errors:
        raise RuntimeError("shared-memory heap set-up failed: " + "; ".join(errors))
    check_one_machine([info[0] for info in infos])  # the same verdict on every rank
    try:
        heap.attach([info[1] for info in infos])
    except (RuntimeError, ValueError) as exc:
        error = str(exc)
    got = ctypes.create_string_buffer(16)
    readable = all(core.can_read_process(pid, at, 16, ctypes.addressof(got)) and got.raw == tok
                   for r, (_, _, _, pid, at, tok) in enumerate(infos) if r != rank)
    # The barrier: nobody unlinks before everyone has mapped every segment.
    after = _all_gather(group, (error, readable))
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(after) if e]
    heap.unlink_all()  # every rank unlinks every name: a rank dying here leaves nothing either
    if errors:
        raise RuntimeError("shared-memory heap set-up failed: " + "; ".join(errors))
    return heap, [info[3] for info in infos], all(ok for _, ok in after)


def _all_gather(group: Any, obj: Any) -> list[Any]:
    import torch.distributed as dist
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ---- one heap per group -----------------------------------------------------------------------
# Dispatchers of every MoE layer share their group's heap (ops are collective and ordered, so
# they never overlap). A thread of its own issues its ops on a group of its own: the combined
# 1F1B's backward thread on the twin group (moeplug.parallel.comm.active_group), another heap. The cache holds the group object itself, so its id() cannot be reused by
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
