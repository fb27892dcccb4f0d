"""The largest value each key holds on any rank of a group, when ranks hold different keys.

Delayed FP8 scaling reduces its amaxes this way (Transformer Engine's ``reduce_amax``): one
all-reduce (MAX) of a flat vector per step. TE lines its amax buffers up by position, which
assumes every rank runs the same modules in the same order; here each value is named (a
parameter's name, a *global* expert id, a role), so expert-parallel ranks holding different
experts, or an expert that got no rows on one rank this step, still meet their own key.

The union of the ranks' keys is agreed through ``all_gather_object`` once, and again only when
some rank's key set changes (a checksum of every rank's keys is all-gathered each call, as
one int64 per rank).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable, Mapping

import torch
import torch.distributed as dist

from moeplug.parallel.comm import gather_ints

NONE = -1.0  # no rank holds a value under this key this call (values are >= 0)


def _checksum(keys: list) -> int:
    """63 bits of a hash of the keys' repr (the same in every process, unlike hash())."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class KeyedMax:
    """``__call__(values, group)`` -> {key: max over ranks} for every key of the union that
    ``owns(key)`` says this rank holds (values of ``values`` included). Values are 0-d
    non-negative tensors; NaN counts as +inf (non-finite stays non-finite). A key no rank
    gave a value for this call maps to None."""

    def __init__(self) -> None:
        self._union: list = []
        self._sums: list[int] | None = None

    def union(self, keys: list, group: Any) -> list:
        keys = sorted(keys, key=repr)
        sums = gather_ints(_checksum(keys), group)
        if sums != self._sums:
            gathered: list = [None] * len(sums)
            dist.all_gather_object(gathered, keys, group=group)
            self._union = sorted({k for ks in gathered for k in ks}, key=repr)
            self._sums = sums
        return self._union

    def __call__(self, values: Mapping[Hashable, torch.Tensor | None], group: Any,
                 owns: Callable[[Hashable], bool]) -> dict:
        alone = group is None or dist.get_world_size(group) == 1
        keys = sorted(values, key=repr) if alone else self.union(list(values), group)
        if not keys:  # every rank agrees (the union is theirs): e.g. a stage kept all in bf16
            return {}
        present = [v for v in values.values() if v is not None]
        device = present[0].device if present else torch.device("cpu")
        if not alone:  # the collective's device: gloo reduces host tensors, NCCL device ones
            device = (torch.device("cpu") if dist.get_backend(group) == "gloo" else
                      torch.device("cuda", torch.cuda.current_device()))
        vec = torch.full((len(keys),), NONE, dtype=torch.float32, device=device)
        index = {k: i for i, k in enumerate(keys)}
        mine = [(index[k], v) for k, v in values.items() if v is not None]
        if mine:
            slots = torch.tensor([i for i, _ in mine], device=device)
            vec[slots] = _finite_or_inf(torch.stack([v.float() for _, v in mine]).to(device))
        if not alone:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        host = vec.cpu()  # the step's one host sync
        return {k: (None if host[i] == NONE else host[i]) for i, k in enumerate(keys)
                if k in values or owns(k)}


def _finite_or_inf(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(v), torch.full_like(v, float("inf")), v)
