"""``moeplug plan --dry-run`` against the real code: each rank's bytes as real ranks hold them.

* 4 real gloo ranks (PP2 x EP2 x DP2) build and step the same tiny model through moeplug
  train's own build; each rank's parameter, gradient and optimizer-state bytes, read off its
  real tensors, equal the dry run's measure of that rank at the same world.
* At a 64-rank fake world, the dry run's meta-device rank holds the same parameter bytes as a
  real (CPU) build of that rank under the same fake process group.
* Offloading on meta tensors moves every named tensor once and frees it at the peak.
* The meta path's chunk sort equals the runtime kernel's; bad flags are one line, exit 2.
* On the meta device the GPU path's SwiGLU and row kernels run through their fake kernels,
  saving what they save on a GPU (bf16 rows, not the fp32 reference's copies), with the
  shapes and dtypes of the CPU twins' real outputs.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.testing.distributed import run_distributed

LAYOUT = ["parallel.pp=2", "parallel.ep=2", "parallel.distributed_optimizer=true"]


def _cfg(extra: list[str] = ()) -> object:
    from moeplug.config import load_config
    from moeplug.config.presets import preset
    return load_config(None, ["model.vocab_size=256", "train.micro_batch_size=2",
                              "train.seq_len=32", "train.grad_accum_steps=2",
                              "train.param_dtype=bf16", "plugins.precision=bf16",
                              "plugins.dispatcher=alltoall", *LAYOUT, *extra],
                       base=preset("qwen3_moe_tiny"))


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr() or id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _real_rank(rank: int, world: int) -> dict:
    """One real rank: build, one train_step on real tokens, the bytes its tensors hold."""
    from moeplug.parallel import ParallelGroups
    from moeplug.plugin_host import check_plugins, load_host
    from moeplug.training import distributed as D
    from moeplug.training.trainer import build_rank_optimizer, seed_everything, train_step
    cfg = _cfg()
    groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
    host = load_host(cfg)
    precision = check_plugins(host, cfg)
    seed_everything(cfg.train.seed)
    model = D.build_rank_model(cfg, host, 256, groups)
    opt = build_rank_optimizer(model, cfg, groups)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, 256, (2, 32), generator=gen),
                torch.randint(0, 256, (2, 32), generator=gen))
               for _ in range(cfg.train.grad_accum_steps)]
    train_step(model, opt, batches, cfg.train, precision, groups)
    params = list(model.parameters())
    state = [b.shard for b in opt.buckets]
    state += [t for s in opt.inner.state.values() for t in s.values()
              if isinstance(t, torch.Tensor)]  # moments and step counts
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "optimizer": _bytes(state)}


def test_dry_run_bytes_equal_real_gloo_ranks():
    from moeplug.plan.dry_run import measure_rank
    real = run_distributed(_real_rank, 4, timeout=300)
    for rank in range(4):
        m = measure_rank(_cfg(), rank, 4)
        got = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}
        assert got == real[rank], (rank, got, real[rank])
        assert m.activations_peak > 0 and m.comm.get("all-to-all", 0) > 0
    assert real[0]["params"] != real[2]["params"]  # two stages: the test compares two shapes


def test_dry_run_parameters_at_64_fake_ranks_equal_a_real_build_of_that_rank():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moeplug.parallel import ParallelGroups
    from moeplug.plan.dry_run import measure_rank
    from moeplug.plugin_host import load_host
    from moeplug.training import distributed as D
    cfg = _cfg(["parallel.ep=8", "parallel.tp=2", "parallel.sequence_parallel=true"])
    rank = 63  # last stage, last EP and TP rank
    dist.init_process_group("fake", rank=rank, world_size=64, store=FakeStore())
    try:
        groups = ParallelGroups.build(cfg.parallel.layout(), 64, rank)
        model = D.build_rank_model(cfg, load_host(cfg), 256, groups)
        real = _bytes(model.parameters())
    finally:
        dist.destroy_process_group()
    assert measure_rank(cfg, rank, 64).params == real


def test_dry_run_offloads_through_the_device_tier_and_frees_what_it_moves():
    """model.offload on the meta device (the GPU tier's logic, moeplug.modules.offload): every
    named tensor of every layer and micro-batch goes to host memory once, and at the step's peak
    only the layer being computed still holds its own (the planner's model of offloading). Once
    offloading was silently a no-op off the CPU, and the dry run measured the rows as if the
    published offload were not there."""
    from moeplug.plan.dry_run import measure_rank
    shape = ["train.seq_len=256"]
    kept = measure_rank(_cfg(shape), 0, 4)
    moved = measure_rank(_cfg(shape + ["model.offload=[attn_norm,mlp_norm,expert_fc1]"]), 0, 4)
    cfg = _cfg(shape)
    tc, m = cfg.train, cfg.model
    one = tc.micro_batch_size * tc.seq_len * m.hidden_size * 2  # a norm's bf16 input
    rows = one * m.moe.top_k  # the experts' FC1 input: balanced routing brings T*K rows back
    layers = m.num_layers // 2                                  # this stage's (all MoE), at PP2
    assert moved.offloaded == layers * tc.grad_accum_steps * (2 * one + rows)
    assert kept.offloaded == 0
    # everything but the current layer's tensors of one micro-batch left the device
    assert kept.activations_peak - moved.activations_peak >= moved.offloaded - 2 * one - rows
    assert (moved.params, moved.grads, moved.optimizer, moved.comm) == \
        (kept.params, kept.grads, kept.optimizer, kept.comm)


@pytest.fixture(scope="module")
def kept_rank0():
    from moeplug.plan.dry_run import measure_rank
    return measure_rank(_cfg(["train.seq_len=256"]), 0, 4)


@pytest.mark.parametrize("name", ["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                  "mlp_norm", "expert_fc1", "moe_act"])
def test_the_planners_offload_moves_what_the_code_moves(name, kept_rank0):
    """Per offload name, the bytes the planner takes off the device (memory.layer_offloaded,
    times the stage's layers and micro-batches) are the bytes the dry run's step moved to host
    memory, and the dry run's peak drops. attn_proj: the attention kernel keeps the tensor
    o_proj's offload moves, so the planner counts nothing and the peak does not drop. (Once
    the planner moved the attention output for core_attn, q/k/v for qkv_linear and nothing for
    attn_proj, and the activation, not FC1's output, for moe_act.)"""
    from moeplug.plan.dry_run import measure_rank
    from moeplug.plan.memory import Mapping, Options, layer_offloaded
    cfg = _cfg(["train.seq_len=256"])
    m = measure_rank(_cfg(["train.seq_len=256", f"model.offload=[{name}]"]), 0, 4)
    tc = cfg.train
    mp = Mapping(world=4, pp=2, ep=2, mbs=tc.micro_batch_size, seq=tc.seq_len,
                 gbs=2 * tc.micro_batch_size * tc.grad_accum_steps)
    opt = Options(precision="bf16", dispatcher="alltoall", offload=(name,))
    per_layer = sum(layer_offloaded(cfg.model, True, mp, opt).values())
    layers = cfg.model.num_layers // 2  # rank 0's stage at PP2, every layer an MoE layer
    planned = per_layer * layers * tc.grad_accum_steps
    drop = kept_rank0.activations_peak - m.activations_peak
    if name == "attn_proj":
        assert planned == 0 and m.offloaded > 0 and drop <= 0
    else:
        assert planned == m.offloaded > 0
        assert drop > 0


def test_chunk_sort_is_a_torch_library_op_whose_fake_matches_the_runtime_kernel():
    """The chunk sort is a torch.library op: torch's opcheck runs its fake kernel beside the
    runtime's on real tensors (shapes, dtypes, strides, schema); on meta tensors the fake runs,
    and the dry run's shadows get the kernel's own values."""
    from moeplug.plan.fake_step import DryStepMode
    from moeplug_plugins.dispatchers._ep_comm import _move, gather_index
    counts_WL = torch.tensor([[3, 0, 2], [1, 4, 0]], dtype=torch.int64)
    rows = torch.arange(20, dtype=torch.float32).view(10, 2) * 1.5
    for to_expert_major in (True, False):
        torch.library.opcheck(torch.ops.moeplug_plugins.move_row_chunks,
                              (rows, counts_WL, to_expert_major))
    # arrival: rank 0 sends experts (0, 1, 2) rows 0-2 | - | 3-4; rank 1 sends 5 | 6-9 | -
    want = torch.tensor([0, 1, 2, 5, 6, 7, 8, 9, 3, 4])  # expert-major
    assert torch.equal(_move(rows, counts_WL, True), rows[want])
    meta = _move(rows.to("meta"), counts_WL.to("meta"), True)
    assert meta.is_meta and meta.shape == rows.shape and meta.dtype == rows.dtype
    mode = DryStepMode()
    with mode:
        counts_meta = mode.shadow(torch.empty(2, 3, dtype=torch.int64, device="meta"), counts_WL)
        idx = gather_index(counts_meta, True)
    assert idx.is_meta and torch.equal(mode._values(idx), want)


@pytest.mark.parametrize("args, field", [
    (["--mapping", "pp=2,ep=8", "--dry-run", "--search"], "--dry-run with --search"),
    (["--mapping", "pp=2,ep=8", "--rank", "3"], "--rank 3"),
    (["--mapping", "pp=2,ep=8", "--dry-run", "--rank", "-1"], "--rank -1"),
    (["--mapping", "pp=2,ep=8", "--dry-run", "--rank", "16"], "--rank 16"),
])
def test_dry_run_bad_flags_are_one_line(run_cli, args, field):
    r = run_cli("plan", "--preset", "mixtral", "--gpus", "16", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert field in r.stderr and "Fix:" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_meta_tensors_take_the_cuda_kernels_fakes_and_save_what_a_gpu_saves():
    from moeplug.ops import cuda_ops
    from moeplug.ops.swiglu import swiglu as cpu_swiglu
    from moeplug.ops.permute import permute as cpu_permute, unpermute as cpu_unpermute
    S, F = 6, 4
    h = torch.randn(S, 2 * F).bfloat16().requires_grad_()
    p = torch.rand(S).requires_grad_()
    assert cuda_ops.traced(h.to("meta")) and not cuda_ops.traced(h)
    a_real = cpu_swiglu(h, p)  # the runtime's CPU kernel: same contract
    gh_real, gp_real = torch.autograd.grad(a_real, (h, p), torch.ones_like(a_real))
    h_m = h.detach().to("meta").requires_grad_()
    p_m = p.detach().to("meta").requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        a_m = cuda_ops.swiglu(h_m, p_m)
    # h as it came (bf16) and the fp32 weights: the reference would keep fp32 copies of h
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == \
        [((S,), torch.float32), ((S, 2 * F), torch.bfloat16)]
    gh_m, gp_m = torch.autograd.grad(a_m, (h_m, p_m), torch.empty_like(a_m))
    for m, r in ((a_m, a_real), (gh_m, gh_real), (gp_m, gp_real)):
        assert m.is_meta and (m.shape, m.dtype) == (r.shape, r.dtype)

    x = torch.randn(5, 3).bfloat16().requires_grad_()
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    rows_real, row_map, _ = cpu_permute(x, ids, 3)
    y_real = cpu_unpermute(rows_real, row_map)
    (gx_real,) = torch.autograd.grad(y_real, x, torch.ones_like(y_real))
    x_m = x.detach().to("meta").requires_grad_()
    rows_m = cuda_ops._Permute.apply(x_m, row_map.to("meta"), None)
    y_m = cuda_ops.unpermute(rows_m, row_map.to("meta"))
    (gx_m,) = torch.autograd.grad(y_m, x_m, torch.empty_like(y_m))
    for m, r in ((rows_m, rows_real), (y_m, y_real), (gx_m, gx_real)):
        assert m.is_meta and (m.shape, m.dtype) == (r.shape, r.dtype)
