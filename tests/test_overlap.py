"""Overlap on equals overlap off (``model.moe.overlap_chunks``; moeplug.moe.overlap).

Every rank of a real gloo group builds the same model twice from one seed, once with
``overlap_chunks = 1`` (the plain layer) and once with ``CHUNKS`` (uneven chunks: T = 32 tokens
per micro-batch into 3), and runs 3 real ``train_step``s of each on the same batches. Compared
on every rank after every step: the logged loss terms, the global grad norm, every gradient of
the rank; after 3 steps every parameter and the trainer's validation loss (``evaluate`` on
held-out batches). Layouts: EP2, EP4, PP2 x EP2 (1F1B, two micro-batches)
EP2 with capacity dropping + pad-to-capacity, EP2 with the ``allgather`` dispatcher (the
interface's default split methods), EP2 and EP4 with ``direct_write`` (its own split over the
shared-memory heap; capacity on and off, single-copy and two-pass combine; and under the
combined 1F1B at EP2, alone and chunked), and with shared experts everywhere (they run during the
first chunk's dispatch). The combined 1F1B schedule
(``parallel.overlap_moe_expert_parallel_comm``, moeplug.parallel.ep_overlap) is compared the
same way at EP2 (3 micro-batches), EP4, EP2 x DP2 and PP2 x EP2, alone (must be bitwise: same
ops, same order) and together with chunking, and with TP / SP / CP (WORLD4_TPCP: TP2 x SP x EP2,
TP2 x DP2 without SP, CP2 x EP2 with the ring and the all-gather K/V exchange, TP2 x SP x PP2 x
EP2, TP2 x SP x EP2 with the dense MLP recomputed), whose collectives must then run on the
twin groups too; and with expert tensor parallelism (ETP2, ETP2 x EP2, TP2 x SP x ETP2 x EP2,
PP2 x ETP2, ETP2 x EP2 with delayed expert weight gradients),
MLA attention (EP2 with its up projections recomputed, TP2 x SP x EP2) and MTP layers (EP2,
PP2 x EP2 with MLA).

Tolerance (fp32): the forward is bitwise identical here (every token's rows meet the same
weights and are summed in the same order; chunks of >= 4 rows per expert keep the GEMM
library on the same kernels), so the first step's losses must be exactly equal. Gradients are
not all bitwise: an expert's weight gradient sums its rows chunk by chunk, and autograd adds a
tensor's gradient contributions (router, shared experts, routed chunks) in the order their
nodes run, which overlap changes. Step 1 (same parameters) must agree to TOL = 1e-6 absolute
on every gradient and the grad norm (measured ~1e-8). Later steps start from parameters that
AdamW already moved apart: its m / sqrt(v) turns a 1e-9 difference of a near-zero gradient
into a visible one of the update (up to lr), so losses and parameters after 3 steps get
TRAIN_TOL = 1e-4 (measured up to ~2e-5).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from moeplug.testing.distributed import run_distributed, run_layouts

V = 64
CHUNKS = 3
TOL = 1e-6        # step 1 (same parameters): grads and grad norm, absolute
TRAIN_TOL = 1e-4  # steps 2-3 and the final parameters, absolute (lr = 1e-2)

# name -> (parallel overrides, grad_accum_steps, router options, what "on" switches on:
# chunks = model.moe.overlap_chunks, merged = parallel.overlap_moe_expert_parallel_comm)
CAPACITY = {"capacity_factor": 1.0, "pad_to_capacity": True}
CHUNKED, MERGED = {"chunks": CHUNKS}, {"merged": True}
BOTH = {"chunks": CHUNKS, "merged": True}
DW_PULL = {"chunks": CHUNKS, "dispatcher": "direct_write", "pull": True}
DW_PUSH = {"chunks": CHUNKS, "dispatcher": "direct_write"}
HIER = {"dispatcher": "hierarchical", "options": {"node_size": 2}}
DW_MERGED = {"merged": True, "dispatcher": "direct_write"}
RECOMPUTE_MOE = {"recompute": {"granularity": "selective", "modules": ["moe"]}}
RECOMPUTE_FULL = {"recompute": {"granularity": "full"}}
# delay = model.moe.delay_wgrad_compute (moeplug.ops.delayed_wgrad): bitwise like MERGED alone.
DELAY, MERGED_DELAY = {"delay": True}, {"merged": True, "delay": True}
WORLD2 = {"ep2": ({"ep": 2}, 1, {}, CHUNKED), "ep2_capacity": ({"ep": 2}, 1, CAPACITY, CHUNKED),
          # allgather keeps the Dispatcher base class's split methods (exchange in *_start)
          "ep2_allgather": ({"ep": 2}, 1, {}, {"chunks": CHUNKS, "dispatcher": "allgather"}),
          # direct_write splits its exchanges itself (shared-memory heap: *_start writes and
          # publishes, *_wait waits for the peers); "pull": its single-copy combine (option
          # single_copy, on these small rows with direct_write.PULL_MIN_ROW_BYTES = 0), else
          # the two-pass one
          "ep2_direct_write": ({"ep": 2}, 1, {}, DW_PULL),
          "ep2_direct_write_capacity": ({"ep": 2}, 1, CAPACITY, DW_PUSH),
          "ep2_1f1b": ({"ep": 2}, 3, {}, MERGED),
          # direct_write's backward on the helper thread uses the twin group's own heap
          "ep2_1f1b_direct_write": ({"ep": 2}, 3, {}, {**MERGED, "dispatcher": "direct_write"}),
          "ep2_1f1b_chunked_direct_write": ({"ep": 2}, 2, {}, {**BOTH, **DW_PUSH}),
          "ep2_1f1b_chunked": ({"ep": 2}, 2, {}, BOTH),
          "ep2_delay_wgrad": ({"ep": 2}, 2, {}, DELAY),
          "ep2_1f1b_delay_wgrad": ({"ep": 2}, 3, {}, MERGED_DELAY),
          # the MoE layer recomputed (selective "moe", and full): its forward exchanges rerun
          # inside the overlapped backward, on the twin groups (direct_write: the twin's heap),
          # and the checkpoints' RNG saves on both threads (moeplug.modules.recompute._RNG_LOCK)
          "ep2_1f1b_recompute_moe": ({"ep": 2}, 2, {}, MERGED, RECOMPUTE_MOE),
          "ep2_1f1b_recompute_full_direct_write": ({"ep": 2}, 2, {}, DW_MERGED, RECOMPUTE_FULL),
          # the chunked pipeline recomputed: its chunks' exchanges re-issued in the backward
          "ep2_chunked_recompute_moe": ({"ep": 2}, 1, {}, CHUNKED, RECOMPUTE_MOE)}
WORLD4 = {"ep4": ({"ep": 4}, 1, {}, CHUNKED), "ep4_direct_write": ({"ep": 4}, 1, {}, DW_PUSH),
          "ep4_direct_write_capacity": ({"ep": 4}, 1, CAPACITY, DW_PULL),
          "pp2_ep2": ({"pp": 2, "ep": 2}, 2, {}, CHUNKED),
          "ep4_1f1b": ({"ep": 4}, 2, {}, MERGED), "ep2_dp2_1f1b": ({"ep": 2}, 2, {}, MERGED),
          # 3 micro-batches: pipeline rank 0 runs F0 F1 B0 F2 B1 B2 (B0 || F2 overlapped),
          # rank 1 F0 B0 F1 B1 F2 B2 (B0 || F1, B1 || F2).
          "pp2_ep2_1f1b": ({"pp": 2, "ep": 2}, 3, {}, MERGED),
          "pp2_ep2_1f1b_delay_wgrad": ({"pp": 2, "ep": 2}, 3, {}, MERGED_DELAY),
          # hierarchical as 2 nodes x 2 ranks: its node and network subgroups have twins of
          # their own (comm.register_twin), the node heap is the twin group's on the helper
          "ep4_hierarchical_1f1b": ({"ep": 4}, 2, {}, {**MERGED, **HIER}),
          "ep4_hierarchical_chunked": ({"ep": 4}, 1, {}, {"chunks": CHUNKS, **HIER}),
          "pp2_ep2_1f1b_recompute_moe": ({"pp": 2, "ep": 2}, 3, {}, MERGED, RECOMPUTE_MOE),
          "ep4_chunked_direct_write_recompute_full": ({"ep": 4}, 1, {}, DW_PUSH,
                                                      RECOMPUTE_FULL)}
# Combined 1F1B with tensor / sequence / context parallelism: their collectives (SP gathers and
# reduce-scatters, TP all-reduces, the vocab-parallel loss, the CP K/V exchange) run inside the
# overlapped backward on the twin groups; still bitwise. 2 micro-batches (3 with PP2).
SP = {"tp": 2, "sequence_parallel": True}
WORLD4_TPCP = {"tp2_sp_ep2_1f1b": ({**SP, "ep": 2}, 2, {}, MERGED),
               "tp2_dp2_1f1b": ({"tp": 2}, 2, {}, MERGED),  # TP without SP (needs ep = 1)
               "cp2_ep2_ring_1f1b": ({"cp": 2, "ep": 2, "cp_comm": "ring"}, 2, {}, MERGED),
               "cp2_ep2_allgather_1f1b": ({"cp": 2, "ep": 2}, 2, {}, MERGED),
               "tp2_sp_pp2_ep2_1f1b": ({**SP, "pp": 2, "ep": 2}, 3, {}, MERGED),
               # the dense MLP and norms recomputed: their forward (SP gather, TP
               # reduce-scatter) reruns inside the overlapped backward, on the twins
               "tp2_sp_ep2_1f1b_recompute": ({**SP, "ep": 2}, 2, {}, MERGED,
                                             {"recompute": {"granularity": "selective",
                                                            "modules": ["mlp", "layernorm"]}}),
               "tp2_sp_ep2_1f1b_recompute_full": ({**SP, "ep": 2}, 2, {}, MERGED,
                                                  RECOMPUTE_FULL)}
WORLD4.update(WORLD4_TPCP)  # one 4-rank launch runs them all
# Combined 1F1B with expert tensor parallelism (ETP: the experts' all-gather / reduce-scatter
# over groups.etp, moeplug.parallel.expert_tp, inside the overlapped backward), DeepSeek-V3's
# MLA attention (its up projections recomputed there too) and MTP (MoE blocks after the last
# layer, their loss and the shared embedding / head; under PP2 on the last stage, whose
# embedding copy is summed over the embedding group after the backwards). The 5th entry is
# model-section overrides for both variants.
MLA = {"attention": "mla", "mla": {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                   "qk_rope_head_dim": 4, "v_head_dim": 4}}
MTP = {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}
WORLD2.update({"etp2_1f1b": ({"etp": 2}, 2, {}, MERGED),  # ETP without EP: dense DP2
               "ep2_mla_1f1b": ({"ep": 2}, 2, {}, MERGED,
                                {**MLA, "recompute": {"granularity": "selective",
                                                      "modules": ["mla_up_proj"]}}),
               "ep2_mtp_1f1b": ({"ep": 2}, 2, {}, MERGED, MTP)})
WORLD4.update({"etp2_ep2_1f1b": ({"etp": 2, "ep": 2}, 2, {}, MERGED),
               "pp2_etp2_1f1b": ({"pp": 2, "etp": 2}, 3, {}, MERGED),
               # the deferred expert dW run during the ETP reduce-scatter (the dispatch's
               # backward exchange), on the helper thread's own queue
               "etp2_ep2_1f1b_delay_wgrad": ({"etp": 2, "ep": 2}, 2, {}, MERGED_DELAY),
               "tp2_sp_etp2_ep2_1f1b": ({**SP, "etp": 2, "ep": 2}, 2, {}, MERGED),
               "pp2_ep2_mla_mtp_1f1b": ({"pp": 2, "ep": 2}, 3, {}, MERGED, {**MLA, **MTP}),
               # MLA under SP gathers its latents over the sequence (moeplug.modules.mla):
               # those gathers' reduce-scatters run in the overlapped backward, on the twins
               "tp2_sp_ep2_mla_1f1b": ({**SP, "ep": 2}, 2, {}, MERGED, MLA)})


def _cfg(parallel: dict, grad_accum: int, router_options: dict, chunks: int,
         merged: bool = False, dispatcher: str = "alltoall", delay: bool = False,
         model: dict | None = None, options: dict | None = None):
    """``model``: overrides of the model section (recompute, attention, MTP...); ``options``:
    the dispatcher's."""
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 16, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "init_std": 0.1,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8,
                          "aux_loss_coeff": 0.05, "shared_expert_ffn_hidden_size": 8,
                          "overlap_chunks": chunks, "delay_wgrad_compute": delay},
                  **(model or {})},
        "plugins": {"dispatcher": dispatcher, "router_options": router_options,
                    "dispatcher_options": options or {}},
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 16,
                  "grad_accum_steps": grad_accum, "lr": 1e-2, "min_lr": 1e-3,
                  "warmup_steps": 1, "grad_clip": 0.05, "seed": 7},
        "parallel": {**parallel, "overlap_moe_expert_parallel_comm": merged},
    })


def _named(model) -> dict[str, torch.nn.Parameter]:
    from moeplug.training.distributed import pipeline_chunks
    out = {}
    for part in pipeline_chunks(model) or [model]:
        out.update(dict(part.named_parameters()))
    return out


def _compare(rank: int, world: int, layouts: dict) -> dict:
    from moeplug.ops import delayed_wgrad
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model
    from moeplug.training.optim import lr_at
    from moeplug.data import get_batch
    from moeplug.parallel.layout import GROUP_KINDS
    from moeplug.training.trainer import (_VAL_STREAM, batch_generator, build_rank_optimizer,
                                          evaluate, seed_everything, step_batches, train_step)

    from moeplug_plugins.dispatchers import direct_write
    host = PluginHost.load()
    precision = host.create("precision", "fp32", {})
    pull_min_row_bytes = direct_write.PULL_MIN_ROW_BYTES
    ids = np.random.default_rng(3).integers(0, V, 4096).astype(np.int64)
    val_ids = np.random.default_rng(4).integers(0, V, 1024).astype(np.int64)  # held out
    report = {}
    for name, (parallel, accum, router_options, on, *both) in layouts.items():
        runs = {}
        model_over = both[0] if both else None  # a 5th entry: model overrides, both variants
        direct_write.PULL_MIN_ROW_BYTES = 0 if on.get("pull") else pull_min_row_bytes
        for variant in ("off", "on"):
            dispatcher = on.get("dispatcher", "alltoall")
            options = {**on.get("options", {}), **({"single_copy": True} if on.get("pull")
                                                     else {})}
            cfg = (_cfg(parallel, accum, router_options, 1, dispatcher=dispatcher,
                        model=model_over, options=options)
                   if variant == "off" else
                   _cfg(parallel, accum, router_options, on.get("chunks", 1),
                        on.get("merged", False), dispatcher, on.get("delay", False), model_over,
                        options))
            groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
            seed_everything(cfg.train.seed)
            model = build_rank_model(cfg, host, V, groups)
            opt = build_rank_optimizer(model, cfg, groups)
            # Which threads ran a backward: the combined 1F1B must use its helper thread.
            threads: set[str] = set()
            first = next(p for p in _named(model).values() if p.requires_grad)
            first.register_hook(lambda g: threads.add(threading.current_thread().name))
            steps = []
            delayed_wgrad.stats(reset=True)
            for step in range(3):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, cfg.train)
                stats = train_step(model, opt, step_batches(ids, cfg.train, step, groups),
                                   cfg.train, precision, groups)
                grads = {n: p.grad.clone() for n, p in _named(model).items() if p.grad is not None}
                steps.append((stats.losses(), stats.grad_norm, grads))
            # The trainer's validation after the steps: its fixed batches, forward only.
            gen = batch_generator(cfg.train.seed, 0, _VAL_STREAM)
            val_batches = [get_batch(val_ids, cfg.train.micro_batch_size, cfg.train.seq_len,
                                     gen) for _ in range(2)]
            val_loss = evaluate(model, val_batches, precision, groups)
            if variant == "on" and on.get("merged"):
                handles = [getattr(groups, k) for k in GROUP_KINDS]
                assert groups.twins and all(g in groups.twins for g in handles if g is not None)
                assert any(t.startswith("moeplug-backward-") for t in threads), threads
            if variant == "on":
                report.setdefault(name, {})["wgrad"] = delayed_wgrad.stats()
            runs[variant] = (steps, {n: p.detach().clone() for n, p in _named(model).items()},
                             val_loss)
        (off, off_params, off_val), (on, on_params, on_val) = runs["off"], runs["on"]
        # Step 1 starts from the same parameters: its grads are the parity proof (TOL). Steps
        # 2-3 start from parameters AdamW has already moved apart (TRAIN_TOL, see the top).
        errs = {}
        for step, ((l_off, n_off, g_off), (l_on, n_on, g_on)) in enumerate(zip(off, on)):
            assert l_off.keys() == l_on.keys() and g_off.keys() == g_on.keys() and g_off
            at = "step1_" if step == 0 else "later_"
            for key, value in (("loss", max(abs(l_off[k] - l_on[k]) for k in l_off)),
                               ("grad_norm", abs(n_off - n_on)),
                               ("grad", max((g_off[k] - g_on[k]).abs().max().item()
                                            for k in g_off))):
                errs[at + key] = max(errs.get(at + key, 0.0), value)
        errs["later_param"] = max((off_params[k] - on_params[k]).abs().max().item()
                                  for k in off_params)
        errs["later_val_loss"] = abs(off_val - on_val)  # a NaN fails every check below
        first_off, first_on = off[0][0], on[0][0]
        report[name] = {**report.get(name, {}), "errs": errs, "first_step_losses_equal": first_off == first_on,
                        "bitwise_grads": sum(torch.equal(off[0][2][k], on[0][2][k])
                                             for k in off[0][2]),
                        "num_grads": len(off[0][2]), "losses": [s[0]["loss"] for s in on]}
    return report


def _check(reports: list[dict], name: str) -> None:
    on = {**WORLD2, **WORLD4}[name][3]
    for rank, report in enumerate(reports):
        r = report[name]
        print(f"{name} rank {rank}: {r['errs']}, {r['bitwise_grads']}/{r['num_grads']} "
              f"step-1 grads bitwise")
        assert r["first_step_losses_equal"], f"{name}, rank {rank}: forward differs"
        if "chunks" not in on:  # combined 1F1B alone: the same ops in the same order
            assert r["bitwise_grads"] == r["num_grads"] and not any(r["errs"].values()), \
                f"{name}, rank {rank}: combined 1F1B is not bitwise: {r['errs']}"
        bad = {k: v for k, v in r["errs"].items()
               if not v <= (TOL if k.startswith("step1_") else TRAIN_TOL)}
        assert not bad, f"{name}, rank {rank}: overlap on differs from off by > {TOL}: {bad}"
        assert r["losses"][-1] < r["losses"][0] + 1.0  # it trained (no NaN, no blow-up)
        w = r["wgrad"]
        if on.get("delay"):
            # Every deferred weight GEMM ran while a dispatch's backward exchange was in
            # flight (alltoall: comm.all_to_all), none at a layer's input.
            assert w["deferred"] > 0 and w["in_flight"] == w["deferred"] and not w["flushed"], w
        else:
            assert w == {"deferred": 0, "in_flight": 0, "flushed": 0}, w


@pytest.fixture(scope="module")
def world2_reports():
    return run_layouts(_compare, 2, WORLD2, timeout=300)


@pytest.fixture(scope="module")
def world4_reports():
    return run_layouts(_compare, 4, WORLD4, timeout=600)


@pytest.mark.parametrize("name", sorted(WORLD2))
def test_overlap_equals_no_overlap_world2(world2_reports, name):
    _check(world2_reports, name)


@pytest.mark.parametrize("name", sorted(WORLD4))
def test_overlap_equals_no_overlap_world4(world4_reports, name):
    _check(world4_reports, name)


def _tp_cp_collectives_on_twins(rank: int, world: int) -> dict:
    """Ring attention (CP) and the vocab-parallel loss (TP) under ``on_twin_groups``: with a
    twin of the group they give the plain results; without one they raise (before the fix
    they silently used the base group, racing the forward's collectives on it)."""
    import torch.distributed as dist
    from moeplug.parallel import comm
    from moeplug.parallel.context_parallel import cp_attention
    from moeplug.parallel.ep_overlap import run_beside
    from moeplug.parallel.tensor_parallel import vocab_parallel_cross_entropy

    group, twin = dist.group.WORLD, dist.new_group(ranks=list(range(world)))
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    logits = torch.randn(6, 5, generator=gen, requires_grad=True)
    targets = torch.randint(0, 5 * world, (6,), generator=torch.Generator().manual_seed(9))

    def ring():
        out = cp_attention(q, k, v, group, "ring")
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    def loss():
        ce = vocab_parallel_cross_entropy(logits, targets, group)
        return (ce, *torch.autograd.grad(ce.sum(), logits))

    ring_ref, loss_ref = ring(), loss()
    with comm.on_twin_groups({group: twin}):
        ring_twin, loss_twin = ring(), loss()
    errors = []
    for fn in (ring, loss):
        with comm.on_twin_groups({}), pytest.raises(RuntimeError, match="without a twin") as e:
            fn()
        errors.append(str(e.value))
    # The overlapped backward's thread: forward here, backward there, on the twins.
    out = cp_attention(q, k, v, group, "ring")
    box = []
    run_beside(lambda: box.append(torch.autograd.grad(out.square().sum(), (q, k, v))),
               lambda: None, {group: twin})
    return {"ring": all(torch.equal(a, b) for a, b in zip(ring_ref, ring_twin)),
            "loss": all(torch.equal(a, b) for a, b in zip(loss_ref, loss_twin)),
            "helper": all(torch.equal(a, b) for a, b in zip(ring_ref, box[0])),
            "errors": errors}


def test_tp_cp_collectives_use_the_twin_groups():
    for rank, r in enumerate(run_distributed(_tp_cp_collectives_on_twins, 2, timeout=120)):
        assert r["ring"] and r["loss"] and r["helper"], (rank, r)
        assert all("Fix:" in e for e in r["errors"]), r["errors"]


# A fresh process: MKL's code path (MKL_CBWR=COMPATIBLE, the same on every x86 CPU, where these
# GEMMs round by how MKL splits them over threads) and a process default of 2 threads must be
# set before torch loads MKL.
_HELPER_THREADS = r"""
import json, torch
from moeplug.parallel.ep_overlap import run_beside
torch.manual_seed(0)
pairs = [(torch.randn(m, 16), torch.randn(16, 16)) for m in range(16, 40)]
gemms = lambda: [x @ w.t() for x, w in pairs]
torch.set_num_threads(2)
two = gemms()
torch.set_num_threads(1)  # as every rank of a gloo run, and train.threads
one = gemms()
box = []
run_beside(lambda: box.append(gemms()), lambda: None, {})
same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
print(json.dumps({"split_rounds": not same(one, two), "helper_is_callers": same(box[0], one)}))
"""


def test_the_overlapped_backward_computes_on_the_callers_thread_count():
    """run_beside's helper thread runs the backward on the caller's intra-op thread count.
    A new thread's MKL took the process default (the cores) whatever torch.set_num_threads
    said, so the combined 1F1B's GEMMs in the overlapped backward rounded as on 2+ threads where
    the plain loop's ran on 1: bitwise only while MKL split none of them (this host's default
    path for the tiny model), and PP2 x EP2 with the MoE recomputed failed under
    MKL_CBWR=COMPATIBLE."""
    import json
    import os
    import subprocess
    import sys
    if not torch.backends.mkl.is_available():
        pytest.skip("torch is built without MKL: no MKL thread count to follow")
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", _HELPER_THREADS], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if not r["split_rounds"]:
        pytest.skip("this MKL rounds these GEMMs alike on 1 and 2 threads: nothing to tell apart")
    assert r["helper_is_callers"], "the helper thread's GEMMs ran on another thread count"


# ---- one process: the layer itself, and config ----------------------------------------------

def test_single_process_layer_matches_unchunked():
    """At one rank the exchanges are the identity: chunking alone may change only the order
    of sums, and the GEMM library's rounding of a row can depend on how many rows the call has
    (MKL's kernels for AMD Zen 4 round the 3-chunk forward ~7e-9 off, its Intel kernels did
    not): every chunking is held to TOL, and the unchunked path (chunks > T) to bitwise."""
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.trainer import seed_everything

    cfg = _cfg({}, 1, {}, 1)
    seed_everything(0)
    model = build_model(cfg, PluginHost.load(), V)
    layer = next(m for m in model.modules() if type(m).__name__ == "MoELayer")
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    outs = {}
    for chunks in (1, CHUNKS, 32, 33):  # 33 > T = 32 tokens: the unchunked path
        layer.overlap_chunks = chunks
        xc = x.clone().requires_grad_()
        y, aux, counts = layer(xc)
        (y.square().sum() + aux).backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        outs[chunks] = (y.detach(), aux.detach(), counts, xc.grad, grads)
    y1, a1, c1, gx1, g1 = outs[1]
    for chunks, (y, a, c, gx, g) in outs.items():
        assert torch.equal(a, a1) and torch.equal(c, c1), chunks  # routing runs unchunked
        assert torch.allclose(y, y1, rtol=0, atol=TOL), chunks
        assert torch.allclose(gx, gx1, rtol=0, atol=TOL), chunks
        for n in g1:
            assert torch.allclose(g[n], g1[n], rtol=0, atol=TOL), (chunks, n)
    assert not torch.equal(outs[CHUNKS][3], torch.zeros_like(gx1))  # a real backward ran
    assert torch.equal(outs[33][0], y1) and torch.equal(outs[33][3], gx1)


@pytest.mark.parametrize("value, words", [(0, "must be a positive integer"),
                                          (1.5, "must be an integer"),
                                          (True, "must be an integer")])
def test_overlap_chunks_validated(value, words):
    from moeplug.config import ConfigError, config_from_dict
    with pytest.raises(ConfigError, match=f"MoEConfig.overlap_chunks = {value!r}: {words}"):
        config_from_dict({"model": {"moe": {"overlap_chunks": value}}})


@pytest.mark.parametrize("recompute", [{"granularity": "full"},
                                       {"granularity": "selective", "modules": ["moe"]},
                                       {"granularity": "selective", "modules": ["moe_act"]}])
def test_overlap_accepts_moe_recompute(recompute):
    """Once refused (exchanges re-issued inside the backward); proven in the matrix above."""
    from moeplug.config import config_from_dict
    config_from_dict({"model": {"moe": {"overlap_chunks": 2}, "recompute": recompute}})


def test_overlap_is_not_model_defining():
    """A run may resume with overlap switched: it computes the same model."""
    from moeplug.config import config_from_dict, model_differences
    a = config_from_dict({"model": {"moe": {"overlap_chunks": 1}}})
    b = config_from_dict({"model": {"moe": {"overlap_chunks": 4, "top_k": 1}}})
    assert [d[0] for d in model_differences(a, b)] == ["model.moe.top_k"]


def test_memory_levers_are_not_model_defining():
    """A run that resumes short of memory may turn recompute or offloading on (both bitwise
    the run without them); once refused as 'a different model'."""
    from moeplug.config import config_from_dict, model_differences
    a = config_from_dict({})
    b = config_from_dict({"model": {"recompute": {"granularity": "selective",
                                                  "modules": ["moe_act", "core_attn"]},
                                    "offload": ["expert_fc1"], "num_layers": 3}})
    assert [d[0] for d in model_differences(a, b)] == ["model.num_layers"]


@pytest.mark.parametrize("over, words", [
    ({"train": {"grad_accum_steps": 1}}, "needs two micro-batches in flight"),
    ({"runtime": {"stash": True}}, "cannot be combined with runtime.stash"),
    ({"model": {"recompute": {"granularity": "full"}},
      "plugins": {"router_options": {"input_jitter_eps": 0.1}}},
     "cannot be combined with recompute while the router draws input jitter"),
])
def test_combined_1f1b_refuses_what_it_cannot_run(over, words):
    from moeplug.config import ConfigError, config_from_dict
    base = {"parallel": {"ep": 2, "overlap_moe_expert_parallel_comm": True},
            "train": {"grad_accum_steps": 2}, "model": {}, "runtime": {}, "plugins": {}}
    cfg = {k: {**v, **over.get(k, {})} for k, v in base.items()}
    with pytest.raises(ConfigError, match="ParallelConfig.overlap_moe_expert_parallel_comm = "
                                          f"True: {words}.*Fix: .*"
                                          "overlap_moe_expert_parallel_comm: false"):
        config_from_dict(cfg)
    config_from_dict(base)  # the base itself is valid
    # TP (with and without SP) and CP compose: no longer refused; nor is MoE / full recompute
    for par in ({"tp": 2, "sequence_parallel": True}, {"tp": 2, "ep": 1}, {"cp": 2},
                {"cp": 2, "cp_comm": "ring", "tp": 2, "sequence_parallel": True, "pp": 2}):
        config_from_dict({**base, "parallel": {**base["parallel"], **par}})
    for rc in ({"granularity": "full"}, {"granularity": "selective", "modules": ["moe"]}):
        config_from_dict({**base, "model": {"recompute": rc}})
    # what stays refused still names field, value and fix under TP x CP
    with pytest.raises(ConfigError, match="overlap_moe_expert_parallel_comm = True: needs two "
                                          "micro-batches.*Fix: set train.grad_accum_steps >= 2"):
        config_from_dict({**base, "parallel": {**base["parallel"], "tp": 2, "cp": 2,
                                               "sequence_parallel": True},
                          "train": {"grad_accum_steps": 1}})


def test_chunked_overlap_with_the_paged_stash():
    """The experts of every chunk save into the runtime's page pool: on equals off, bitwise,
    and every page comes back."""
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.optim import build_optimizer
    from moeplug.training.trainer import train_step

    def train(stash: bool):
        cfg = config_from_dict({
            "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 32, "first_k_dense": 0,
                      "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32,
                              "overlap_chunks": CHUNKS}},
            "train": {"micro_batch_size": 4, "seq_len": 16, "grad_accum_steps": 2},
            "runtime": {"stash": stash}})
        torch.manual_seed(0)
        host = PluginHost.load()
        model = build_model(cfg, host, V)
        opt = build_optimizer(model, cfg.train)
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(2):
            batches = [(torch.randint(0, V, (4, 16), generator=gen),
                        torch.randint(0, V, (4, 16), generator=gen)) for _ in range(2)]
            stats = train_step(model, opt, batches, cfg.train,
                               host.create("precision", "fp32", {}), None)
            out.append((stats.losses(), stats.stash,
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
        return out

    on, off = train(True), train(False)
    for (l_on, s_on, g_on), (l_off, _, g_off) in zip(on, off):
        assert l_on == l_off and all(torch.equal(g_on[n], g_off[n]) for n in g_off)
        assert s_on["high_water"] > 0 and s_on["pages_in_use"] == 0 and s_on["overflows"] == 0


def test_cli_trains_with_both_overlaps_on_two_processes(run_cli, tiny_config_file, tmp_path):
    """The README's command, for real: two processes (EP2), chunked overlap and combined 1F1B."""
    from moeplug.training.metrics import read_metrics
    out = tmp_path / "run"
    proc = run_cli("train", "--config", tiny_config_file(str(out)), "--nproc", "2",
                   "--steps", "2", "--set", "parallel.ep=2", "--set", "model.moe.overlap_chunks=2",
                   "--set", "train.grad_accum_steps=2",
                   "--set", "parallel.overlap_moe_expert_parallel_comm=true", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(out / "metrics.jsonl"))
    [run] = [r for r in records if r["kind"] == "run"]
    assert run["config"]["model"]["moe"]["overlap_chunks"] == 2
    assert run["config"]["parallel"]["overlap_moe_expert_parallel_comm"] is True
    train = [r for r in records if r["kind"] == "train"]
    assert train and train[-1]["step"] == 2  # logged every train.log_interval steps
    assert all(np.isfinite(r["loss"]) and r["time_breakdown"]["dispatch"] > 0 for r in train)


def _split_all_to_all(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from moeplug.parallel import comm
    gen = torch.Generator().manual_seed(rank)
    send = [(rank + r) % 3 for r in range(world)]        # uneven, some zero
    recv = [(r + rank) % 3 for r in range(world)]        # what rank r sends here
    x = torch.randn(sum(send), 5, generator=gen, requires_grad=True)
    w = torch.randn(sum(recv), 5, generator=gen)
    y_ref = comm.all_to_all(x, recv, send, dist.group.WORLD)
    (g_ref,) = torch.autograd.grad((y_ref * w).sum(), x)
    # Two in flight, waited in reverse order; their backwards overlap the same way.
    p1 = comm.all_to_all_start(x, recv, send, dist.group.WORLD)
    p2 = comm.all_to_all_start(2 * x, recv, send, dist.group.WORLD)
    y2, y1 = p2.wait(), p1.wait()
    (g,) = torch.autograd.grad((y1 * w).sum() + (y2 * w).sum(), x)
    with pytest.raises(RuntimeError, match="called twice"):
        p1.wait()
    return {"y": torch.equal(y1, y_ref) and torch.equal(y2, 2 * y_ref),
            "grad": torch.equal(g, g_ref + 2 * g_ref)}  # two addends: order-free, bitwise


def test_split_all_to_all_equals_all_to_all():
    for rank, r in enumerate(run_distributed(_split_all_to_all, 3, timeout=120)):
        assert r == {"y": True, "grad": True}, (rank, r)


# ---- delayed expert weight gradients (model.moe.delay_wgrad_compute) at one process ---------

@pytest.mark.parametrize("activation, precision, recompute_act, chunks", [
    ("swiglu", "fp32", False, 1),   # moeplug.ops.grouped_ffn.expert_mlp (fused C++ SwiGLU)
    ("swiglu", "bf16", True, 1),    # bf16 GEMMs, activation rebuilt in backward
    ("geglu", "fp32", True, 1),     # moeplug.ops.grouped_ffn.grouped_mlp (torch activation), rebuilt
    ("swiglu", "fp32", False, CHUNKS)])
def test_delay_wgrad_single_process(activation, precision, recompute_act, chunks):
    """A real train_step of two accumulated micro-batches (the second sums into an existing
    .grad), delay on vs off. With one chunk
    the deferred GEMMs are the same ops on the same tensors, summed into .grad as
    AccumulateGrad sums: losses and every gradient bitwise. With chunks, each chunk's dW is
    summed into .grad on its own (off: autograd first adds the chunks' dW, then .grad), a
    different fp32 order: TOL. At one rank there is no exchange, so every deferred piece runs
    when the backward reaches the layer's input (flushed), none in flight."""
    from moeplug.ops import delayed_wgrad
    from moeplug.config import config_from_dict
    from moeplug.build import build_model
    from moeplug.plugin_host import PluginHost
    from moeplug.training.optim import build_optimizer
    from moeplug.training.trainer import train_step

    def train(delay: bool):
        cfg = config_from_dict({
            "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                      "max_seq_len": 32, "first_k_dense": 0,
                      "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32,
                              "activation": activation, "overlap_chunks": chunks,
                              "shared_expert_ffn_hidden_size": 16,
                              "delay_wgrad_compute": delay},
                      "recompute": ({"granularity": "selective", "modules": ["moe_act"]}
                                    if recompute_act else {})},
            "plugins": {"precision": precision},
            "train": {"micro_batch_size": 2, "seq_len": 16, "grad_accum_steps": 2}})
        torch.manual_seed(0)
        host = PluginHost.load()
        model = build_model(cfg, host, V)
        opt = build_optimizer(model, cfg.train)
        gen = torch.Generator().manual_seed(1)
        delayed_wgrad.stats(reset=True)
        out = []
        for _ in range(1):
            batches = [(torch.randint(0, V, (2, 16), generator=gen),
                        torch.randint(0, V, (2, 16), generator=gen)) for _ in range(2)]
            stats = train_step(model, opt, batches, cfg.train,
                               host.create("precision", precision, {}), None)
            out.append((stats.losses(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        return out, delayed_wgrad.stats()

    (on, w_on), (off, w_off) = train(True), train(False)
    # 2 MoE layers x 2 micro-batches x chunks: every experts backward deferred.
    assert w_on == {"deferred": 4 * chunks, "in_flight": 0, "flushed": 4 * chunks}, w_on
    assert w_off == {"deferred": 0, "in_flight": 0, "flushed": 0}
    (l_on1, g_on1), (l_off1, g_off1) = on[0], off[0]
    assert l_on1 == l_off1
    assert g_on1.keys() == g_off1.keys() and any(k.endswith("gate_up_proj") for k in g_on1)
    if chunks == 1:
        for (l_on, g_on), (l_off, g_off) in zip(on, off):
            assert l_on == l_off
            assert all(torch.equal(g_on[n], g_off[n]) for n in g_off), \
                [n for n in g_off if not torch.equal(g_on[n], g_off[n])]
    else:
        for n in g_off1:
            assert torch.allclose(g_on1[n], g_off1[n], rtol=0, atol=TOL), n


def test_delay_wgrad_defers_until_the_layer_input():
    """The expert op's backward really returns before its weight gradients exist: right after
    autograd ran it (a hook on its input gradient), .grad of both weights is still unset and
    one piece of work is queued; after the backward they are set and the queue is empty."""
    from moeplug.ops import delayed_wgrad
    from moeplug.ops import expert_mlp
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=gen, requires_grad=True)
    probs = torch.rand(10, generator=gen)
    w13 = torch.nn.Parameter(torch.randn(2, 12, 8, generator=gen))
    w2 = torch.nn.Parameter(torch.randn(2, 8, 6, generator=gen))
    seen = []
    x_in = x * 1.0
    x_in.register_hook(lambda g: seen.append((w13.grad, w2.grad, delayed_wgrad.pending())))
    y = expert_mlp(x_in, probs, torch.tensor([4, 6]), w13, w2, delay_wgrad=True)
    y.square().sum().backward()
    assert seen == [(None, None, 1)]
    delayed_wgrad.run_pending()  # the trainer does this after every backward
    ref13, ref2 = (torch.nn.Parameter(w.detach().clone()) for w in (w13, w2))
    expert_mlp(x * 1.0, probs, torch.tensor([4, 6]), ref13, ref2).square().sum().backward()
    assert torch.equal(w13.grad, ref13.grad) and torch.equal(w2.grad, ref2.grad)
    assert delayed_wgrad.pending() == 0


@pytest.mark.parametrize("over, words", [
    ({"plugins": {"experts": "sequential"}}, "needs the grouped experts backend"),
    ({"plugins": {"precision": "fp8_tensorwise"}}, "splits the fp32/bf16 expert GEMMs"),
    ({"runtime": {"sync_free": True}}, "is not built into the static sync-free region"),
    ({"runtime": {"stash": True}}, "cannot be combined with runtime.stash"),
    ({"train": {"device": "cuda"}}, "is implemented for the CPU expert ops only"),
])
def test_delay_wgrad_refuses_what_it_cannot_split(over, words):
    from moeplug.config import ConfigError, config_from_dict
    base = {"model": {"moe": {"delay_wgrad_compute": True}}, "plugins": {}, "runtime": {},
            "train": {}}
    cfg = {k: {**v, **over.get(k, {})} for k, v in base.items()}
    with pytest.raises(ConfigError, match=f"MoEConfig.delay_wgrad_compute = True: {words}.*"
                                          f"Fix: set .* or delay_wgrad_compute: false"):
        config_from_dict(cfg)
    config_from_dict(base)  # the base itself is valid


def test_delay_wgrad_validated_and_not_model_defining():
    from moeplug.config import ConfigError, config_from_dict, model_differences
    with pytest.raises(ConfigError, match="MoEConfig.delay_wgrad_compute = 'yes': must be a "
                                          "boolean"):
        config_from_dict({"model": {"moe": {"delay_wgrad_compute": "yes"}}})
    a = config_from_dict({"model": {"moe": {"delay_wgrad_compute": False}}})
    b = config_from_dict({"model": {"moe": {"delay_wgrad_compute": True}}})
    assert model_differences(a, b) == []
