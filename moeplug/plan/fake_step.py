"""The dispatch mode a dry run's train step runs under, on meta tensors (moeplug.plan.dry_run).

Meta tensors have shapes and no values, so three things a real step has must come from here:

* **values a step reads on the host** (``int(t)``, ``t.tolist()``: the routing's row counts,
  the all-to-all splits, capacity pads). Small integer and boolean tensors are *shadowed*: each
  op whose tensor inputs all have shadows also runs on the real shadows (on the CPU), and a
  host read returns the shadow's value. The shadows start at the balanced oracle's expert ids
  (:func:`shadow`) and at factory calls (``arange``, ``zeros``, ...), so every count a
  dispatcher derives from the ids is the count of perfectly balanced routing. A float read
  (a loss, the grad norm) has no value to give: it reads as 0.0, which the step treats as
  finite. An integer read with no shadow is refused naming the op (that count would be made up).
* **memory**: every storage a fake op creates is counted while it lives (weak references, as
  torch's ``MemTracker`` does), by category: what lived before the step (``base``: weights and
  anything built with them), gradients (marked by :meth:`DryStepMode.mark`), and the rest
  (activations, temporaries, communication buffers), whose peak is the step's activation peak.
* **communication**: each c10d collective's bytes (torch's ``fake_collectives`` sizes: the
  bytes this rank sends) by kind.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

# Shadowed tensors stay small (counts, splits, row maps of one micro-batch), never activations.
SHADOW_LIMIT = 1 << 22
DEBUG_PEAK = bool(__import__("os").environ.get("MOEPLUG_DRY_DEBUG"))
_SHADOW_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)

# c10d op name -> the kind the report prints.
_KIND = {"alltoall": "all-to-all", "all_to_all": "all-to-all", "allgather": "all-gather",
         "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
         "allreduce": "all-reduce", "all_reduce": "all-reduce", "send": "p2p send",
         "recv": "p2p recv", "isend": "p2p send", "irecv": "p2p recv",
         "broadcast": "broadcast", "gather": "gather", "scatter": "scatter"}


class DryRunError(RuntimeError):
    """The dry run met something fake tensors cannot answer."""


def collective_kind(name: str) -> str:
    base = name.lstrip("_")
    for key in sorted(_KIND, key=len, reverse=True):
        if base.startswith(key):
            return _KIND[key]
    return base


def _moves(t: Any, kwargs: dict, src: str, dst: str) -> bool:
    device = kwargs.get("device")
    return (isinstance(t, torch.Tensor) and t.device.type == src and device is not None
            and torch.device(device).type == dst)


class DryStepMode(TorchDispatchMode):
    """Shadows small integer tensors, counts live storages by category and collective bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.shadows = WeakIdKeyDictionary()
        self.live: dict[int, tuple[int, str]] = {}      # id(storage) -> (bytes, category)
        self._refs: dict[int, weakref.ref] = {}
        self.bytes = defaultdict(int)                   # category -> live bytes
        self.peak = defaultdict(int)                    # category -> peak live bytes
        self.peak_total = 0
        self.comm = defaultdict(int)                    # kind -> bytes this rank sent
        self.comm_calls = defaultdict(int)
        self.category = "other"
        self.creator: dict[int, tuple] = {}
        self._snap = 0
        self.peak_live: list = []  # at the step's peak: (bytes, creator) of its storages
        self.unshadowed = 0                             # host copies with no shadow (zeros)

    # ---- values -------------------------------------------------------------------------------
    def shadow(self, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Give ``fake`` the values ``real`` (a CPU tensor of its shape) for host reads."""
        self.shadows[fake] = real
        return fake

    def _real(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.shadows[x] if x.is_meta else x
        if isinstance(x, torch.device) and x.type != "cpu":
            return torch.device("cpu")
        return x

    def _shadowable(self, func, args, kwargs, out) -> bool:
        leaves = tree_flatten((args, kwargs))[0]
        if any(isinstance(x, torch.UntypedStorage) for x in leaves):
            return False  # set_ onto a meta storage (offloading's views): no host values
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if any(t.is_meta and t not in self.shadows for t in tensors):
            return False
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or not all(t.is_meta for t in outs) \
                or any(t.numel() > SHADOW_LIMIT for t in outs):
            return False
        # Factories: integer / boolean ones only (index arithmetic, not activations).
        return bool(tensors) or all(t.dtype in _SHADOW_DTYPES for t in outs)

    def _propagate(self, func, args, kwargs, out) -> None:
        with torch.utils._python_dispatch._disable_current_modes():
            real_args = tree_map_only((torch.Tensor, torch.device), self._real, args)
            real_kwargs = tree_map_only((torch.Tensor, torch.device), self._real, kwargs)
            real_out = func(*real_args, **real_kwargs)
        fakes, _ = tree_flatten(out)
        reals, _ = tree_flatten(real_out)
        for f, r in zip(fakes, reals):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                self.shadows[f] = r

    def _lift(self, args, kwargs):
        """Host tensors meeting meta ones (a pipeline receive buffer, which moeplug makes on the
        CPU; a host-side count) become meta tensors, with their values as shadows, as a real
        run's would have to be on the device."""
        flat = tree_flatten((args, kwargs))[0]
        if not any(isinstance(t, torch.Tensor) and t.is_meta for t in flat) or not any(
                isinstance(t, torch.Tensor) and not t.is_meta and t.dim() > 0 for t in flat):
            return args, kwargs

        def lift(t):
            if t.is_meta or t.dim() == 0:
                return t
            m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if t.numel() <= SHADOW_LIMIT and t.dtype in _SHADOW_DTYPES:
                self.shadows[m] = t
            return m
        return tree_map_only(torch.Tensor, lift, (args, kwargs))

    def _on_shadows(self, func, args, kwargs):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        missing = [t for t in tensors if t.is_meta and t not in self.shadows]
        if missing:
            raise DryRunError(f"{func} has no meta kernel and its input {tuple(missing[0].shape)} "
                              f"{missing[0].dtype} has no balanced-routing values. Fix: give "
                              "the op a fake kernel (torch.library.register_fake) next to it")
        with torch.utils._python_dispatch._disable_current_modes():
            real_args = tree_map_only((torch.Tensor, torch.device), self._real, args)
            real_kwargs = tree_map_only((torch.Tensor, torch.device), self._real, kwargs)
            real_out = func(*real_args, **real_kwargs)

        def to_meta(r):
            m = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
            self.shadows[m] = r
            return m
        out = tree_map_only(torch.Tensor, to_meta, real_out)
        self._op = func
        self._track(out)
        return out

    def _drop_written(self, func, args) -> None:
        """An in-place op that could not run on the shadows makes its target's shadow stale."""
        for arg, schema in zip(args, func._schema.arguments):
            if isinstance(arg, torch.Tensor) and schema.alias_info is not None \
                    and schema.alias_info.is_write:
                self.shadows.pop(arg, None)

    def _to_host(self, t: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """A meta tensor copied to the host: its shadow's values, else zeros (a loss, a
        logged count: nothing the step's shapes depend on), counted in ``unshadowed``."""
        dtype = kwargs.get("dtype") or t.dtype
        if t in self.shadows:
            return self.shadows[t].to(dtype).clone()
        self.unshadowed += 1
        return torch.zeros(t.shape, dtype=dtype, device="cpu")

    def _scalar(self, t: torch.Tensor) -> Any:
        if not t.is_meta:
            with torch.utils._python_dispatch._disable_current_modes():
                return t.item()
        if t in self.shadows:
            return self.shadows[t].item()
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return 0.0  # a loss or a norm: no value under fake tensors; 0.0 is finite
        raise DryRunError(f"a host read of an integer tensor {tuple(t.shape)} {t.dtype} that no "
                          "balanced-routing count explains: the dry run cannot make its value "
                          "up. Fix: shadow it in moeplug.plan.fake_step (it needs a source)")

    def _values(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values behind ``t`` (itself on the host, its shadow on meta), or None."""
        return self.shadows.get(t) if t.is_meta else t

    def _set_values(self, t: torch.Tensor, real: torch.Tensor) -> None:
        if t.is_meta:
            self.shadows[t] = real.clone()
        else:
            with torch.utils._python_dispatch._disable_current_modes():
                t.copy_(real)

    def _oracle_collective(self, func, args) -> None:
        """What the collective would have delivered under the balanced oracle, where every
        rank of a group holds the same values as this one (same routing, same counts): the
        outputs of the small collectives the step reads (row counts, capacities, flags)."""
        c10d = torch.ops.c10d
        group = CollectiveOp.get_process_group(func, args)
        with torch.utils._python_dispatch._disable_current_modes():
            if func is c10d.alltoall_base_.default:
                out, inp, _, out_splits, in_splits = args[:5]
                x = self._values(inp)
                if x is None or out.numel() > SHADOW_LIMIT:
                    return
                W, me = group.size(), group.rank()
                in_splits = list(in_splits) or [x.shape[0] // W] * W
                mine = x.split(in_splits)[me]  # what every rank sends this one
                self._set_values(out, torch.cat([mine] * W))
            elif func is c10d.allreduce_.default:
                # The reduce op is opaque here (a TorchScript object): the values stay this
                # rank's, right for MAX / MIN / AVG of equal ranks (the step's flags); a SUM
                # (logged expert counts) reads as one rank's.
                return
            elif func in (c10d._allgather_base_.default,):
                out, inp = args[:2]
                x = self._values(inp)
                if x is not None and out.numel() <= SHADOW_LIMIT:
                    self._set_values(out, torch.cat([x.reshape(-1)] * group.size()).view(out.shape))
            elif func is c10d.allgather_.default:
                outs, inps = args[0], args[1]
                for row, inp in zip(outs, inps):
                    x = self._values(inp)
                    if x is not None:
                        for o in row:
                            self._set_values(o, x)

    # ---- memory -------------------------------------------------------------------------------
    def _track(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or not t.is_meta:
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in self.live:
                continue
            n = st.nbytes()
            self.live[key] = (n, self.category)
            self.creator[key] = (str(getattr(self, "_op", "")), tuple(t.shape))
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
            self._add(self.category, n)

    def _add(self, cat: str, n: int) -> None:
        self.bytes[cat] += n
        if DEBUG_PEAK and cat == "step" and self.bytes[cat] > self._snap + (1 << 30):
            self._snap = self.bytes[cat]
            self.peak_live = [(b, self.creator.get(k)) for k, (b, c) in self.live.items()
                              if c == "step"]
        self.peak[cat] = max(self.peak[cat], self.bytes[cat])
        total = sum(self.bytes.values())
        self.peak_total = max(self.peak_total, total)

    def _free(self, key: int) -> None:
        n, cat = self.live.pop(key, (0, None))
        self.creator.pop(key, None)
        self._refs.pop(key, None)
        if cat is not None:
            self.bytes[cat] -= n

    def discarded(self, storage: torch.UntypedStorage, nbytes: int, freed: bool) -> None:
        """Output discarding (moeplug.ops.discard) freed or refilled a live storage."""
        key = id(storage)
        if key not in self.live:
            return
        _, cat = self.live[key]
        self.live[key] = (0 if freed else nbytes, cat)
        if freed:
            self.bytes[cat] -= nbytes
        else:
            self._add(cat, nbytes)

    def mark(self, tensors, category: str) -> None:
        """Count the storages of ``tensors`` as ``category`` from now on (gradients, state)."""
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            key = id(st)
            if key not in self.live:
                self.live[key] = (st.nbytes(), "other")
                self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
                self.bytes["other"] += st.nbytes()
            n, old = self.live[key]
            if old != category:
                self.bytes[old] -= n
                self.live[key] = (n, category)
                self._add(category, n)

    def rebase(self, category: str = "base") -> None:
        """Everything alive now is ``category`` (call before the step); peaks restart."""
        for key, (n, _) in list(self.live.items()):
            self.live[key] = (n, category)
        self.bytes = defaultdict(int)
        for n, cat in self.live.values():
            self.bytes[cat] += n
        self.peak = defaultdict(int, self.bytes)
        self.peak_total = sum(self.bytes.values())

    def category_bytes(self, tensors) -> int:
        """Bytes of the distinct storages of ``tensors``."""
        seen = {}
        for t in tensors:
            if t is not None:
                st = t.untyped_storage()
                seen[id(st)] = st.nbytes()
        return sum(seen.values())

    # ---- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(args[0])
        if func is torch.ops.aten._to_copy.default and _moves(args[0], kwargs, "meta", "cpu"):
            return self._to_host(args[0], kwargs)
        args, kwargs = self._lift(args, kwargs)
        try:
            out = func(*args, **kwargs)
        except NotImplementedError:
            # No meta kernel (bincount, nonzero: their output size depends on the values):
            # run it on the shadows and give the result's shape to a meta tensor.
            return self._on_shadows(func, args, kwargs)
        if func is torch.ops.aten._to_copy.default and _moves(args[0], kwargs, "cpu", "meta"):
            if args[0].numel() <= SHADOW_LIMIT and out.dtype in _SHADOW_DTYPES:
                self.shadows[out] = args[0].to(out.dtype)
            self._track(out)
            return out
        if func in collective_ops and func not in sync_ops:
            self._oracle_collective(func, args)
            name = func.__name__.split(".")[0]
            self.comm[collective_kind(name)] += CollectiveOp.get_comm_tensor_size(
                func, out, args, kwargs)
            self.comm_calls[collective_kind(name)] += 1
        if self._shadowable(func, args, kwargs, out):
            self._propagate(func, args, kwargs, out)
        else:
            self._drop_written(func, args)
        self._op = func
        self._track(out)
        return out
