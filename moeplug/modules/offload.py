"""Fine-grained activation offloading: chosen module inputs go to the stash's second tier in
forward and come back before backward (Megatron ``offload_modules``).

Names (``model.offload``) -> which saved tensors leave memory:

    attn_norm    the attention RMSNorm's input            (block.attn_norm)
    qkv_linear   the q/k/v projections' input              (the attention module's input)
    core_attn    q, k, v as core attention saves them      (CoreAttention's inputs)
    attn_proj    the output projection's input             (attn.o_proj)
    mlp_norm     the FFN RMSNorm's input                   (block.ffn_norm)
    expert_fc1   the routed experts' FC1 input x_SD        (marked by the grouped expert ops)
    moe_act      the expert activation's input, FC1's out  (marked likewise)

How: a marked module's forward runs under saved-tensor hooks. A tensor autograd saves whose
storage is one of the module's inputs (or that the op marked with ``offload_marks.note``) is
written to the runtime's :class:`SpillTier` (an unlinked file: docs/ARCHITECTURE.md) by a copy
queued on the runtime stream ``offload``; the stream keeps the tensor alive until the copy ran,
after which nothing holds it and its memory is free. Everything else a module saves goes to the
hooks outside (the stash, the activation meter), as if no offload scope existed.

Prefetch: when backward reaches a marked module (the gradient of its output arrives), reads of
its tensors and of the previous marked module's are queued on the same stream, each with an
event; unpacking waits for that event only. A tensor is restored with its storage, offset and
strides exactly, so gradients are bitwise those of no offloading. The run's pages return to the
tier (queued behind the reads) when autograd drops the saved tensor.

Devices: a CPU tensor goes to the SpillTier file above. A CUDA tensor goes to pinned host
memory (Megatron's tier): the copy is queued on a side stream after the producer's work, the
caching allocator is told the side stream still reads the storage (``record_stream``), and the
read in backward is queued on that stream too, the consumer's stream waiting on its event only,
so neither direction blocks the host. A meta tensor (``moeplug plan --dry-run``) moves no bytes:
its storage is let go in forward and a new one of the same size is made at the prefetch, which is
what device memory sees on a GPU. Tensors of any other device stay (counted as ``kept``).

Inside a checkpointed (recomputed) region nothing is offloaded: its internals are not kept.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from moeplug.modules import marks, recompute
from moeplug.ops.offload_marks import SCOPE, storage_key
from moeplug.runtime import get_runtime, stream

STREAM = "offload"


class _Spill:
    """One storage's bytes in a run of the tier; read back into ``buffer`` on demand."""

    __slots__ = ("offloader", "first", "count", "nbytes", "buffer", "ready", "__weakref__")

    def __init__(self, offloader: "Offloader", first: int, count: int, nbytes: int):
        self.offloader, self.first, self.count, self.nbytes = offloader, first, count, nbytes
        self.buffer: torch.Tensor | None = None
        self.ready: Any = None  # the event of the queued read

    def prefetch(self) -> None:
        if self.buffer is not None:
            return
        o = self.offloader
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        o.stream._core.enqueue_spill_read(o.tier, self.first, self.count,
                                          self.buffer.data_ptr(), self.nbytes, keep=self.buffer)
        self.ready = o.stream.record()
        o.bytes_prefetched += self.nbytes

    def wait(self) -> None:
        self.ready.synchronize()

    def __del__(self) -> None:
        # Queued behind this run's write and read, so the pages are reused only after both.
        o = self.offloader
        o.stream._core.enqueue_spill_free(o.tier, self.first, self.count)


class _HostCopy:
    """One device storage's bytes in host memory (see the module: CUDA and meta tensors),
    read back into ``buffer`` on demand; the same interface as :class:`_Spill`."""

    __slots__ = ("offloader", "device", "nbytes", "host", "buffer", "ready", "__weakref__")

    def __init__(self, offloader: "Offloader", base: torch.Tensor):
        self.offloader, self.device, self.nbytes = offloader, base.device, base.numel()
        self.buffer: torch.Tensor | None = None
        self.ready: Any = None
        self.host = None
        if self.device.type == "cuda":
            side = offloader.side_stream(self.device)
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            side.wait_stream(torch.cuda.current_stream(self.device))  # after the producer
            with torch.cuda.stream(side):
                self.host.copy_(base, non_blocking=True)
            base.record_stream(side)  # its block is not reused before the copy ran

    def prefetch(self) -> None:
        if self.buffer is not None:
            return
        if self.device.type == "cuda":
            side = self.offloader.side_stream(self.device)
            with torch.cuda.stream(side):  # behind the write, on the same stream
                self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                self.buffer.copy_(self.host, non_blocking=True)
                self.ready = side.record_event()
        else:  # meta: the device memory comes back; there are no bytes to move
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.offloader.bytes_prefetched += self.nbytes

    def wait(self) -> None:
        if self.ready is not None:  # CUDA: the consumer's stream, not the host, waits
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.ready)
            self.buffer.record_stream(current)  # made on the side stream, used on this one


class _Saved:
    """What autograd holds instead of an offloaded tensor: its spill and its view geometry."""

    __slots__ = ("spill", "dtype", "offset", "size", "stride", "group")

    def __init__(self, spill: _Spill, t: torch.Tensor, group: "_Group"):
        self.spill, self.dtype, self.group = spill, t.dtype, group
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class _Group:
    """The spills of one marked module call; ``prev`` is the marked call before it."""

    __slots__ = ("spills", "prev", "__weakref__")

    def __init__(self, prev: "_Group | None"):
        self.spills: list[weakref.ref] = []
        self.prev = None if prev is None else weakref.ref(prev)

    def prefetch(self, lookahead: bool = True) -> None:
        for ref in self.spills:
            s = ref()
            if s is not None:
                s.prefetch()
        prev = self.prev() if (lookahead and self.prev is not None) else None
        if prev is not None:  # the module backward reaches next: its reads overlap this one
            prev.prefetch(lookahead=False)


class _Scope:
    """One marked module call: which storages leave, and what the hooks outside would do."""

    def __init__(self, offloader: "Offloader", names: frozenset[str], inputs: tuple,
                 group: _Group, outer: Any):
        self.offloader, self.names, self.group, self.outer = offloader, names, group, outer
        self.allowed = {storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        # storage_key -> (spill or host copy, the original tensor): one per storage per call; the
        # original is held until the call ends so its key cannot be reused meanwhile.
        self.spilled: dict[int, tuple[Any, torch.Tensor]] = {}

    def pack(self, t: torch.Tensor) -> Any:
        if storage_key(t) in self.allowed and not isinstance(t, nn.Parameter):
            saved = self.offloader.spill(t, self)
            if saved is not None:
                return saved
        return ("outer", self.outer[0](t)) if self.outer else ("plain", t)


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Saved):
        spill = saved.spill
        o = spill.offloader
        t0 = time.perf_counter()
        if spill.buffer is None:  # not prefetched (no grad hook fired): fetch it now
            saved.group.prefetch()
        spill.wait()
        o.wait_seconds += time.perf_counter() - t0  # backward stalled on the tier this long
        storage = spill.buffer.untyped_storage()
        return torch.empty(0, dtype=saved.dtype, device=spill.buffer.device).set_(
            storage, saved.offset, saved.size, saved.stride)
    raise TypeError(f"offload: cannot unpack {type(saved).__name__}")




class Offloader:
    """The second tier (created on first use) and the statistics of one model's offloading.

    ``directory``: where the tier's unlinked file lives ("" = the system's temp directory);
    ``page_bytes`` / ``max_bytes``: its page size and address range (sparse: costs nothing
    until written); ``min_bytes``: smaller tensors are not worth a copy and stay.
    """

    # Where each device's tensors go (see the module; the run record lists it); tensors of
    # other devices stay.
    TIERS = {"cpu": "file", "cuda": "pinned host memory", "meta": "none (the dry run)"}

    def __init__(self, directory: str, page_bytes: int, max_bytes: int,
                 min_bytes: int = 65536):
        self.directory = directory or tempfile.gettempdir()
        self.page_bytes, self.max_bytes, self.min_bytes = page_bytes, max_bytes, min_bytes
        self._tier: Any = None
        self._stream: Any = None
        self._side: dict = {}  # device -> the CUDA side stream of its copies
        self._last_group: weakref.ref | None = None
        self.bytes_offloaded = self.bytes_prefetched = self.kept = 0
        self.wait_seconds = 0.0  # backward's time blocked on reads (not yet done prefetches)
        self._at_last_step = (0, 0, 0.0)  # the counters when step_stats last ran

    @property
    def tier(self) -> Any:
        if self._tier is None:
            self._tier = get_runtime().SpillTier(self.directory, self.page_bytes,
                                                 max(1, self.max_bytes // self.page_bytes))
        return self._tier

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = stream(STREAM)
        return self._stream

    def side_stream(self, device: torch.device) -> Any:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def spill(self, t: torch.Tensor, scope: _Scope) -> _Saved | None:
        storage = t.untyped_storage()
        nbytes, kind = storage.nbytes(), t.device.type
        if kind not in self.TIERS or nbytes < self.min_bytes:
            self.kept += kind not in self.TIERS
            return None
        key = storage_key(t)
        hit = scope.spilled.get(key)
        if hit is None:
            base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0,
                                                                            (nbytes,), (1,))
            moved = self._to_tier(base) if kind == "cpu" else _HostCopy(self, base)
            if moved is None:  # tier full: counted by it, the tensor stays in memory
                return None
            hit = scope.spilled[key] = (moved, base)
            scope.group.spills.append(weakref.ref(moved))
            self.bytes_offloaded += nbytes
        return _Saved(hit[0], t, scope.group)

    def _to_tier(self, base: torch.Tensor) -> _Spill | None:
        """A CPU storage's bytes (``base``: all of them, as uint8) written to the tier."""
        nbytes = base.numel()
        first, count = self.tier.alloc(nbytes)
        if first < 0:
            return None
        self.stream._core.enqueue_spill_write(self.tier, first, count, base.data_ptr(), nbytes,
                                              keep=base)
        return _Spill(self, first, count, nbytes)

    @contextlib.contextmanager
    def scope(self, names: frozenset[str], inputs: tuple) -> Iterator[_Group | None]:
        """Offload what the enclosed forward saves of ``inputs`` (and what ops note for
        ``names``, moeplug.ops.offload_marks); yields the call's group (None when nothing may be
        offloaded now)."""
        if (not torch.is_grad_enabled() or recompute.recomputing()
                or recompute.will_recompute()):
            yield None
            return
        prev = self._last_group() if self._last_group is not None else None
        group = _Group(prev)
        self._last_group = weakref.ref(group)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        sc = _Scope(self, names, inputs, group, outer)

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _Saved):
                return _unpack(saved)
            kind, value = saved
            return value if kind == "plain" else outer[1](value)
        token = SCOPE.set(sc)
        try:
            with torch.autograd.graph.saved_tensors_hooks(sc.pack, unpack):
                yield group
        finally:
            SCOPE.reset(token)
            sc.spilled.clear()  # the originals: the stream holds each until its write ran

    def stats(self) -> dict:
        """For train records: bytes moved and the tier's page statistics."""
        out = {"bytes_offloaded": self.bytes_offloaded, "bytes_prefetched": self.bytes_prefetched,
               "kept_no_tier": self.kept}
        if self._tier is not None:
            t = self._tier.stats()
            out.update(pages_in_use=t["pages_in_use"], high_water=t["high_water"],
                       overflows=t["overflows"])
        return out


    def step_stats(self) -> dict:
        """This step's offloading, for the train record (``offload``), since the previous call:
        bytes written to / read back from the tier, the tier's high-water mark (pages and bytes)
        over the step, and the seconds backward waited on reads. Resets the high-water mark."""
        b_off, b_pre, wait = self._at_last_step
        self._at_last_step = (self.bytes_offloaded, self.bytes_prefetched, self.wait_seconds)
        out = {"bytes_offloaded": self.bytes_offloaded - b_off,
               "bytes_prefetched": self.bytes_prefetched - b_pre,
               "prefetch_wait_s": self.wait_seconds - wait,
               "high_water_pages": 0, "high_water_bytes": 0, "overflows": 0}
        if self._tier is not None:
            # The step's frees are queued behind its reads: let them run, so the mark the
            # next step starts from is what it really still holds (nothing, normally).
            self.stream.synchronize()
            t = self._tier.stats()
            out.update(high_water_pages=t["high_water"],
                       high_water_bytes=t["high_water"] * self.page_bytes,
                       overflows=t["overflows"])  # run total: a nonzero count is never silent
            self._tier.reset_high_water()
        return out


def _prefetch_hook(group: _Group):
    def hook(grad: torch.Tensor) -> None:
        group.prefetch()  # backward reached this module: bring its inputs (and the next) back
    return hook


def offloaded_call(module: nn.Module, fn: Any, *args: Any) -> Any:
    o: Offloader | None = getattr(module, "_moeplug_offloader", None)
    if o is None:
        return fn(*args)
    inputs = args if module._moeplug_offload_inputs else ()
    with o.scope(module._moeplug_offload_names, inputs) as group:
        out = fn(*args)
    if group is not None and group.spills:
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(_prefetch_hook(group))
    return out


# An offloaded module's forward runs under its offload scope (moeplug.modules.marks); so does
# runtime.sync_free's call on packed budget rows (Experts.forward_packed), so that what its op
# notes leaves memory too.
OFFLOAD = marks.MarkKind("Offloaded", offloaded_call, ("forward", "forward_packed"))


def mark(module: nn.Module, offloader: Offloader, names: frozenset[str], inputs: bool) -> None:
    """``inputs``: the module's own inputs leave; ``names``: what its ops note."""
    marks.mark(module, OFFLOAD)
    object.__setattr__(module, "_moeplug_offloader", offloader)
    object.__setattr__(module, "_moeplug_offload_inputs",
                       inputs or getattr(module, "_moeplug_offload_inputs", False))
    prev = getattr(module, "_moeplug_offload_names", frozenset())
    object.__setattr__(module, "_moeplug_offload_names", prev | names)


def remove_offload(model: nn.Module) -> None:
    """Undo apply_offload's marks (benchmarks switch levers on one model)."""
    for m in model.modules():
        if marks.unmark(m, OFFLOAD):
            for attr in ("_moeplug_offloader", "_moeplug_offload_names",
                         "_moeplug_offload_inputs"):
                m.__dict__.pop(attr, None)


def _targets(block: nn.Module, name: str) -> list[nn.Module]:
    from moeplug.modules.attention import CoreAttention
    from moeplug.moe import MoELayer
    attn = block.attn
    if name == "attn_norm":
        return [block.attn_norm]
    if name == "mlp_norm":
        return [block.ffn_norm]
    if name == "qkv_linear":
        return [attn]
    if name == "core_attn":
        return [m for m in attn.modules() if isinstance(m, CoreAttention)]
    if name == "attn_proj":
        return [attn.o_proj]
    if name in ("expert_fc1", "moe_act"):
        return [block.ffn.experts] if isinstance(block.ffn, MoELayer) else []
    raise ValueError(f"model.offload: unknown module {name!r}")


def apply_offload(model: nn.Module, names: list[str], offloader: Offloader) -> None:
    """Mark the blocks' modules for the offload ``names`` (config.OFFLOAD_MODULES)."""
    blocks = list(model.blocks) + [layer.block for layer in getattr(model, "mtp", [])]
    for block in blocks:
        for name in names:
            for m in _targets(block, name):
                # expert_fc1 / moe_act: tensors inside the op, noted by it (a backend that
                # declares can_recompute_activation: moeplug.config.modes.recompute's rule)
                if name in ("expert_fc1", "moe_act"):
                    mark(m, offloader, frozenset({name}), inputs=False)
                else:  # the module's inputs (qkv_linear: the x that q/k/v_proj all keep)
                    mark(m, offloader, frozenset(), inputs=True)
