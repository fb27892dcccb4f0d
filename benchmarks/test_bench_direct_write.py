"""direct_write at 4 ranks on one machine: dispatch + combine of 4096 tokens x D 1024, top-8 of 64
experts (uniform random routing), fp32 and bf16, timed interleaved on every rank against

* the ``alltoall`` dispatcher over gloo (same routing, same dispatch + combine): target >= 5x;
* a memcpy of the same bytes: the T*K rows of D the round trip moves, there and back, copied
  with ``ctypes.memmove`` (one thread per rank, as the ranks' kernels): target >= 50 %.

Every rank runs one thread (moeplug.testing.distributed), so 4 ranks share the machine's cores
with each other and with whatever else runs there. Every candidate is timed from a barrier to a
barrier, so each figure is the time all 4 ranks take to move their bytes (a barrier's ~0.1 ms
is in every figure); ratios come from one run, rank 0's medians.
``MOEPLUG_BENCH_DW_REPEATS`` (default 7) sets the rounds per candidate.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from benchmarks.conftest import interleave
from moeplug.testing.distributed import run_distributed

WORLD, T, D, E, K = 4, 4096, 1024, 64, 8
REPEATS = int(os.environ.get("MOEPLUG_BENCH_DW_REPEATS", "7"))


def _model():
    from moeplug.config import ModelConfig, MoEConfig
    return ModelConfig(hidden_size=D, num_heads=8, num_kv_heads=8, num_layers=1, first_k_dense=0,
                       dense_ffn_hidden_size=D, max_seq_len=T,
                       moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=D))


def _round_trips(rank: int, world: int, dtypes: list[str]) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    from moeplug.interfaces import RouterOutput
    from moeplug.plugin_host import PluginHost
    host = PluginHost.load()
    group = dist.group.WORLD
    disp = {name: host.create("dispatcher", name, {}, _model(), group)
            for name in ("direct_write", "alltoall")}
    gen = torch.Generator().manual_seed(rank)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    routing = RouterOutput(probs_TK=torch.rand(T, K, generator=gen), ids_TK=ids,
                           aux_loss=torch.zeros(()))
    out = {}
    for dtype in dtypes:
        x = torch.randn(T, D, generator=gen).to(getattr(torch, dtype))
        nbytes = T * K * D * x.element_size()
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1), dst.fill_(2)  # touch the pages before timing

        def round_trip(d):
            def run():
                got = d.dispatch(x, routing)
                d.combine(got.x_SD, got.meta)
            return run

        def memcpy():  # there and back
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
            ctypes.memmove(src.data_ptr(), dst.data_ptr(), nbytes)

        def all_ranks(fn):  # timed until every rank is done
            return lambda: (fn(), dist.barrier())

        candidates = {"direct_write": round_trip(disp["direct_write"]),
                      "alltoall": round_trip(disp["alltoall"]), "memcpy": memcpy}
        # Every candidate is timed from a barrier to the next one: the time the 4 ranks take to
        # move their bytes. Timed alone on rank 0, the memcpy read whatever share of the 2 cores
        # rank 0 happened to get while the others were still finishing the previous candidate
        # or not yet started (16-50 ms for the same bytes), where a collective must wait for all.
        out[dtype] = interleave({k: all_ranks(fn) for k, fn in candidates.items()},
                                repeats=REPEATS, warmup=1, sync=dist.barrier)
        out[dtype]["bytes"] = 2 * nbytes
        dist.barrier()
    return out


@pytest.mark.parametrize("dtypes", [["float32", "bfloat16"]])
def test_direct_write_round_trip_vs_alltoall_and_memcpy(report, dtypes):
    res = run_distributed(_round_trips, WORLD, dtypes, timeout=900, pg_timeout=600)[0]
    load = os.getloadavg()[0]  # the machine is shared: the ratios mean little without it
    for dtype, t in res.items():
        note = (f"{t['direct_write'] * 1e3:.0f} ms vs alltoall {t['alltoall'] * 1e3:.0f} ms, "
                f"memcpy {t['memcpy'] * 1e3:.0f} ms ({t['bytes'] / 1e6:.0f} MB there+back/rank); "
                f"load {load:.1f}")
        report.row(f"direct_write EP4 {dtype}", "alltoall time / direct_write time",
                   t["alltoall"] / t["direct_write"], target=5.0, note=note)
        report.row(f"direct_write EP4 {dtype}", "memcpy time / direct_write time",
                   t["memcpy"] / t["direct_write"], target=0.5, note=note)
        assert t["direct_write"] > 0 and t["alltoall"] > 0 and t["memcpy"] > 0
