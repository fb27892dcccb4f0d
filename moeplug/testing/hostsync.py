"""A counter of host synchronisations, usable on the CPU: ``with HostSyncCounter() as c: ...``.

On a CPU every tensor already lives on the host, so torch's own sync debugging
(``torch.cuda.set_sync_debug_mode``) has nothing to see. This counter instead records every call
that *would* make the host wait for a GPU: reading a value (``.item()``, ``.tolist()``,
``int(t)``/``float(t)``/``bool(t)``, ``.numpy()``), copying to the host (``.cpu()``,
``.to("cpu")``), and ops whose output size depends on the data (``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` with tensor
repeats and no ``output_size``).

Two layers, so nothing slips through:
  * a TorchFunctionMode sees the Python-level calls (``.cpu()`` of a CPU tensor dispatches no
    op, so only this layer can see it);
  * a TorchDispatchMode sees the aten ops, including those made from C++ and in backward
    (``aten._local_scalar_dense`` is what every value read becomes).
A call counted by the first layer is not counted again by the second. ``calls`` lists what was
counted, in order, for the assertion message.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_T = torch.Tensor
_PY_SYNCS = {
    _T.item: "item", _T.tolist: "tolist", _T.cpu: "cpu", _T.numpy: "numpy",
    _T.__bool__: "__bool__", _T.__int__: "__int__", _T.__float__: "__float__",
    _T.__index__: "__index__", _T.nonzero: "nonzero", torch.nonzero: "nonzero",
    _T.masked_select: "masked_select", torch.masked_select: "masked_select",
    _T.unique: "unique", torch.unique: "unique", _T.bincount: "bincount",
    torch.bincount: "bincount", torch.argwhere: "argwhere",
}
_ATEN_SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
               "bincount", "argwhere")


def _is_host(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _py_sync(func, args, kwargs) -> str | None:
    name = _PY_SYNCS.get(func)
    if name is not None:
        return name
    if func is _T.to:  # .to("cpu") / .to(torch.device("cpu")) / .to(device="cpu")
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, (str, torch.device)) and _is_host(target):
            return "to(cpu)"
    if func is _T.__getitem__ and len(args) > 1:  # boolean-mask indexing
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
            return "bool-mask index"
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave"
    return None


class _FunctionLayer(TorchFunctionMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _py_sync(func, args, kwargs)
        if name is None:
            return func(*args, **kwargs)
        self.counter._record(name)
        self.counter._inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._inside -= 1


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter._inside:
            name = func._schema.name.split("::")[-1]
            if name in _ATEN_SYNCS:
                self.counter._record(f"aten.{name}")
            elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in (args[1] if len(args) > 1 else ())):
                self.counter._record("aten.index(bool mask)")
            elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) \
                    and kwargs.get("output_size") is None and len(args) < 3:
                self.counter._record("aten.repeat_interleave")
            elif name in ("_to_copy", "copy_") and self._to_host(args, kwargs):
                self.counter._record(f"aten.{name}(device->host)")
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(args, kwargs) -> bool:
        # A real device->host copy (only possible where a GPU exists).
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        if args[0].device.type == "cpu":
            src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            return src is not None and src.device.type != "cpu"
        return _is_host(kwargs.get("device"))


class HostSyncCounter:
    """Context manager; ``count`` host syncs (see the module docstring), ``calls`` their names."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._inside = 0
        self._modes = (_FunctionLayer(self), _DispatchLayer(self))

    @property
    def count(self) -> int:
        return len(self.calls)

    def _record(self, name: str) -> None:
        self.calls.append(name)

    def __enter__(self) -> "HostSyncCounter":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
