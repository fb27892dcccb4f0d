"""The ``runtime:`` section: paged stash, sync-free MoE, capture, the offload tier."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from moeplug.config._checks import _check_fields, _fail, _non_negative, _positive

# The precisions the sync-free region runs (moeplug.moe.budgeted): autocast's dtypes and
# the built-in emulated recipes (moeplug.quant), whose expert GEMMs it runs over its budget rows.
SYNC_FREE_PRECISIONS = ("fp32", "bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise",
                        "mxfp8", "nvfp4")


@dataclass(kw_only=True, slots=True)
class RuntimeSection:
    """The ``runtime:`` section: the paged stash of the routed experts' saved activations
    (moeplug.runtime.stash). Off by default: on the CPU the copy into the pool costs step time and
    saves no memory the pool does not itself hold (see docs/runtime.md, "Paged stash")."""

    stash: bool = False
    stash_page_bytes: int = 65536  # a multiple of 64: every dtype stays aligned
    stash_pages: int = 0  # 0: the sum of the registered layers' reservations
    stash_overflow: str = "rerun"  # rerun (once, without stash) | fail | keep
    # Sync-free MoE (moeplug.moe.budgeted): static shapes from a per-rank token budget,
    # no host synchronisation; a step over budget reruns once on the dynamic path.
    sync_free: bool = False
    token_budget: float = 2.0  # rows per (rank, expert) = ceil(T*K/E * token_budget)
    capture: bool = False  # capture the static region once, replay it every step (sync_free)
    # (Which of these combine, and with the rest of the run: moeplug.config.modes.)
    # The second tier (model.offload's target): an unlinked sparse file in offload_dir ("" =
    # the system temp directory; a tmpfs there saves no RAM), offload_max_bytes of address range.
    offload_dir: str = ""
    offload_max_bytes: int = 64 << 30
    offload_min_bytes: int = 65536  # smaller saved tensors are not worth a copy: they stay

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("sync_free", "capture"):
            if not isinstance(getattr(self, name), bool):
                _fail(self, name, getattr(self, name), "must be a boolean",
                      f"write {name}: true or false")
        if (isinstance(self.token_budget, bool) or not isinstance(self.token_budget, (int, float))
                or not math.isfinite(self.token_budget) or self.token_budget <= 0):
            _fail(self, "token_budget", self.token_budget, "must be a finite number > 0",
                  "use e.g. token_budget: 2.0 (rows per expert = 2x the balanced load)")
        if not isinstance(self.stash, bool):
            _fail(self, "stash", self.stash, "must be a boolean", "write stash: true or false")
        _positive(self, "stash_page_bytes")
        if self.stash_page_bytes % 64:
            _fail(self, "stash_page_bytes", self.stash_page_bytes, "must be a multiple of 64",
                  f"set stash_page_bytes to {-(-self.stash_page_bytes // 64) * 64}")
        _non_negative(self, "stash_pages")
        if isinstance(self.stash_pages, float):
            _fail(self, "stash_pages", self.stash_pages, "must be an integer",
                  "set stash_pages to a whole number of pages (0: sized from the model)")
        _positive(self, "offload_max_bytes")
        _non_negative(self, "offload_min_bytes")
        if self.offload_dir and not os.path.isdir(self.offload_dir):
            _fail(self, "offload_dir", self.offload_dir, "is not an existing directory",
                  "create it, or write offload_dir: \"\" (the system temp directory)")
        if self.stash_overflow not in ("rerun", "fail", "keep"):
            _fail(self, "stash_overflow", self.stash_overflow, "must be rerun, fail or keep",
                  "set stash_overflow: rerun (Megatron's behaviour), fail or keep")

