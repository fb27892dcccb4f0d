"""Helpers shared by every benchmark file.

This machine is shared and its speed drifts, so absolute timings from separate runs mean little.
Benchmarks therefore time the op and its baselines *interleaved* in one run (round-robin, so
drift hits all of them alike), compare medians, and report ratios:

    times = interleave({"kernel": f, "memcpy": g}, repeats=7)
    report.row("permute fp32", "vs memcpy", times["memcpy"] / times["kernel"], target=0.5)

Every ``report.row`` ends up in one table printed at the end of the session (also without -s).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest


def interleave_samples(candidates: dict[str, Callable[[], Any]], repeats: int = 5,
                       warmup: int = 1, sync: Callable[[], Any] | None = None
                       ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each candidate timed round-robin ``repeats`` times: per-round wall seconds and process
    CPU seconds (all threads, user + sys). Round r of every candidate ran in the same stretch of
    time, so ratios of round-r samples pair up; CPU time does not count the time this process
    sat descheduled while another one ran, which moves wall time most on a shared machine.
    ``sync`` (untimed) runs before every call: a barrier makes the ranks of a multi-rank
    benchmark start each candidate together, so a one-rank reference (a memcpy) competes for
    cores and memory as the collective it is compared with does, not with whatever candidate
    the other ranks are still finishing."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for fn in candidates.values():
            sync()
            fn()
    wall: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            sync()
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def interleave(candidates: dict[str, Callable[[], Any]], repeats: int = 5,
               warmup: int = 1, sync: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median seconds per call of each candidate, timed round-robin ``repeats`` times."""
    wall, _ = interleave_samples(candidates, repeats, warmup, sync)
    return {name: statistics.median(s) for name, s in wall.items()}


def paired_ratios(samples: dict[str, list[float]], name: str, ref: str) -> list[float]:
    """Round-by-round ratios of ``name`` to ``ref`` (both from one interleave_samples run)."""
    return [a / b for a, b in zip(samples[name], samples[ref])]


def gflops(flop: float, seconds: float) -> float:
    return flop / seconds / 1e9


def gbytes_per_s(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


@dataclass
class Row:
    bench: str
    metric: str
    value: float
    unit: str
    target: float | None
    note: str

    @property
    def status(self) -> str:
        if self.target is None:
            return ""
        return "ok" if self.value >= self.target else "BELOW TARGET"


class Report:
    """Rows collected during the session and printed as one table at the end."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def row(self, bench: str, metric: str, value: float, unit: str = "x",
            target: float | None = None, note: str = "") -> None:
        self.rows.append(Row(bench, metric, value, unit, target, note))

    def table(self) -> str:
        if not self.rows:
            return ""
        w1 = max(len(r.bench) for r in self.rows)
        w2 = max(len(r.metric) for r in self.rows)
        lines = [f"{'benchmark':<{w1}}  {'metric':<{w2}}  {'value':>10}  {'target':>7}  status  note"]
        for r in self.rows:
            target = "" if r.target is None else f"{r.target:.2f}"
            lines.append(f"{r.bench:<{w1}}  {r.metric:<{w2}}  {r.value:>8.3f}{r.unit:<2}  "
                         f"{target:>7}  {r.status:<6}  {r.note}")
        return "\n".join(lines)


_REPORT = Report()


@pytest.fixture(scope="session")
def report() -> Report:
    return _REPORT


_ALLOCATOR: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def host_allocator():
    """glibc's default, as ``moeplug train`` by default; MOEPLUG_BENCH_RETAIN_MEMORY=1 keeps
    freed memory for reuse (train.retain_freed_memory: true) for every candidate alike. (Ranks
    of multi-rank benchmarks are fresh processes and keep glibc's default.)"""
    import os
    if os.environ.get("MOEPLUG_BENCH_RETAIN_MEMORY") == "1":
        from moeplug.runtime import retain_freed_memory
        why_not = retain_freed_memory()
        _ALLOCATOR.append("freed memory retained (MOEPLUG_BENCH_RETAIN_MEMORY=1)" if not why_not
                          else f"glibc default ({why_not})")
    else:
        _ALLOCATOR.append("glibc default")
    yield


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    text = _REPORT.table()
    if text:
        terminalreporter.section("moeplug benchmark ratios (interleaved, medians)")
        terminalreporter.write_line(f"host allocator: {', '.join(_ALLOCATOR) or 'not set'}")
        terminalreporter.write_line(text)
