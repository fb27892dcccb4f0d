"""The ``direct_write`` dispatcher and the shared-memory heap under it (moeplug.parallel.shm_heap).

* one process: the public dispatcher contract (moeplug.testing.check_dispatcher);
* 2 and 4 real gloo ranks: dispatch and combine (single-copy and two-pass) equal ``alltoall``'s -
  the same x_SD, probs_S and counts_L row for row, the same combined output and the same
  gradients w.r.t. tokens and probs - with uneven token counts (one rank with none), dropped choices, pad_to_capacity and
  pad_multiple, in fp32 and bf16 and under an FP8 quantize_dispatch recipe; and the heap grows
  when an op needs more than it holds, or fails naming the option when its size is fixed;
* split start / wait (overlap): several exchanges in flight, waited for out of order, equal
  the synchronous ones bitwise at 2 and 4 ranks; a slow peer's rows are waited for in the wait,
  not in the start;
* the received rows are the heap (no copy out), kept intact by later ops while their tensors
  live and handed back (the same pages reused) when they die;
* the heap leaves nothing in /dev/shm: a rank SIGKILLed mid-run (a real subprocess) leaves no
  segment, and its peer's wait fails naming the dead rank instead of hanging.

Legend: T tokens, D hidden, E experts, K top-k, W ranks, P rows received.
"""

from __future__ import annotations

import glob
import os
import signal
import uuid

import pytest
import torch

from moeplug.testing.distributed import DistributedError, run_distributed

E, K, D = 8, 2, 16
TOKENS = [9, 0, 13, 6]  # per rank (rank 1 sends nothing, still receives)


def _cfg():
    from moeplug.testing._common import tiny_model_config
    return tiny_model_config(num_experts=E, top_k=K, hidden_size=D, ffn_hidden_size=8)


def test_contract_one_process():
    from moeplug.plugin_host import PluginHost
    from moeplug.testing import check_dispatcher
    check_dispatcher(PluginHost.load(), "direct_write")


@pytest.mark.parametrize("E_, L, N", [(8, 2, 64), (64, 16, 32768), (6, 6, 1), (4, 1, 0)])
def test_place_rows_kernel_equals_the_stable_sort(E_, L, N):
    """The runtime's place_rows (the plan's per-choice part) equals the torch stable-sort form
    exactly: every expert present or absent, dropped choices (id E) scattered among them."""
    from moeplug_plugins.dispatchers._dw_plan import place_rows_reference

    from moeplug.runtime import get_runtime
    gen = torch.Generator().manual_seed(N + E_)
    # skewed ids so some experts get nothing; about 1 in 8 dropped
    ids = torch.randint(0, E_, (N,), generator=gen) * torch.randint(0, 2, (N,), generator=gen)
    ids = torch.where(torch.rand(N, generator=gen) < 0.125, E_, ids)
    base = torch.randint(0, 1000, (E_,), generator=gen)
    got = [torch.full_like(ids, 7) for _ in range(3)]
    scratch = torch.empty(2 * E_ + 1, dtype=torch.int64)
    get_runtime().place_rows(ids=ids.data_ptr(), num_choices=N, num_experts=E_, local_experts=L,
                             base=base.data_ptr(), scratch=scratch.data_ptr(),
                             row_map=got[0].data_ptr(), dest_rank=got[1].data_ptr(),
                             dest_row=got[2].data_ptr())
    for name, g, want in zip(("row_map", "dest_rank", "dest_row"), got,
                             place_rows_reference(ids, E_, L, base)):
        assert torch.equal(g, want), name
    if N:
        bad = ids.clone()
        bad[N // 2] = E_ + 1
        with pytest.raises(ValueError, match=rf"ids\[{N // 2}\] = {E_ + 1} is not an expert id"):
            get_runtime().place_rows(ids=bad.data_ptr(), num_choices=N, num_experts=E_,
                                     local_experts=L, base=base.data_ptr(),
                                     scratch=scratch.data_ptr(), row_map=got[0].data_ptr(),
                                     dest_rank=got[1].data_ptr(), dest_row=got[2].data_ptr())


def test_listed_available_with_its_options_validated():
    from moeplug.plugin_host import PluginError, PluginHost
    host = PluginHost.load()
    assert "direct_write" in host.names("dispatcher")
    for bad, words in (({"heap_bytes": -1}, "heap_bytes = -1: must be >= 0"),
                       ({"heap_bytes": 1000}, "below 1 MiB"),
                       ({"timeout_s": 0}, "timeout_s = 0: must be > 0"),
                       ({"heap_mb": 4}, "unknown option plugins.dispatcher_options.heap_mb")):
        with pytest.raises(PluginError, match=words):
            host.create("dispatcher", "direct_write", bad, _cfg(), None)


def test_listed_unavailable_with_the_reason_without_the_runtime_heap(run_cli,
                                                                    cli_env_without_core):
    # A real `moeplug plugins` in an interpreter where the compiled core cannot be imported.
    proc = run_cli("plugins", env=cli_env_without_core, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.strip().startswith("direct_write "))
    assert ("unavailable: moeplug's C++ runtime core is not importable: simulated missing build. "
            "Fix: `pip install -e ." in line), line
    alltoall = next(l for l in proc.stdout.splitlines() if l.strip().startswith("alltoall "))
    assert "unavailable" not in alltoall


def test_communicators_listed_with_the_reason():
    from moeplug.runtime import runtime_info
    comm = runtime_info()["communicators"]
    assert comm["shm_heap"].startswith("available")
    if not torch.cuda.is_available():
        assert comm["nccl"] == "unavailable: torch sees no GPU"
    assert comm["nvshmem"].startswith(("unavailable: ", "installed ("))


@pytest.mark.cuda
def test_cuda_tokens_are_refused_naming_the_fix():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: the refusal is of CUDA tensors")
    from moeplug.plugin_host import PluginHost
    disp = PluginHost.load().create("dispatcher", "direct_write", {}, _cfg(), None)
    from moeplug.testing.dispatcher import random_routing
    r = random_routing(3, E, K, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="use plugins.dispatcher=alltoall on GPU"):
        disp.dispatch(torch.randn(3, D, device="cuda"), r)


def test_ranks_on_two_machines_are_refused_naming_them():
    from moeplug.parallel.shm_heap import check_one_machine
    check_one_machine(["a/1", "a/1"])
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] on a; ranks \[1\] on b\. Fix: use "
                                         r"dispatcher alltoall"):
        check_one_machine(["a/1", "b/2", "a/1"])


# ---- multi-rank parity with alltoall ------------------------------------------------------------

def _routing(T: int, gen: torch.Generator, case: str, world: int):
    from moeplug.interfaces import RouterOutput
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    probs = torch.rand(T, K, generator=gen).requires_grad_()
    dropped = torch.rand(T, K, generator=gen) < 0.3 if case != "plain" else None
    capacity = T * K if case == "pad_to_capacity" else None  # never below what a rank keeps
    pad = 4 if case == "pad_multiple" else 1
    return RouterOutput(probs_TK=probs, ids_TK=ids, aux_loss=torch.zeros(()), dropped_TK=dropped,
                        capacity=capacity, pad_multiple=pad)


def _round_trip(disp, x_TD, routing, w_SD_seed: int):
    """dispatch -> rows scaled per row (expert stand-in) -> combine; loss = sum(y * w)."""
    x = x_TD.clone().requires_grad_()
    probs = routing.probs_TK.detach().clone().requires_grad_()
    r = type(routing)(**{**routing.__dict__, "probs_TK": probs})
    d = disp.dispatch(x, r)
    scale_S = torch.arange(1, d.x_SD.shape[0] + 1, dtype=torch.float32) / d.x_SD.shape[0]
    y_SD = d.x_SD * (d.probs_S * scale_S).unsqueeze(-1).to(d.x_SD.dtype)
    y = disp.combine(y_SD, d.meta)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(w_SD_seed)).to(y.dtype)
    (y.float() * w.float()).sum().backward()
    return {"x_SD": d.x_SD.detach(), "probs_S": d.probs_S.detach(), "counts_L": d.counts_L,
            "y": y.detach(), "grad_x": x.grad, "grad_probs": probs.grad}


def _parity(rank: int, world: int, dtypes: list[str]) -> dict[str, float]:
    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    from moeplug_plugins.dispatchers import direct_write
    direct_write.PULL_MIN_ROW_BYTES = 0  # these rows are tiny: take the single copy all the same
    host = PluginHost.load()
    group = dist.group.WORLD
    a2a = host.create("dispatcher", "alltoall", {}, _cfg(), group)
    # single_copy: combine pulls the rows out of the peers' memory; off: the two-pass combine
    dws = {"pull": host.create("dispatcher", "direct_write", {"single_copy": True}, _cfg(),
                               group),
           "push": host.create("dispatcher", "direct_write", {"single_copy": False}, _cfg(),
                               group)}
    errs: dict[str, float] = {}
    for dtype in dtypes:
        for case in ("plain", "dropped", "pad_to_capacity", "pad_multiple"):
            gen = torch.Generator().manual_seed(100 + rank)
            T = TOKENS[rank]
            x = torch.randn(T, D, generator=gen).to(getattr(torch, dtype))
            routing = _routing(T, gen, case, world)
            want = _round_trip(a2a, x, routing, 7 + rank)
            for mode, dw in dws.items():
                got = _round_trip(dw, x, routing, 7 + rank)
                for key in want:
                    a, b = got[key], want[key]
                    ok = a.shape == b.shape and a.dtype == b.dtype
                    errs[f"{mode}/{dtype}/{case}/{key}"] = (
                        float("inf") if not ok else 0.0 if not a.numel()
                        else (a.float() - b.float()).abs().max().item())
            # the case bites: every rank receives rows; padding cases add zero rows somewhere
            errs[f"{dtype}/{case}/rows_received"] = float(want["x_SD"].shape[0] > 0)
            padded = torch.tensor(float(want["x_SD"].shape[0] > int((want["probs_S"] > 0).sum())))
            dist.all_reduce(padded, op=dist.ReduceOp.MAX)
            errs[f"{dtype}/{case}/padded_somewhere"] = float(bool(padded) == case.startswith("pad"))
    # the pull path really ran where the probe allows it (single_copy_ran 1.0 on every rank)
    errs["single_copy_ran"] = float(dws["pull"]._heap().single_copy)
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_equal_alltoall(world):
    results = run_distributed(_parity, world, ["float32", "bfloat16"], timeout=180)
    flags = ("rows_received", "padded_somewhere")
    bad = {f"rank {r}: {k}": v for r, errs in enumerate(results) for k, v in errs.items()
           if k != "single_copy_ran" and v != (1.0 if k.endswith(flags) else 0.0)}
    # Same rows, same kernels' summation order: bitwise equal, not merely close.
    assert not bad, f"direct_write differs from alltoall at {world} ranks: {bad}"
    assert len(results[0]) == 2 * 4 * (2 * 6 + 2) + 1
    if not all(r["single_copy_ran"] for r in results):
        pytest.skip("process_vm_readv is refused between the ranks here (Yama/seccomp), so the "
                    "single-copy combine fell back to the two-pass one (which matched)")


# ---- split start / wait (overlap): several exchanges in flight -------------------------------

def _split_round_trip(disp, xs, routings, w_seed: int, split: bool):
    """Three micro-batches through dispatch -> stand-in experts -> combine, then one backward.
    ``split``: as moeplug.moe.overlap pipelines them - up to three exchanges in flight,
    waited for out of order; else one synchronous exchange after the other."""
    xs = [x.clone().requires_grad_() for x in xs]
    probs = [r.probs_TK.detach().clone().requires_grad_() for r in routings]
    rs = [type(r)(**{**r.__dict__, "probs_TK": p}) for r, p in zip(routings, probs)]

    def experts(d):
        scale_S = torch.arange(1, d.x_SD.shape[0] + 1, dtype=torch.float32) / d.x_SD.shape[0]
        return d.x_SD * (d.probs_S * scale_S).unsqueeze(-1).to(d.x_SD.dtype)

    if split:
        p0, p1 = disp.dispatch_start(xs[0], rs[0]), disp.dispatch_start(xs[1], rs[1])
        d0 = disp.dispatch_wait(p0)
        p2 = disp.dispatch_start(xs[2], rs[2])
        c0 = disp.combine_start(experts(d0), d0.meta)
        d1 = disp.dispatch_wait(p1)
        c1 = disp.combine_start(experts(d1), d1.meta)
        d2 = disp.dispatch_wait(p2)
        c2 = disp.combine_start(experts(d2), d2.meta)
        ys = [None, disp.combine_wait(c1), None]
        ys[0], ys[2] = disp.combine_wait(c0), disp.combine_wait(c2)
        ds = [d0, d1, d2]
    else:
        ds = [disp.dispatch(x, r) for x, r in zip(xs, rs)]
        ys = [disp.combine(experts(d), d.meta) for d in ds]
    gen = torch.Generator().manual_seed(w_seed)
    loss = sum((y.float() * torch.randn(y.shape, generator=gen)).sum() for y in ys)
    in_flight = _InFlight.most
    _InFlight.most = 0
    loss.backward()
    _InFlight.seen.append((in_flight, _InFlight.most))
    _InFlight.most = 0
    return {**{f"x_SD{i}": d.x_SD.detach().clone() for i, d in enumerate(ds)},
            **{f"y{i}": y.detach() for i, y in enumerate(ys)},
            **{f"grad_x{i}": x.grad for i, x in enumerate(xs)},
            **{f"grad_probs{i}": p.grad for i, p in enumerate(probs)}}


class _InFlight:
    """Heap ops published and not yet waited for (most at once, per phase)."""
    open: set = set()
    most = 0
    seen: list = []  # (forward, backward) per round trip

    @classmethod
    def install(cls):
        from moeplug.parallel.shm_heap import SymmetricHeap
        publish, wait = SymmetricHeap.publish_done, SymmetricHeap.wait_done

        def publish_done(heap, seq):
            cls.open.add(seq)
            cls.most = max(cls.most, len(cls.open))
            publish(heap, seq)

        def wait_done(heap, seq):
            wait(heap, seq)
            cls.open.discard(seq)
        SymmetricHeap.publish_done, SymmetricHeap.wait_done = publish_done, wait_done


def _split(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    from moeplug_plugins.dispatchers import direct_write
    direct_write.PULL_MIN_ROW_BYTES = 0  # tiny rows: take the single copy all the same
    host = PluginHost.load()
    group = dist.group.WORLD
    errs = {"overlaps_comm": float(host.create("dispatcher", "direct_write", {}, _cfg(),
                                               group).overlaps_comm)}
    _InFlight.install()
    for mode, options in (("pull", {"single_copy": True}), ("push", {})):
        dw = host.create("dispatcher", "direct_write", options, _cfg(), group)
        for case in ("dropped", "pad_to_capacity"):
            gen = torch.Generator().manual_seed(200 + rank)
            xs = [torch.randn(TOKENS[(rank + i) % 4], D, generator=gen) for i in range(3)]
            routings = [_routing(x.shape[0], gen, case, world) for x in xs]
            want = _split_round_trip(dw, xs, routings, 9 + rank, split=False)
            got = _split_round_trip(dw, xs, routings, 9 + rank, split=True)
            # ops in flight (forward, backward): one at a time, then up to three - the
            # backward too (each wait node's backward starts its op, the start node's waits)
            errs[f"{mode}/{case}/in_flight"] = float(_InFlight.seen[-2:] != [(1, 1), (3, 3)])
            for key in want:
                a, b = got[key], want[key]
                errs[f"{mode}/{case}/{key}"] = (
                    float("inf") if a.shape != b.shape else 0.0 if not a.numel()
                    else (a - b).abs().max().item())
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_split_start_wait_with_exchanges_in_flight_equals_one_at_a_time(world):
    """Three micro-batches pipelined through dispatch_start/_wait and combine_start/_wait (up to
    three exchanges in flight, waited for out of order, in the forward and in the backward;
    pulled and pushed combine; dropped choices and pad-to-capacity) equal the synchronous
    exchanges bitwise: rows, outputs and the gradients w.r.t. tokens and probs."""
    results = run_distributed(_split, world, timeout=120)
    bad = {f"rank {r}: {k}": v for r, e in enumerate(results) for k, v in e.items()
           if v != (1.0 if k == "overlaps_comm" else 0.0)}
    assert not bad, bad
    assert len(results[0]) == 1 + 2 * 2 * 13


def _slow_peer(rank: int, world: int, delay_s: float) -> dict:
    """Rank 1 writes its rows ``delay_s`` late (after arriving: its counts are in time). Rank 0
    starts, then waits at once: its start must not wait for rank 1's rows, its wait must."""
    import time

    import torch.distributed as dist

    from moeplug.parallel import shm_rows
    from moeplug.plugin_host import PluginHost
    from moeplug.runtime import get_runtime
    from moeplug_plugins.dispatchers import direct_write

    class _Late:  # the runtime, with this rank's row writes (and pulls) delayed
        def __getattr__(self, name):
            fn = getattr(get_runtime(), name)
            if rank != 1 or name not in ("scatter_rows", "copy_chunks", "pull_sum_rows"):
                return fn
            return lambda **kw: (time.sleep(delay_s), fn(**kw))[1]

    direct_write.PULL_MIN_ROW_BYTES = 0
    host = PluginHost.load()
    group = dist.group.WORLD
    a2a = host.create("dispatcher", "alltoall", {}, _cfg(), group)
    out = {}
    for mode, options in (("push", {}), ("pull", {"single_copy": True})):
        dw = host.create("dispatcher", "direct_write", options, _cfg(), group)
        gen = torch.Generator().manual_seed(40 + rank)
        x = torch.randn(12, D, generator=gen)
        routing = _routing(12, gen, "plain", world)
        want = a2a.dispatch(x, routing)
        want_y = a2a.combine(want.x_SD * 3, want.meta)
        heap = dw._heap()
        heap.data(heap.rank, heap.data_bytes).view(torch.float32).fill_(float("nan"))
        dist.barrier()  # no rank writes before every rank has poisoned its heap
        shm_rows.get_runtime = _Late
        try:
            t0 = time.perf_counter()
            pending = dw.dispatch_start(x, routing)
            t1 = time.perf_counter()
            d = dw.dispatch_wait(pending)
            t2 = time.perf_counter()
            rows = d.x_SD.clone()  # as the wait left them (x_SD is the heap: it changes on)
            c = dw.combine_start(d.x_SD * 3, d.meta)
            t3 = time.perf_counter()
            y = dw.combine_wait(c)
            t4 = time.perf_counter()
        finally:
            shm_rows.get_runtime = get_runtime
        out[mode] = {"rows": torch.equal(rows, want.x_SD), "y": torch.equal(y, want_y),
                     "start": t1 - t0, "wait": t2 - t1, "cstart": t3 - t2, "cwait": t4 - t3}
    return out


def test_wait_waits_for_a_slow_peers_rows_and_start_does_not():
    delay = 1.0
    results = run_distributed(_slow_peer, 2, delay, timeout=120)
    for mode in ("push", "pull"):
        r0 = results[0][mode]
        assert all(r[mode]["rows"] and r[mode]["y"] for r in results), (mode, results)
        # rank 0's own work is quick; it blocks in the waits, for rank 1's late writes (dispatch,
        # pushed combine) or late reads of its y_SD (pulled combine)
        assert r0["start"] < delay / 2 and r0["wait"] > delay * 0.8, (mode, r0)
        assert r0["cstart"] < delay / 2 and r0["cwait"] > delay * 0.8, (mode, r0)


def _quantized(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    from moeplug.quant.linear import recipe_scope
    from moeplug.quant.recipes import MXFP8, Blockwise
    host = PluginHost.load()
    group = dist.group.WORLD
    errs = {}
    for name, recipe in (("fp8_blockwise", Blockwise()), ("mxfp8", MXFP8())):
        gen = torch.Generator().manual_seed(5 + rank)
        T = (9, 5)[rank]  # both ranks hold tokens: alltoall's quantizer refuses 0 rows
        x = torch.randn(T, 64, generator=gen)
        from moeplug.testing._common import tiny_model_config
        cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=64, ffn_hidden_size=8)
        routing = _routing(T, gen, "pad_multiple", world)
        outs = {}
        for disp in ("alltoall", "direct_write"):
            with recipe_scope(recipe):
                outs[disp] = _round_trip(host.create("dispatcher", disp, {}, cfg, group), x,
                                         routing, 3)
        for key in outs["alltoall"]:
            a, b = outs["direct_write"][key], outs["alltoall"][key]
            errs[f"{name}/{key}"] = 0.0 if not a.numel() else (a - b).abs().max().item()
        # the payload really was quantized: rows differ from the unquantized input rows
        errs[f"{name}/quantized"] = float(outs["alltoall"]["x_SD"].numel() == 0 or not torch.equal(
            outs["alltoall"]["x_SD"], _round_trip(host.create("dispatcher", "alltoall", {}, cfg,
                                                              group), x, routing, 3)["x_SD"]))
    return errs


def test_quantized_payload_equals_alltoall():
    results = run_distributed(_quantized, 2, timeout=120)
    bad = {f"rank {r}: {k}": v for r, e in enumerate(results) for k, v in e.items()
           if v != (1.0 if k.endswith("/quantized") else 0.0)}
    assert not bad, bad


def _growth(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moeplug.parallel.shm_heap import MiB
    from moeplug.plugin_host import PluginHost
    from moeplug.testing._common import tiny_model_config
    host = PluginHost.load()
    cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=512, ffn_hidden_size=8)
    dw = host.create("dispatcher", "direct_write", {}, cfg, dist.group.WORLD)
    a2a = host.create("dispatcher", "alltoall", {}, cfg, dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1024, 512, generator=gen)  # 2048 rows * 2 KiB per rank: beyond 1 MiB
    routing = _routing(1024, gen, "plain", world)
    before = dw._heap().data_bytes
    got, want = _round_trip(dw, x, routing, 1), _round_trip(a2a, x, routing, 1)
    out = {"before": before, "after": dw._heap().data_bytes,
           "err": max((got[k].float() - want[k].float()).abs().max().item() for k in want)}
    # Grown while another dispatch is in flight (its rows in the old segment, its DONE to be
    # waited for on the new one): both still land.
    fresh = host.create("dispatcher", "direct_write", {}, cfg, dist.new_group([0, 1]))
    small = _routing(8, gen, "plain", world)
    p_small = fresh.dispatch_start(x[:8], small)
    p_big = fresh.dispatch_start(x, routing)
    rows = [fresh.dispatch_wait(p).x_SD for p in (p_small, p_big)]
    out["in_flight_grew"] = fresh._heap().data_bytes > MiB
    out["in_flight_equal"] = (torch.equal(rows[0], a2a.dispatch(x[:8], small).x_SD)
                              and torch.equal(rows[1], want["x_SD"]))
    fixed = host.create("dispatcher", "direct_write", {"heap_bytes": MiB}, cfg,
                        dist.new_group([0, 1]))
    try:
        fixed.dispatch(x, routing)
    except ValueError as exc:
        out["fixed_error"] = str(exc)
    return out


def test_heap_grows_on_demand_and_a_fixed_size_fails_naming_the_option():
    results = run_distributed(_growth, 2, timeout=120)
    for r in results:
        assert r["before"] == 1 << 20 and r["after"] > 4 << 20, r
        assert r["err"] == 0.0
        assert r["in_flight_grew"] and r["in_flight_equal"], r
        assert ("plugins.dispatcher_options.heap_bytes = 1048576 is too small" in r["fixed_error"]
                and "Fix: set plugins.dispatcher_options.heap_bytes >=" in r["fixed_error"]), r


def _zero_copy(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    host = PluginHost.load()
    group = dist.group.WORLD
    dw = host.create("dispatcher", "direct_write", {}, _cfg(), group)
    a2a = host.create("dispatcher", "alltoall", {}, _cfg(), group)
    gen = torch.Generator().manual_seed(30 + rank)
    xa, xb = torch.randn(11, D, generator=gen), torch.randn(11, D, generator=gen)
    ra = _routing(11, gen, "pad_multiple", world)
    rb = _routing(11, gen, "plain", world)
    heap = dw._heap()
    kept = dw.dispatch(xa, ra)  # x_SD of layer "a", kept (as autograd keeps it for backward)
    lo = heap.data_ptr(heap.rank)
    out = {"in_heap": lo <= kept.x_SD.data_ptr() < lo + heap.data_bytes,
           "held": heap.held_bytes}
    # Later ops (another layer's dispatch + combine) must not land on the kept rows.
    other = dw.dispatch(xb, rb)
    dw.combine(other.x_SD * 2, other.meta)
    want = a2a.dispatch(xa, ra)
    out["kept_equal"] = torch.equal(kept.x_SD, want.x_SD) and torch.equal(kept.probs_S,
                                                                          want.probs_S)
    addr = kept.x_SD.data_ptr()
    del kept, other
    out["held_after"] = heap.held_bytes
    # Its bytes came back: the same dispatch lands on the same pages again (no fresh memory).
    again = dw.dispatch(xa, ra)
    out["reused"] = again.x_SD.data_ptr() == addr
    return out


def test_received_rows_live_in_the_heap_until_their_tensors_die():
    for r in run_distributed(_zero_copy, 2, timeout=120):
        assert r["in_heap"] and r["held"] > 0, r          # x_SD is the heap, not a copy of it
        assert r["kept_equal"], r                        # untouched by the ops after it
        assert r["held_after"] == 0 and r["reused"], r   # freed when its tensors died


def test_arena_takes_from_the_largest_run_and_coalesces():
    from moeplug.parallel.shm_heap import PAGE, _Arena
    arena = _Arena(None, 8 * PAGE)
    assert arena.largest() == (0, 8 * PAGE)
    for at, n in ((0, PAGE), (PAGE, 2 * PAGE - 5), (3 * PAGE, PAGE)):  # a, b (rounded up), c
        arena.take_at(at, n)
    assert arena.largest() == (4 * PAGE, 4 * PAGE)
    arena.give_back(PAGE, 2 * PAGE - 5)                      # b: a 2-page hole
    assert arena.largest() == (4 * PAGE, 4 * PAGE)           # the larger run, not the first
    arena.take_at(4 * PAGE, 3 * PAGE)
    assert arena.largest() == (PAGE, 2 * PAGE)
    arena.give_back(0, PAGE)
    arena.give_back(3 * PAGE, PAGE)                          # a, hole, c coalesce: one run
    assert arena.free == [(0, 4 * PAGE), (7 * PAGE, PAGE)]
    with pytest.raises(RuntimeError, match="are not free"):
        arena.take_at(6 * PAGE, PAGE)                        # still taken: a bug, said loudly
    arena.take_at(0, 0)                                      # nothing to receive: no bytes
    assert arena.largest() == (0, 4 * PAGE)


# ---- crash: nothing left in /dev/shm -----------------------------------------------------------

def _killed_mid_run(rank: int, world: int, tag: str) -> str:
    import torch.distributed as dist

    from moeplug.parallel.shm_heap import SymmetricHeap
    heap = SymmetricHeap(dist.group.WORLD, 1 << 20, 4, timeout_s=60, tag=tag)
    # Unlinked right after set-up, yet both ranks still share the memory.
    assert not glob.glob(f"/dev/shm/moeplug-{tag}-*"), glob.glob(f"/dev/shm/moeplug-{tag}-*")
    seq = heap.arrive(8, [rank + 10])
    assert heap.read_slots(1).reshape(-1).tolist() == [10, 11]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding its mappings, mid-op
    heap.done(seq)  # rank 1 never publishes DONE: must fail naming it, not hang
    return "unreachable"


def test_sigkilled_rank_leaves_no_segment_and_its_peer_fails_naming_it():
    tag = f"kill{uuid.uuid4().hex[:8]}"
    with pytest.raises(DistributedError) as info:
        run_distributed(_killed_mid_run, 2, tag, timeout=120, grace=30)
    failures = info.value.failures
    assert "exited with code -9" in failures[1], failures
    assert ("waited" in failures[0] and "for rank 1" in failures[0]
            and "its process has exited" in failures[0]), failures[0]
    assert not glob.glob(f"/dev/shm/moeplug-{tag}-*")


def test_recycled_buffers_come_back_only_when_their_storage_dies():
    from moeplug.parallel import host_buffers
    shape = (300, 1024)  # 1.2 MB -> the 2 MiB class
    base = host_buffers.free_bytes()
    a = host_buffers.empty(shape, torch.float32)
    a.fill_(1.0)
    view = a[10:20]
    w = torch.randn(1024, 3, requires_grad=True)
    loss = (a @ w).sum()  # autograd saves `a` for w's gradient
    del a, view
    assert host_buffers.free_bytes() == base, "recycled while autograd still holds the tensor"
    loss.backward()
    del loss
    assert host_buffers.free_bytes() == base + (2 << 20)
    b = host_buffers.empty(shape, torch.float32)  # reuses it: the old values are still there
    assert host_buffers.free_bytes() == base and b.shape == shape and b[0, 0].item() == 1.0
    assert host_buffers.empty((3, 4), torch.float32).shape == (3, 4)  # small: plain torch.empty


def test_bad_heap_option_exits_2_in_one_line(run_cli):
    proc = run_cli("train", "--steps", "1", "--set", "plugins.dispatcher=direct_write",
                   "--set", "plugins.dispatcher_options.heap_bytes=-1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "DirectWriteOptions.heap_bytes = -1: must be >= 0. Fix:" in proc.stderr


@pytest.mark.slow
def test_cli_ep2_training_logs_alltoall_losses(run_cli, tiny_config_file, tmp_path):
    # `moeplug train --nproc 2` end to end (launcher, groups, heap set-up in real ranks):
    # direct_write logs the losses alltoall logs.
    from moeplug.training.metrics import read_metrics
    cfg = tiny_config_file(str(tmp_path / "unused"))
    losses = {}
    for disp in ("alltoall", "direct_write"):
        out = str(tmp_path / disp)
        proc = run_cli("train", "--config", cfg, "--out", out, "--nproc", "2", "--steps", "3",
                       "--set", "parallel.ep=2", "--set", f"plugins.dispatcher={disp}",
                       "--set", "train.log_interval=1", "--set", "train.warmup_steps=1",
                       timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[disp] = [r["lm_loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))
                        if r["kind"] == "train"]
    assert len(losses["alltoall"]) == 3
    assert max(abs(a - b) for a, b in zip(losses["alltoall"], losses["direct_write"])) <= 1e-5, \
        losses


def _timeouts(rank: int, world: int) -> dict:
    import datetime

    import torch.distributed as dist

    from moeplug.plugin_host import PluginHost
    from moeplug.testing._common import tiny_model_config
    host = PluginHost.load()
    cfg = tiny_model_config(num_experts=E, top_k=K, hidden_size=8, ffn_hidden_size=8)
    out = {}
    for name, options in (("default", {}), ("set", {"timeout_s": 42.0})):
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=7))
        dw = host.create("dispatcher", "direct_write", options, cfg, group)
        out[name] = dw._heap().timeout_s
    return out


def test_a_peer_wait_fails_after_the_groups_timeout_unless_set():
    """The heap's waits on a hung peer took the option's 300 s default whatever
    parallel.timeout_s said (a fault sweep: a SIGSTOPped rank held its peers 300 s under
    timeout_s 10). Unset, they now fail with the EP group's timeout, as its collectives do."""
    for r in run_distributed(_timeouts, 2, timeout=120):
        assert r == {"default": 7.0, "set": 42.0}, r
