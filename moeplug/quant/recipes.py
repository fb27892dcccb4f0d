"""The five low-precision recipes as emulations: ``fake(t, role, axis)`` returns what the GEMM
would see, i.e. quantize -> dequantize in fp32, with the block axis along the GEMM's contraction
``axis``. Roles: ``x`` activations, ``w`` weights, ``g`` output gradients.

Dispatch (``quantize_rows`` / ``dequantize_rows``) sends token rows as the recipe's forward
activation format, blocks along the hidden axis; NVFP4 rows travel as MXFP8 (an FP4 wire format
would need its own all-to-all packing), so its dispatch matches the ``mxfp8`` recipe's.
"""

from __future__ import annotations

import torch

from moeplug.parallel.keyed import KeyedMax
from moeplug.quant import fp8, mx, nvfp4

FORMATS = {"e4m3": (fp8.E4M3, fp8.E4M3), "hybrid": (fp8.E4M3, fp8.E5M2)}  # (fwd, grad)


class Recipe:
    name = "recipe"
    quantize_dispatch = True  # dispatchers send rows with quantize_rows (the plugin's option)
    # Rows per expert must be a multiple of this for the real grouped low-precision GEMMs
    # (Megatron-Core: 16 for FP8, 32 for MXFP8/NVFP4); routers pad to it (row_alignment()).
    row_alignment = 16

    def fake(self, t: torch.Tensor, role: str, axis: int, key=None,
             record: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def wgrad_inputs(self, g_MN: torch.Tensor, x_MK: torch.Tensor):
        """Transform both inputs of dW = g^T x along M before quantizing (NVFP4: RHT)."""
        return g_MN, x_MK

    def quantize_rows(self, x_SD: torch.Tensor):
        """(payload fp8 [S, D], scales fp32 [S, n]) for the wire: MXFP8 blocks of 32."""
        q, code = mx.quantize_mx(x_SD, -1)
        return q, code

    def dequantize_rows(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return mx.dequantize_mx(q, scales, -1)


class Tensorwise(Recipe):
    name = "fp8_tensorwise"

    def __init__(self, fmt: str = "hybrid", power_of_2_scales: bool = False):
        self.fwd, self.bwd = FORMATS[fmt]
        self.pow2 = power_of_2_scales

    def dtype(self, role: str) -> torch.dtype:
        return self.bwd if role == "g" else self.fwd

    def fake(self, t, role, axis, key=None, record=True):
        q, scale = fp8.quantize_tensorwise(t, self.dtype(role), self.pow2)
        return q.float() / scale

    def quantize_rows(self, x_SD):
        q, scale = fp8.quantize_blockwise(x_SD, -1, x_SD.shape[-1] or 1, self.fwd, self.pow2)
        return q, scale  # one scale per row: a row is self-contained on the wire

    def dequantize_rows(self, q, scales):
        return fp8.dequantize_blockwise(q, scales, -1, q.shape[-1] or 1)


class Delayed(Tensorwise):
    """Tensorwise FP8 whose scale comes from an amax history (one per GEMM operand), one entry
    per optimizer step: ``end_step`` folds the step's amaxes in, each the max over the step's
    micro-batches and over every rank of the stage (TE's ``reduce_amax``): every rank of a
    stage quantizes with the same scales, whatever tokens and shards it holds."""
    name = "fp8_delayed"

    def __init__(self, fmt: str = "hybrid", amax_history_len: int = 16,
                 amax_compute_algo: str = "max", margin: int = 0):
        super().__init__(fmt)
        self.history_len, self.algo, self.margin = amax_history_len, amax_compute_algo, margin
        self.scalers: dict = {}
        self._reduce = KeyedMax()

    def scaler(self, key, role) -> fp8.DelayedScaler:
        k = (key, role)
        if k not in self.scalers:
            self.scalers[k] = fp8.DelayedScaler(self.history_len, self.algo, self.dtype(role),
                                                self.margin)
        return self.scalers[k]

    def fake(self, t, role, axis, key=None, record=True):
        q, scale = self.scaler(key, role).quantize(t, record)
        return q.float() / scale

    def end_step(self, names: dict, experts: dict, group=None, train: bool = True) -> None:
        """Fold the step's amaxes into the histories (``train``), or drop them (after an
        evaluation, which must not steer training). ``names`` maps ``id(param)`` to its
        one-process name; ``experts`` maps an expert parameter's ``id`` to (this rank's first
        global expert, its local experts). With ``group`` (every rank of the stage) the amaxes
        are reduced by (name, global expert, role) first: a collective, every rank of the
        group calls it."""
        if not train:
            for s in self.scalers.values():
                s.pending = None
            return
        named = {}
        for (key, role), s in list(self.scalers.items()):
            k = _global_key(key, role, names, experts)
            if k is None:
                # A GEMM on a tensor that is no parameter (none of moeplug's; a plugin's derived
                # weight): a new tensor, and key, every step. Keeping it would only leak.
                del self.scalers[(key, role)]
                continue
            named[k] = s.pending
        local = _LocalKeys(names, experts)
        for k, amax in self._reduce(named, group, local.holds).items():
            self.scaler(*local.key(k)).commit(amax)

    def state_dict(self, names: dict, experts: dict) -> list:
        """The amax histories and scales, JSON-ready, each under the one-process name of the
        parameter its GEMM multiplies, its global expert id (None for a parameter that is no
        expert's) and its role: keys that mean the same GEMM in every layout. Arguments as
        :meth:`end_step`'s."""
        out = []
        for (key, role), s in self.scalers.items():
            k = _global_key(key, role, names, experts)
            if k is not None:
                out.append({"param": k[0], "global_expert": k[1], "role": role,
                            "history": s.history.tolist(), "scale": float(s.scale)})
        return out

    def load_state_dict(self, state: list, names: dict, experts: dict) -> None:
        """Restore the entries of a :meth:`state_dict` (of any layout) that this rank holds,
        adding to what is restored already. float32 values round-trip exactly through JSON
        floats. Entries of checkpoints written before the keys were global (an ``expert`` field,
        and one history entry per GEMM call, not per step) are left out: those start afresh."""
        local = _LocalKeys(names, experts)
        for e in state:
            k = (e.get("param"), e.get("global_expert"), e.get("role"))
            if "global_expert" in e and local.holds(k):
                self.scaler(*local.key(k)).restore(e["history"], e["scale"])


def _global_key(key, role, names: dict, experts: dict):
    """A scaler's (name, global expert or None, role), or None for a GEMM on no parameter."""
    pid, e = key if isinstance(key, tuple) else (key, None)
    if pid not in names:
        return None
    return names[pid], None if e is None else experts.get(pid, (0, 0))[0] + e, role


class _LocalKeys:
    """The inverse of ``_global_key`` on this rank: does it hold a (name, global expert, role),
    and under which (key, role) do its GEMMs find it."""

    def __init__(self, names: dict, experts: dict):
        self.ids, self.experts = {n: pid for pid, n in names.items()}, experts

    def holds(self, k) -> bool:
        name, g, _ = k
        if name not in self.ids:
            return False
        first, count = self.experts.get(self.ids[name], (0, 0))
        return g is None or first <= g < first + count

    def key(self, k) -> tuple:
        name, g, role = k
        pid = self.ids[name]
        return (pid if g is None else (pid, g - self.experts[pid][0])), role


class Blockwise(Recipe):
    name = "fp8_blockwise"

    def __init__(self, power_of_2_scales: bool = True):
        self.pow2 = power_of_2_scales

    def fake(self, t, role, axis, key=None, record=True):
        if role == "w" and t.dim() == 2:
            q, s = fp8.quantize_tiles(t, 128, fp8.E4M3, self.pow2)
            return fp8.dequantize_tiles(q, s, 128)
        q, s = fp8.quantize_blockwise(t, axis, 128, fp8.E4M3, self.pow2)
        return fp8.dequantize_blockwise(q, s, axis, 128)

    def quantize_rows(self, x_SD):
        return fp8.quantize_blockwise(x_SD, -1, 128, fp8.E4M3, self.pow2)

    def dequantize_rows(self, q, scales):
        return fp8.dequantize_blockwise(q, scales, -1, 128)


class MXFP8(Recipe):
    name = "mxfp8"
    row_alignment = 32

    def fake(self, t, role, axis, key=None, record=True):
        q, code = mx.quantize_mx(t, axis, fp8.E4M3)
        return mx.dequantize_mx(q, code, axis)


class NVFP4(Recipe):
    name = "nvfp4"
    row_alignment = 32

    def __init__(self, weight_2d: bool = True, rht: bool = True, stochastic_rounding: bool = True,
                 seed: int = 0):
        self.weight_2d, self.use_rht, self.sr = weight_2d, rht, stochastic_rounding
        self.generator = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (nvfp4.BLOCK,), generator=self.generator) * 2 - 1
        self.transform = nvfp4.random_hadamard(signs)
        self._step_start = self.generator.get_state()  # the stream where this step began

    def end_step(self, names: dict, experts: dict, group=None, train: bool = True) -> None:
        """A finished step keeps its draws (the next step starts where it ended); a discarded
        pass (``train`` false: an over-budget or stash-overflow pass about to be rerun, or an
        evaluation, which draws nothing) puts the stream back where the step began, so a
        rerun rounds as the pass it replaces would have."""
        if train:
            self._step_start = self.generator.get_state()
        else:
            self.generator.set_state(self._step_start)

    def fake(self, t, role, axis, key=None, record=True):
        if role == "w" and self.weight_2d and t.dim() == 2:
            return nvfp4.dequantize_nvfp4_tiles(*nvfp4.quantize_nvfp4_tiles(t))
        gen = self.generator if (role == "g" and self.sr) else None
        return nvfp4.dequantize_nvfp4(*nvfp4.quantize_nvfp4(t, axis, gen), axis=axis)

    def wgrad_inputs(self, g_MN, x_MK):
        if not self.use_rht:
            return g_MN, x_MK
        return nvfp4.rht(g_MN, 0, self.transform), nvfp4.rht(x_MK, 0, self.transform)
