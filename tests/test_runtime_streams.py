"""Runtime streams and events (moeplug.runtime.stream): overlap, ordering, errors, lifetimes.

Timing tests use the runtime's `sleep` kernel: sleeping kernels overlap whatever the machine's
load, so "two streams take < 1.5 T, one stream >= 2 T" holds on a busy 2-core box too.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import moeplug.runtime as rt
from moeplug.ops import reference

pytestmark = pytest.mark.serial  # overlap and blocking are judged by wall-clock time

T_US = 300_000  # one sleep kernel: 0.3 s


def _swiglu_args(h: torch.Tensor, a: torch.Tensor) -> dict:
    return dict(h=h.data_ptr(), probs=0, a=a.data_ptr(), num_rows=h.shape[0],
                ffn_hidden=a.shape[1], dtype=0)


def test_same_name_is_the_same_stream():
    assert rt.stream("t.a") is rt.stream("t.a")
    assert rt.stream("t.a") is not rt.stream("t.b")
    assert rt.stream("t.a").name == "t.a"
    with pytest.raises(ValueError, match="non-empty string"):
        rt.stream("")


def test_two_streams_overlap_in_time_and_one_stream_runs_in_order():
    a, b = rt.stream("t.a"), rt.stream("t.b")
    t0 = time.perf_counter()
    a.launch("sleep", microseconds=T_US)
    b.launch("sleep", microseconds=T_US)
    a.synchronize()
    b.synchronize()
    two = time.perf_counter() - t0
    t0 = time.perf_counter()
    a.launch("sleep", microseconds=T_US)
    a.launch("sleep", microseconds=T_US)
    a.synchronize()
    one = time.perf_counter() - t0
    assert two < 1.5 * T_US * 1e-6, f"two streams took {two:.3f} s: they did not overlap"
    assert one >= 2 * T_US * 1e-6, f"one stream took {one:.3f} s: its kernels overlapped"


def _write_then_read(wait: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A sleeps, then writes a = swiglu(h); B reads a (after waiting for A's event if `wait`)."""
    a_stream, b_stream = rt.stream("t.a"), rt.stream("t.b")
    h = torch.randn(4, 6)
    a = torch.zeros(4, 3)
    seen = []
    a_stream.launch("sleep", microseconds=T_US)
    a_stream.launch("swiglu_forward", h, a, **_swiglu_args(h, a))
    written = a_stream.record()
    if wait:
        b_stream.wait(written)
    b_stream.call(lambda: seen.append(a.clone()), name="read_a")
    b_stream.synchronize()
    written.synchronize()
    return seen[0], reference.swiglu(h)


def test_event_wait_orders_work_across_streams():
    seen, want = _write_then_read(wait=True)
    torch.testing.assert_close(seen, want)


def test_without_the_wait_the_reader_runs_too_early():
    # The control for the test above: the same program minus the wait reads the zeros, so
    # that test would fail if wait() did nothing.
    seen, want = _write_then_read(wait=False)
    assert torch.count_nonzero(seen) == 0 and torch.count_nonzero(want) > 0


def test_kernel_error_surfaces_on_the_waiting_side_with_the_kernel_name():
    a_stream, b_stream = rt.stream("t.a"), rt.stream("t.b")
    x = torch.randn(2, 3)
    ids = torch.tensor([[0], [9]])  # 9 is not one of the 2 experts
    x_SD, row_map, counts = torch.empty(2, 3), torch.empty(2, 1, dtype=torch.long), \
        torch.empty(2, dtype=torch.long)
    a_stream.launch("sleep", microseconds=50_000)  # the failure happens after the wait is queued
    a_stream.launch("permute", x, ids, x_SD, row_map, counts, x=x.data_ptr(), ids=ids.data_ptr(),
                    x_out=x_SD.data_ptr(), row_map=row_map.data_ptr(), counts=counts.data_ptr(),
                    num_tokens=2, top_k=1, hidden=3, num_experts=2, dtype=0)
    ran_after = []
    a_stream.call(lambda: ran_after.append(1), name="after")
    event = a_stream.record()
    b_stream.wait(event)
    msg = r"stream 't\.a': kernel 'permute' failed: permute: ids\[1, 0\] = 9"
    with pytest.raises(rt.KernelError, match=msg):
        b_stream.synchronize()
    with pytest.raises(rt.KernelError, match=msg):
        event.synchronize()
    with pytest.raises(RuntimeError, match=msg):  # KernelError is a RuntimeError
        a_stream.synchronize()
    assert ran_after == [], "work queued behind a failed kernel must not run"
    a_stream.synchronize()  # the error was reported once and cleared
    b_stream.synchronize()


def test_python_callable_error_names_the_callable():
    s = rt.stream("t.a")

    def exploding():
        raise ValueError("boom")

    s.call(exploding)
    msg = r"kernel '\S+\.<locals>\.exploding' failed: ValueError: boom"
    with pytest.raises(rt.KernelError, match=msg):
        s.synchronize()


def test_synchronizing_a_stream_from_its_own_kernel_fails_instead_of_hanging():
    s = rt.stream("t.a")
    s.call(s.synchronize, name="self_sync")
    with pytest.raises(rt.KernelError, match="kernel 'self_sync' failed: .*wait for itself"):
        s.synchronize()


def test_with_stream_queues_launches_and_outside_they_run_inline():
    s = rt.stream("t.a")
    h = torch.randn(5, 8)
    a = torch.zeros(5, 4)
    t0 = time.perf_counter()
    with s:
        assert rt.current_stream() is s
        rt.launch("sleep", microseconds=T_US)
        rt.launch("swiglu_forward", h, a, **_swiglu_args(h, a))
        queued = time.perf_counter() - t0
        assert torch.count_nonzero(a) == 0  # still queued behind the sleep
    assert rt.current_stream() is None
    s.record().synchronize()
    assert queued < 0.5 * T_US * 1e-6, f"launch inside `with stream:` blocked for {queued:.3f} s"
    torch.testing.assert_close(a, reference.swiglu(h))

    t0 = time.perf_counter()
    rt.launch("sleep", microseconds=T_US)  # no current stream: runs here, now
    assert time.perf_counter() - t0 >= T_US * 1e-6


def test_stream_keeps_launched_tensors_alive_until_the_kernel_ran():
    s = rt.stream("t.a")
    h = torch.randn(3, 4)
    a = torch.zeros(3, 2)
    h_ref = weakref.ref(h)
    want = reference.swiglu(h)
    gate = threading.Event()
    s.call(gate.wait, name="gate")  # holds the queue until the checks below are done
    s.launch("swiglu_forward", h, a, **_swiglu_args(h, a))
    del h
    gc.collect()
    assert h_ref() is not None, "the queued kernel's input was freed before it ran"
    gate.set()
    s.synchronize()
    gc.collect()
    assert h_ref() is None, "the stream kept the input after the kernel ran"
    torch.testing.assert_close(a, want)


def test_unknown_kernel_names_the_known_ones():
    with pytest.raises(ValueError, match="'nope' is not a runtime kernel.*permute"):
        rt.stream("t.a").launch("nope")
    with pytest.raises(ValueError, match="'nope' is not a runtime kernel"):
        rt.launch("nope")
