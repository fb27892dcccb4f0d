"""Per-rank memory, measured: weights, grads, optimizer state, activations, process peak.

    weights / grads / optimizer   bytes of the tensors themselves (storage counted once)
    activations_peak              the most bytes ever held for backward at once: every tensor
                                  autograd saves (saved_tensors_hooks) and every checkpoint's
                                  kept inputs, from when it is saved until autograd frees it,
                                  parameters left out (they are "weights")
    rss_peak                      the process's resident-set high-water mark (Linux VmHWM,
                                  reset at each meter's start), or on CUDA the allocator's
                                  max_memory_allocated (reset likewise)

The activation count is exact for what autograd keeps (a storage shared by several saved
tensors counts once, for as long as one of them lives); what it cannot see are buffers an op
keeps outside autograd, which the RSS / allocator peak does include.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from moeplug.modules import recompute
from moeplug.ops import discard
from moeplug.parallel.fsdp import local


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = local(t).untyped_storage()  # FSDP's DTensors: the shard this rank holds
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every state tensor of a torch optimizer, or of a DistributedAdamW (its inner AdamW's
    state and its fp32 master slices)."""
    inner = getattr(optimizer, "inner", optimizer)
    out = [v for state in inner.state.values() for v in state.values()
           if isinstance(v, torch.Tensor) and v.numel() > 1]  # step counters are scalars
    out += [b.shard for b in getattr(optimizer, "buckets", [])]
    return out


class _Held:
    """One saved tensor; counted while this handle lives (autograd drops it after use)."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "ActivationMeter", tensor: torch.Tensor | None) -> None:
        self.meter, self.tensor, self.key = meter, tensor, None
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in meter.param_ptrs or storage.nbytes() == 0:
            return
        key = storage._cdata  # the storage itself: its data pointer changes if it is discarded
        self.key = key
        refs, nbytes = meter.live.get(key, (0, storage.nbytes()))
        meter.live[key] = (refs + 1, nbytes)
        if refs == 0:
            meter.current += nbytes
            meter.peak = max(meter.peak, meter.current)

    def __del__(self) -> None:
        if self.key is None:
            return
        refs, nbytes = self.meter.live[self.key]
        if refs == 1:
            del self.meter.live[self.key]
            self.meter.current -= nbytes
        else:
            self.meter.live[self.key] = (refs - 1, nbytes)


class ActivationMeter:
    """Counts the bytes held for backward while active (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.param_ptrs = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, tuple[int, int]] = {}
        self.current = self.peak = 0

    def hold(self, tensors: Iterable[Any]) -> list[_Held]:
        return [_Held(self, t) for t in tensors if isinstance(t, torch.Tensor)]

    def _discarded(self, storage: torch.UntypedStorage, nbytes: int, freed: bool) -> None:
        """A saved storage freed or refilled by output discarding (moeplug.ops.discard)."""
        key = storage._cdata
        if key not in self.live:
            return
        refs, _ = self.live[key]
        self.live[key] = (refs, 0 if freed else nbytes)
        self.current += -nbytes if freed else nbytes
        self.peak = max(self.peak, self.current)

    @contextlib.contextmanager
    def active(self) -> Iterator["ActivationMeter"]:
        token = recompute._HELD_INPUTS.set(self.hold)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(self, t),
                                                          lambda h: h.tensor), \
                    discard.observing(self._discarded):
                yield self
        finally:
            recompute._HELD_INPUTS.reset(token)


def reset_process_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux: ru_maxrss (never reset) is read instead
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS


def process_peak(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_record(model: nn.Module, optimizer: Any, meter: ActivationMeter | None,
                  device: torch.device) -> dict[str, int]:
    """This rank's ``memory`` entry of a train record (bytes); ``activations_peak`` only when
    a meter ran (train.memory_stats)."""
    params = list(model.parameters())
    record = {"weights": tensor_bytes(params),
              "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
              "optimizer": tensor_bytes(optimizer_tensors(optimizer)),
              "rss_peak": process_peak(device)}
    if meter is not None:
        record["activations_peak"] = meter.peak
    return record


def gather_ranks(record: dict[str, int], group: Any = None) -> list[dict[str, int]]:
    """Every rank's record, in rank order (one small all-gather; [record] in one process)."""
    import torch.distributed as dist
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return [record]
    keys = list(record)  # the same on every rank (one config)
    mine = torch.tensor([record[k] for k in keys], dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [dict(zip(keys, (int(v) for v in t))) for t in out]
