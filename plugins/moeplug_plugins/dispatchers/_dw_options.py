"""Options of the ``direct_write`` dispatcher (no torch here: registration imports this)."""

from __future__ import annotations

from dataclasses import dataclass

from moeplug.api import ConfigError

MiB = 1 << 20
OPTION = "plugins.dispatcher_options.heap_bytes"


@dataclass
class DirectWriteOptions:
    """Options of dispatcher ``direct_write``."""

    # Data bytes of every rank's heap segment. 0: sized from the model (one max_seq_len sequence
    # per rank, fp32 rows) and grown collectively when an op needs more; > 0: fixed, and an op
    # that needs more fails naming this option and the size it needs.
    heap_bytes: int = 0
    # How long a rank waits for a peer's flag before failing with the peer's rank (a dead peer
    # is noticed within 50 ms anyway). None: the EP group's, i.e. parallel.timeout_s, as a
    # collective on a hung peer fails (it was 300 s whatever parallel.timeout_s said).
    timeout_s: float | None = None
    # true: combine reads the expert rows straight out of the peers' memory (Linux cross-memory
    # attach, process_vm_readv) and sums them in cache: one pass over the rows instead of two (a
    # write into the source's heap, then a sum out of it). Used when the heap's set-up probe
    # found it allowed between every pair of ranks (same user; Yama/seccomp may deny it), else
    # the two-pass combine runs and a warning says why. Off by default: since the two-pass
    # kernels were vectorised it is the faster one at every row size measured (4 ranks in lock
    # step, fp32 rows of 4/8/16 KiB: 57 vs 73, 44 vs 61, 43 vs 70 ms per round trip), because
    # process_vm_readv pays a system call's page pinning per row.
    single_copy: bool = False

    def __post_init__(self) -> None:
        if self.heap_bytes < 0:
            raise ConfigError(f"DirectWriteOptions.heap_bytes = {self.heap_bytes}: must be >= 0. "
                              f"Fix: set heap_bytes to 0 (sized from the model) or a byte count")
        if 0 < self.heap_bytes < MiB:
            raise ConfigError(f"DirectWriteOptions.heap_bytes = {self.heap_bytes}: below 1 MiB. "
                              f"Fix: set heap_bytes >= {MiB} or 0 (sized from the model)")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"DirectWriteOptions.timeout_s = {self.timeout_s}: must be > 0. "
                              f"Fix: set timeout_s to a number of seconds, e.g. 300, or leave "
                              f"it unset (parallel.timeout_s)")
