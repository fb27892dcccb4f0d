"""Differentiable collectives on real gloo groups (2 and 4 ranks) vs a single-process reference.

Each rank's inputs and loss weights are a pure function of (rank, case), so the parent rebuilds
every rank's data, computes the outputs and the gradients of the *sum of all ranks' losses* with
plain torch ops on one process, and compares them with what each rank got from the collectives.
One spawn per world size runs every case (spawning costs more than the collectives).
Also tests the harness itself: tracebacks, a rank dying abruptly, the wall-clock timeout.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from moeplug.parallel import comm
from moeplug.testing.distributed import DistributedError, DistributedTimeout, run_distributed

D = 3  # hidden size of the row tensors


def _rand(tag: str, rank: int, *shape: int) -> torch.Tensor:
    seed = (sum(map(ord, tag)) * 1009 + rank * 7919) % (2**31)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _a2a_splits(world: int) -> list[list[int]]:
    """splits[src][dst]: uneven, with zeros, and rank 0 sends nothing at all."""
    s = [[(3 * src + 5 * dst + 1) % 4 for dst in range(world)] for src in range(world)]
    s[0] = [0] * world
    return s


def _gather_sizes(world: int) -> list[int]:
    return [2, 0, 3, 1][:world]


def _rs_sizes(world: int) -> list[int]:
    return [1, 0, 2, 3][:world]


# --- what each rank runs -------------------------------------------------------------------------

def _collectives(rank: int, world: int) -> dict[str, tuple[torch.Tensor, ...]]:
    import torch.distributed as dist

    g = dist.group.WORLD
    out: dict[str, tuple[torch.Tensor, ...]] = {}

    def run(name: str, x: torch.Tensor, f) -> None:
        x = x.clone().requires_grad_(True)
        y = f(x)
        (y * _rand(name + "w", rank, *y.shape)).sum().backward()
        out[name] = (y.detach(), x.grad)

    splits = _a2a_splits(world)
    run("a2a", _rand("a2a", rank, sum(splits[rank]), D),
        lambda x: comm.all_to_all(x, [splits[s][rank] for s in range(world)], splits[rank], g))
    sizes = _gather_sizes(world)
    run("ag", _rand("ag", rank, sizes[rank], D), lambda x: comm.all_gather(x, g))
    run("ag_sizes", _rand("ag", rank, sizes[rank], D), lambda x: comm.all_gather(x, g, sizes))
    run("rs", _rand("rs", rank, 2 * world, D), lambda x: comm.reduce_scatter(x, g))
    run("rs_uneven", _rand("rsu", rank, sum(_rs_sizes(world)), D),
        lambda x: comm.reduce_scatter(x, g, _rs_sizes(world)))
    run("ar", _rand("ar", rank, 2, D), lambda x: comm.all_reduce(x, g))
    return out


def _regions(rank: int, world: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Megatron's TP/SP mappings inside a tiny tensor-parallel MLP, as a model would use them."""
    import torch.distributed as dist

    g = dist.group.WORLD
    T, H, F_ = 4 * world, 6, 4 * world  # rows, hidden, ffn (both split evenly over the ranks)
    x_full, w1, w2 = _rand("x", 0, T, H), _rand("w1", 0, H, F_), _rand("w2", 0, F_, H)
    f = slice(rank * F_ // world, (rank + 1) * F_ // world)
    w1_r = w1[:, f].clone().requires_grad_(True)
    w2_r = w2[f].clone().requires_grad_(True)
    out = {}

    # Plain TP: replicated input and loss (the same weights on every rank, counted once).
    x = x_full.clone().requires_grad_(True)
    y = comm.reduce_from_tp_region(F.gelu(comm.copy_to_tp_region(x, g) @ w1_r) @ w2_r, g)
    (y * _rand("tpw", 0, T, H)).sum().backward()
    out["tp_mlp"] = (y.detach(), x.grad, w1_r.grad, w2_r.grad)

    # Sequence parallel: rows sharded; per-rank losses on per-rank rows.
    w1_r.grad = w2_r.grad = None
    n = slice(rank * T // world, (rank + 1) * T // world)
    x_N = x_full[n].clone().requires_grad_(True)
    h = comm.gather_from_sp_region(x_N, g)
    y_N = comm.reduce_scatter_to_sp_region(F.gelu(h @ w1_r) @ w2_r, g)
    (y_N * _rand("spw", 0, T, H)[n]).sum().backward()
    out["sp_mlp"] = (y_N.detach(), x_N.grad, w1_r.grad, w2_r.grad)

    # scatter -> per-rank scale -> gather along the last dim, replicated loss.
    x = _rand("xl", 0, T, 2 * world).requires_grad_(True)
    x_r = comm.scatter_to_tp_region(x, g) * (rank + 2)
    y = comm.gather_from_tp_region(x_r, g)
    (y * _rand("lastw", 0, T, 2 * world)).sum().backward()
    out["tp_last_dim"] = (y.detach(), x.grad)

    # scatter rows, per-rank losses; then gather rows without grad reduction, replicated loss.
    x = x_full.clone().requires_grad_(True)
    x_N = comm.scatter_to_sp_region(x, g)
    (x_N * _rand("scw", 0, T, H)[n]).sum().backward()
    out["sp_scatter"] = (x_N.detach(), x.grad)
    x_N = x_full[n].clone().requires_grad_(True)
    y = comm.gather_from_sp_region(x_N, g, tensor_parallel_output_grad=False)
    (y * _rand("gnw", 0, T, H)).sum().backward()
    out["sp_gather_no_reduce"] = (y.detach(), x_N.grad)
    return out


def _worker(rank: int, world: int) -> dict:
    return {**_collectives(rank, world), **_regions(rank, world)}


# --- single-process reference --------------------------------------------------------------------

def _reference_collectives(world: int) -> list[dict[str, tuple[torch.Tensor, ...]]]:
    """Per rank: name -> (output, grad of the summed loss w.r.t. that rank's input)."""
    refs: list[dict] = [{} for _ in range(world)]

    def run(name: str, xs: list[torch.Tensor], f) -> None:
        xs = [x.clone().requires_grad_(True) for x in xs]
        ys = f(xs)
        sum((y * _rand(name + "w", r, *y.shape)).sum() for r, y in enumerate(ys)).backward()
        for r in range(world):
            refs[r][name] = (ys[r].detach(), xs[r].grad)

    splits = _a2a_splits(world)

    def a2a(xs):
        chunks = [torch.split(x, splits[src]) for src, x in enumerate(xs)]
        return [torch.cat([chunks[src][dst] for src in range(world)]) for dst in range(world)]

    run("a2a", [_rand("a2a", r, sum(splits[r]), D) for r in range(world)], a2a)
    sizes = _gather_sizes(world)
    for name in ("ag", "ag_sizes"):
        run(name, [_rand("ag", r, sizes[r], D) for r in range(world)],
            lambda xs: [torch.cat(xs)] * world)
    run("rs", [_rand("rs", r, 2 * world, D) for r in range(world)],
        lambda xs: list(torch.split(sum(xs), 2)))
    run("rs_uneven", [_rand("rsu", r, sum(_rs_sizes(world)), D) for r in range(world)],
        lambda xs: list(torch.split(sum(xs), _rs_sizes(world))))
    run("ar", [_rand("ar", r, 2, D) for r in range(world)], lambda xs: [sum(xs)] * world)
    return refs


def _reference_regions(world: int, rank: int) -> dict[str, tuple[torch.Tensor, ...]]:
    T, H, F_ = 4 * world, 6, 4 * world
    x_full, w1, w2 = _rand("x", 0, T, H), _rand("w1", 0, H, F_), _rand("w2", 0, F_, H)
    f = slice(rank * F_ // world, (rank + 1) * F_ // world)
    n = slice(rank * T // world, (rank + 1) * T // world)
    ref = {}
    for name, w_name in (("tp_mlp", "tpw"), ("sp_mlp", "spw")):
        x, a, b = (t.clone().requires_grad_(True) for t in (x_full, w1, w2))
        y = F.gelu(x @ a) @ b
        (y * _rand(w_name, 0, T, H)).sum().backward()
        rows = slice(None) if name == "tp_mlp" else n
        ref[name] = (y.detach()[rows], x.grad[rows], a.grad[:, f], b.grad[f])
    x = _rand("xl", 0, T, 2 * world).requires_grad_(True)
    y = x * torch.repeat_interleave(torch.arange(2, world + 2, dtype=torch.float64), 2)
    (y * _rand("lastw", 0, T, 2 * world)).sum().backward()
    ref["tp_last_dim"] = (y.detach(), x.grad)
    ref["sp_scatter"] = (x_full[n], _rand("scw", 0, T, H))
    ref["sp_gather_no_reduce"] = (x_full, _rand("gnw", 0, T, H)[n])
    return ref


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process_reference(world):
    got = run_distributed(_worker, world, timeout=120)
    ref_coll = _reference_collectives(world)
    for r in range(world):
        expected = {**ref_coll[r], **_reference_regions(world, r)}
        assert set(got[r]) == set(expected)
        for name, want in expected.items():
            assert len(got[r][name]) == len(want)
            for i, (a, b) in enumerate(zip(got[r][name], want)):
                torch.testing.assert_close(a, b, msg=lambda m: f"rank {r} {name}[{i}]: {m}")
    # Shapes are part of the contract: a rank that sends/receives nothing gets a [0, D] tensor.
    assert got[0]["a2a"][1].shape == (0, D)  # rank 0 sent no rows: its grad has none either
    assert got[1]["ag"][1].shape == (0, D)   # rank 1 contributed no rows to the gather


# --- single-process fast path and argument errors ----------------------------------------------

def test_group_none_is_identity_with_grad():
    x = torch.randn(3, D, requires_grad=True)
    for f in (lambda t: comm.all_to_all(t, [3], [3], None), lambda t: comm.all_gather(t, None),
              lambda t: comm.reduce_scatter(t, None), lambda t: comm.all_reduce(t, None),
              lambda t: comm.copy_to_tp_region(t, None), lambda t: comm.gather_from_sp_region(t, None)):
        y = f(x)
        assert y is x


@pytest.mark.parametrize("call, words", [
    (lambda x: comm.all_to_all(x, [2], [2, 1], None), ["input_splits", "2 entries", "1 ranks", "Fix"]),
    (lambda x: comm.all_to_all(x, [3], [2], None), ["input_splits", "sums to 2", "3 rows", "Fix"]),
    (lambda x: comm.all_to_all(x, [2], [3], None), ["output_splits [2]", "input_splits [3]", "Fix"]),
    (lambda x: comm.all_to_all(x, [3], [-1], None), ["negative", "Fix"]),
    (lambda x: comm.all_gather(x, None, sizes=[5]), ["sizes", "sums to 5", "3 rows", "Fix"]),
    (lambda x: comm.reduce_scatter(x, None, sizes=[1, 2]), ["sizes", "2 entries", "Fix"]),
])
def test_argument_errors_name_the_value_and_fix(call, words):
    with pytest.raises(ValueError) as e:
        call(torch.zeros(3, D))
    for w in words:
        assert w in str(e.value)


def _bad_calls(rank, world):
    """Each call is wrong on every rank, so all ranks raise before any collective starts."""
    import torch.distributed as dist
    messages = []
    for call in (lambda: comm.reduce_scatter(torch.zeros(3, D), dist.group.WORLD),
                 lambda: comm.all_gather(torch.zeros(rank + 1, D), dist.group.WORLD, sizes=[2, 3]),
                 lambda: comm.all_to_all(torch.zeros(2, D), [1], [1, 1], dist.group.WORLD)):
        with pytest.raises(ValueError) as e:
            call()
        messages.append(str(e.value))
    return messages


def test_errors_on_real_group_name_the_value():
    msgs = run_distributed(_bad_calls, 2, timeout=60)
    assert "3 rows, not divisible by the group size 2" in msgs[0][0] and "Fix" in msgs[0][0]
    assert "sizes[0] = 2 but this rank has 1 rows" in msgs[0][1] and "Fix" in msgs[0][1]
    assert "sizes[1] = 3 but this rank has 2 rows" in msgs[1][1]
    assert "output_splits has 1 entries [1] but the group has 2 ranks" in msgs[0][2]


# --- the harness itself ---------------------------------------------------------------------------

def _rank_info(rank, world, tag):
    import torch.distributed as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (tag, rank, world, dist.get_world_size(), t.item(), os.environ.get("OMP_NUM_THREADS"))


def test_harness_returns_results_in_rank_order():
    assert run_distributed(_rank_info, 3, "t") == [("t", r, 3, 3, 3.0, "1") for r in range(3)]


def _raise_on_rank_1(rank, world):
    if rank == 1:
        raise KeyError("boom-from-rank-1")
    return rank


def test_harness_propagates_exception_with_traceback():
    with pytest.raises(DistributedError) as e:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert list(e.value.failures) == [1]
    text = e.value.failures[1]
    assert "boom-from-rank-1" in text and "_raise_on_rank_1" in text and "Traceback" in text


def _die_then_collective(rank, world):
    import torch.distributed as dist
    if rank == 1:
        os._exit(3)  # no exception, no cleanup: like a crashed or OOM-killed process
    t = torch.ones(1)
    dist.all_reduce(t)  # must raise (peer gone or pg timeout), not block forever
    return t.item()


def test_dead_rank_makes_others_error_not_hang():
    start = time.monotonic()
    with pytest.raises(DistributedError) as e:
        run_distributed(_die_then_collective, 2, timeout=60, pg_timeout=10, grace=20)
    assert not isinstance(e.value, DistributedTimeout)
    assert "exited with code 3" in e.value.failures[1]
    # rank 0's own error came from the collective (not from being killed by the harness)
    assert "all_reduce" in e.value.failures[0] and "killed" not in e.value.failures[0]
    assert time.monotonic() - start < 45


def test_harness_starts_over_on_a_new_port_when_rank_0_finds_its_port_taken(monkeypatch):
    """free_port's port can be taken before rank 0 binds it (another process on the machine):
    the run starts over on a new port instead of failing, and a port that stays taken fails
    with rank 0's EADDRINUSE after PORT_ATTEMPTS launches."""
    import socket

    from moeplug.testing import distributed as D
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        real, calls = D.free_port, []

        def first_taken() -> int:
            calls.append(None)
            return taken.getsockname()[1] if len(calls) == 1 else real()
        monkeypatch.setattr(D, "free_port", first_taken)
        assert run_distributed(_rank_info, 2, "p", grace=2) == [("p", r, 2, 2, 1.0, "1")
                                                              for r in range(2)]
        assert len(calls) == 2
        monkeypatch.setattr(D, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(DistributedError) as e:
            run_distributed(_rank_info, 2, "p", grace=2)
        assert "EADDRINUSE" in e.value.failures[0]
    finally:
        taken.close()


def _sleep_forever(rank, world):
    time.sleep(3600)


def test_harness_timeout_kills_children():
    start = time.monotonic()
    with pytest.raises(DistributedTimeout) as e:
        run_distributed(_sleep_forever, 2, timeout=8)
    assert time.monotonic() - start < 20
    assert sorted(e.value.failures) == [0, 1] and "timeout" in str(e.value)


def test_twin_registry_does_not_keep_groups_alive():
    """register_twin holds its keys weakly: a group nobody else holds is dropped, twin and all
    (a strong dict held every group a long-lived process ever built)."""
    import gc
    import weakref

    class Group:  # stands in for a ProcessGroup (which takes weak references too)
        pass

    group, twin = Group(), Group()
    comm.register_twin(group, twin)
    assert comm.has_twin(group)
    group_ref, twin_ref = weakref.ref(group), weakref.ref(twin)
    del group, twin
    gc.collect()
    assert group_ref() is None and twin_ref() is None


# gloo's worker thread lets go of a collective's tensors just after it wakes the caller (see
# comm._Loan). These stand-ins complete at once and keep what they were given for a while
# longer (``hold_s``; None: forever), like that thread descheduled at the wrong moment, so the
# hand-off is exercised deterministically; the real race is tests/test_moe_allocations.py's EP2
# sync-free case, which missed a buffer in 4 of 50 rank-runs before.
class _Completed:
    def wait(self) -> None:
        pass


def _late_release(hold_s: float | None):
    import threading

    def collective(t, group=None, async_op=False):
        t.add_(1)
        held = [t]
        if hold_s is not None:
            threading.Thread(target=lambda: (time.sleep(hold_s), held.clear())).start()
        else:
            _kept.append(held)
        return _Completed()
    return collective


_kept: list = []


def _released_buffer_is_reused(run) -> bool:
    from moeplug.runtime import workspace
    ws = workspace.Workspace()  # a model runtime's, as the MoE layer's arena reaches it
    with ws.scope():
        buf = workspace.empty((1 << 17,), torch.float32)  # 512 KB: the large-buffer cache
        buf.fill_(0)
        run(buf)
        assert float(buf[0]) == 1.0  # the collective ran on the caller's memory
        del buf
        misses = ws.misses()
        assert misses == 1
        workspace.empty((1 << 17,), torch.float32)
        return ws.misses() == misses


def test_a_blocking_collective_returns_once_its_backend_let_go_of_the_buffer():
    slow = _late_release(0.2)
    assert comm._release_timed_out is False
    # Called directly, the buffer is still held when the next request comes: a miss. Through
    # comm.blocking, the same buffer is free again when it returns.
    assert not _released_buffer_is_reused(lambda b: slow(b))
    time.sleep(0.3)
    assert _released_buffer_is_reused(lambda b: comm.blocking(slow, b, group=None))
    assert _released_buffer_is_reused(lambda b: comm.start(slow, b, group=None).wait())


def test_a_backend_that_keeps_the_buffer_costs_one_timeout_and_a_warning(monkeypatch):
    monkeypatch.setattr(comm, "RELEASE_TIMEOUT_S", 0.1)
    monkeypatch.setattr(comm, "_release_timed_out", False)
    keeper = _late_release(None)
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match="kept its tensors"):
        assert not _released_buffer_is_reused(lambda b: comm.blocking(keeper, b, group=None))
    assert 0.1 <= time.monotonic() - started < 5
    started = time.monotonic()
    comm.blocking(keeper, torch.zeros(4), group=None)  # no second wait
    assert time.monotonic() - started < 0.05
    _kept.clear()


def test_waiting_for_one_exchange_ignores_another_in_flight_on_the_same_buffer(monkeypatch):
    # The chunked overlap starts the next chunk's exchange (views of the same buffer, still
    # held) before it waits for this one: the wait must not take that loan for this one's.
    monkeypatch.setattr(comm, "RELEASE_TIMEOUT_S", 5.0)
    monkeypatch.setattr(comm, "_release_timed_out", False)
    buf = torch.zeros(64)
    this = comm.start(_late_release(0.05), buf[:32], group=None)
    other = comm.start(_late_release(None), buf[32:], group=None)  # never lets go
    started = time.monotonic()
    this.wait()
    assert time.monotonic() - started < 1.0 and comm._release_timed_out is False
    del other
    _kept.clear()
