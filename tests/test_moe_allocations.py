"""After warm-up the MoE path allocates nothing (issue 7, paged stash: "the pool is reused every
step, so after warm-up the MoE path allocates nothing").

Counted by moeplug.testing.allocations: torch's profiler memory accounting inside every
MoELayer.forward and the backward of every autograd node that forward created. The counter is
shown to see allocations (the same step with the layers' workspace arenas switched off), and
each allocation-free rewrite is compared bitwise with the torch composition it replaces.
"""

from __future__ import annotations

import pytest
import torch

from moeplug.config import config_from_dict
from moeplug.moe import MoELayer
from moeplug.ops import permute, permute_probs
from moeplug.runtime import workspace
from moeplug.routing import (expert_counts, router_logits, seq_aux_loss_from_stats,
                             switch_aux_loss_from_mean, switch_aux_loss_from_stats, z_loss)
from moeplug.routing import append_sink_rows, drop_over_capacity, first_rows, sink_dropped
from moeplug.routing import cat_rows, pad_rows, padded_counts, row_range, unpad_rows
from moeplug.routing import capacity as capacity_mod
from moeplug.routing import workspace_losses as WL
from moeplug.testing import allocations
from moeplug.testing.allocations import moe_path_allocations
from moeplug.testing.steps import one_process_trainer


def _setup(stash: bool, precision: str = "fp32", router_options: dict | None = None,
           moe_options: dict | None = None, runtime: dict | None = None):
    cfg = config_from_dict({
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 32, "first_k_dense": 0,
                  "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 32,
                          **(moe_options or {})}},
        "plugins": {"router_options": router_options or {}},
        "train": {"steps": 10, "micro_batch_size": 2, "seq_len": 32, "warmup_steps": 1,
                  "grad_accum_steps": 2},
        "runtime": {"stash": stash, **(runtime or {})}})
    return one_process_trainer(cfg, precision)


def _assert_steps_allocate_nothing(model, step, warm_up: int = 3) -> None:
    """``warm_up`` steps (arenas, the workspace cache, the stash pool), then two steps, each
    with its own batch, that allocate nothing on the MoE path."""
    for _ in range(warm_up):
        step()
    for _ in range(2):
        report = moe_path_allocations(model, step)
        assert report.count == 0, report.describe()


def _arenas_off(model) -> None:
    """Every MoE layer's workspace arena switched off: its small buffers go to torch again."""
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.workspace = None


@pytest.mark.parametrize("stash, precision", [(True, "fp32"), (False, "fp32"), (True, "bf16")])
def test_steady_state_step_allocates_nothing_on_the_moe_path(stash, precision):
    torch.set_num_threads(1)
    _assert_steps_allocate_nothing(*_setup(stash, precision))


# Features made allocation-free after the default path (issue 7): router options (and
# model.moe options), each with the autograd Function (its profiler range) that must allocate
# once the arenas are off.
ROUTER_FEATURES = {
    "seq_aux_loss": ({"load_balancing_type": "seq_aux_loss"}, "_AuxFromStats"),
    "global_aux_loss": ({"load_balancing_type": "global_aux_loss"}, "_AuxFromStats"),
    "all_aux_losses": ({"load_balancing_type": ["aux_loss", "seq_aux_loss", "global_aux_loss"],
                        "aux_loss_coeff": [1e-2, 2e-2, 3e-2]}, "_AuxFromStats"),
    "z_loss": ({"load_balancing_type": "none", "z_loss_coeff": 1e-3}, "_AddZLoss"),
    "aux_and_z_loss": ({"z_loss_coeff": 1e-3}, "_AddZLoss"),
    # DeepSeek-V3 routing: sigmoid scores, the expert bias (its step counts), group-limited
    # top-k, seq aux loss.
    "expert_bias": ({"score_function": "sigmoid", "enable_expert_bias": True, "num_groups": 4,
                     "group_topk": 2, "load_balancing_type": "seq_aux_loss",
                     "aux_loss_coeff": 1e-4, "topk_scaling_factor": 2.5}, "_AuxFromStats"),
    # Capacity dropping (sink rows in the alltoall dispatcher), with the expert bias's counts
    # of the kept choices; both policies choose in the runtime's drop_over_capacity kernel.
    "capacity_position": ({"capacity_factor": 1.0, "token_drop_policy": "position",
                           "score_function": "sigmoid", "enable_expert_bias": True},
                          "_ZeroDropped"),
    "capacity_probs": ({"capacity_factor": 1.0, "token_drop_policy": "probs"}, "_ZeroDropped"),
    # Shared experts (SwiGLU, fp32, no output gate) beside capacity dropping.
    "shared_experts": ({"capacity_factor": 1.0, "token_drop_policy": "position"},
                       "_ActivationParts", {"shared_expert_ffn_hidden_size": 48}),
    # With the output gate (Qwen2-MoE's shared_expert_gate): y * sigmoid(x . w_g).
    "shared_experts_gate": ({}, "_SigmoidScale", {"shared_expert_ffn_hidden_size": 48,
                                                  "shared_expert_gate": True}),
    # Megatron's default gate (moe_router_dtype unset): the GEMM in bf16 under bf16 autocast.
    "router_input_dtype_bf16": ({"dtype": "input"}, "_Linear", None, "bf16"),
    "shared_experts_gate_bf16": ({}, "_SigmoidScale", {"shared_expert_ffn_hidden_size": 48,
                                                       "shared_expert_gate": True}, "bf16"),
    # The same under bf16 autocast (plugins.precision: bf16): nn.Linear's casts and GEMMs.
    "shared_experts_bf16": ({"capacity_factor": 1.0, "token_drop_policy": "position"},
                            "_Linear", {"shared_expert_ffn_hidden_size": 48}, "bf16"),
    # The routed experts' other activations (moeplug.ops.grouped_ffn.grouped_mlp), and a shared expert's.
    "geglu": ({}, "_GroupedFFN", {"activation": "geglu"}),
    "gelu": ({}, "_GroupedFFN", {"activation": "gelu"}),
    "squared_relu": ({}, "_GroupedFFN", {"activation": "squared_relu"}),
    "squared_relu_bf16": ({}, "_GroupedFFN", {"activation": "squared_relu"}, "bf16"),
    "shared_experts_gelu": ({}, "_ActivationParts", {"activation": "gelu",
                                                     "shared_expert_ffn_hidden_size": 48}),
    # Padded rows (routing.rows): every expert to its capacity, or to a multiple of 16 rows
    # (padding_for_quantization), the latter under bf16 too.
    "pad_to_capacity": ({"capacity_factor": 1.0, "pad_to_capacity": True}, "_PadRows"),
    "pad_multiple": ({"padding_for_quantization": 16}, "_UnpadRows"),
    "pad_multiple_bf16": ({"padding_for_quantization": 16}, "_PadRows", None, "bf16"),
    # Megatron moe_apply_probs_on_input (top-1): the rows scaled by p, in fp32 and bf16 (where
    # p is cast to the rows' dtype first).
    "apply_probs_on_input": ({}, "_ScaleRows", {"top_k": 1, "apply_probs_on_input": True}),
    "apply_probs_on_input_bf16": ({}, "_ScaleRows", {"top_k": 1, "apply_probs_on_input": True},
                                  "bf16"),
    # Chunked overlap (moe_overlap): each chunk's rows and weights sliced, the outputs joined;
    # with shared experts, capacity and bf16 too.
    "overlap": ({}, "_RowRange", {"overlap_chunks": 2}),
    "overlap_shared_bf16": ({"capacity_factor": 1.0}, "_RowRange",
                            {"overlap_chunks": 3, "shared_expert_ffn_hidden_size": 48}, "bf16"),
    # Switch Transformer's input jitter (the noise, the product and its gradient), and the
    # benchmarks' force_load_balancing (random logits; its backward passes the gradient on).
    "input_jitter": ({"input_jitter_eps": 0.1}, "_Jitter"),
    "input_jitter_bf16": ({"input_jitter_eps": 0.1}, "_Jitter", None, "bf16"),
    "force_load_balancing": ({"force_load_balancing": True}, "_RandomLogits"),
}
# Features whose Function's backward allocates nothing even without the arenas.
NO_BACKWARD_BUFFERS = {"force_load_balancing"}

# Top-1 routing spreads the rows per expert wider: at fp32 the experts' one-expert scratch
# (moeplug.ops.grouped_ffn.expert_mlp, sized by the largest expert's rows) first needs its 4 KiB arena class
# in step 5, then nothing over the next 12 steps.
WARM_UP_STEPS = {"apply_probs_on_input": 5}


def _feature(feature: str) -> tuple:
    """(router options, the Function that must allocate with the arenas off, model.moe
    options, precision) of ROUTER_FEATURES[feature]."""
    options, function, *rest = ROUTER_FEATURES[feature]
    return options, function, rest[0] if rest else None, rest[1] if len(rest) > 1 else "fp32"


@pytest.mark.parametrize("feature", list(ROUTER_FEATURES))
def test_router_features_allocate_nothing_after_warm_up(feature):
    torch.set_num_threads(1)
    options, _, moe, precision = _feature(feature)
    _assert_steps_allocate_nothing(*_setup(True, precision, router_options=options,
                                           moe_options=moe), WARM_UP_STEPS.get(feature, 3))


@pytest.mark.parametrize("feature", list(ROUTER_FEATURES))
def test_the_counter_sees_each_router_features_allocations_when_the_arenas_are_off(feature):
    # The same run with the arenas off: the feature's Function allocates in forward and
    # backward again, and the counter must say so (else the test above proves nothing).
    options, function, moe, precision = _feature(feature)
    report = _allocations_without_arenas(options, moe, precision)
    assert any(function in k for k in report.where), report.describe()
    if feature not in NO_BACKWARD_BUFFERS:
        assert any(function + "Backward" in k for k in report.where), report.describe()
    if feature == "expert_bias":
        # Without the bias, the same run's count: the step counts' two buffers (ones, counts)
        # per layer and micro-batch are what the bias adds.
        base = _allocations_without_arenas({**options, "enable_expert_bias": False}, None,
                                           precision)
        assert report.count == base.count + 2 * 2 * 2, (base.describe(), report.describe())


def _allocations_without_arenas(router_options: dict, moe_options: dict | None,
                                precision: str = "fp32"):
    """The MoE path's allocations in a step after two warm-up steps, every layer's arena off."""
    model, step = _setup(True, precision, router_options=router_options, moe_options=moe_options)
    _arenas_off(model)
    for _ in range(2):
        step()
    return moe_path_allocations(model, step)


# Execution modes: (runtime options, model.moe options, stash, precision, the Functions the
# counter must see allocate forward and backward once the arenas are off).
# runtime.sync_free, eager on the CPU, runs its static stages in the layer's arena
# (moeplug.moe.budgeted.arena); the pure pieces allocated 263 buffers in two such steps (287
# with the stash). Delayed wgrad work (model.moe.delay_wgrad_compute; the stash is refused
# with it) writes its deferred weight grads into workspace buffers.
MODES = {
    "sync_free": ({"sync_free": True}, None, False, "fp32",
                  ("_ToSlots", "_GroupedFFN", "_FromSlots")),
    "sync_free_stash": ({"sync_free": True}, None, True, "fp32",
                        ("_ToSlots", "_GroupedFFN", "_FromSlots")),
    "sync_free_stash_bf16": ({"sync_free": True}, None, True, "bf16",
                             ("_ToSlots", "_GroupedFFN", "_FromSlots")),
    # moe.apply_probs_on_input (top-1): the weights scale the rows in the arena's stage 2
    "sync_free_probs_on_input": ({"sync_free": True}, {"top_k": 1, "apply_probs_on_input": True},
                                 False, "fp32", ("_ToSlots", "_GroupedFFN", "_FromSlots")),
    # pipelined over chunks (moeplug.moe.overlap): each chunk's stages in the arena
    "sync_free_chunks_stash": ({"sync_free": True}, {"overlap_chunks": 2}, True, "fp32",
                               ("_ToSlots", "_GroupedFFN", "_FromSlots")),
    "delay_wgrad": (None, {"delay_wgrad_compute": True}, False, "fp32", ("_GroupedFFN",)),
    "delay_wgrad_chunks_bf16": (None, {"delay_wgrad_compute": True, "overlap_chunks": 2},
                                False, "bf16", ("_GroupedFFN",)),
}


# bf16 chunks spread the rows per expert wider: a one-expert scratch class is first needed in
# steps 3 and 5 (the same without delay_wgrad), then nothing over the next 10 steps.
# sync_free with top-1 routing overflows its token budget in steps 3, 5 and 7 of this run, which
# rerun on the dynamic path: there the experts' one-expert scratch class (WARM_UP_STEPS) is
# first needed in step 5; steps 6 and 7 (a rerun) then allocate nothing.
MODE_WARM_UP_STEPS = {"delay_wgrad_chunks_bf16": 5, "sync_free_probs_on_input": 5}


@pytest.mark.parametrize("mode", list(MODES))
def test_execution_modes_allocate_nothing_on_the_moe_path(mode):
    runtime, moe, stash, precision, functions = MODES[mode]
    torch.set_num_threads(1)
    model, step = _setup(stash, precision, moe_options=moe, runtime=runtime)
    _assert_steps_allocate_nothing(model, step, MODE_WARM_UP_STEPS.get(mode, 3))
    _arenas_off(model)
    step()
    report = moe_path_allocations(model, step)
    for function in functions:
        assert any(function in k for k in report.where), (function, report.describe())
        assert any(function + "Backward" in k for k in report.where), (function,
                                                                        report.describe())


def test_the_counter_sees_allocations_when_the_arenas_are_off():
    # Same model and step, the layers' workspace arenas replaced by None: their small buffers
    # go to torch again, and the counter must report them (else the test above proves nothing).
    model, step = _setup(True)
    _arenas_off(model)
    for _ in range(2):
        step()
    report = moe_path_allocations(model, step)
    assert report.count >= 2 * 2 * 4, report.describe()  # layers x micro-batches x a few each
    assert any("_FusedRoute" in k for k in report.where), report.describe()
    assert any("moe_backward" in k for k in report.where), report.describe()


@pytest.mark.parametrize("arenas, precision, options", [
    (False, "fp32", {}), (False, "bf16", {"overlap_chunks": 2}), (True, "fp32", {}),
    (False, "fp32", {"activation": "gelu", "shared_expert_ffn_hidden_size": 48})],
    ids=["arenas_off", "arenas_off_bf16_chunks", "arenas_on", "arenas_off_gelu_shared"])
def test_the_counters_op_tree_equals_the_profilers_function_events(arenas, precision, options):
    # moe_path_allocations reads the profiler's raw events (allocations._op_tree: ~1 s less per
    # count than building torch's FunctionEvents); from the same profile, torch's own tree must
    # give the same count, bytes and places, with allocations to find and without.
    model, step = _setup(True, precision, moe_options=options)
    if not arenas:
        _arenas_off(model)
    for _ in range(2):
        step()
    prof = allocations._profile(model, step)
    ours = allocations._tally(allocations._self_bytes_of_ops(prof))
    torchs = allocations._tally(allocations._self_bytes_of_function_events(prof))
    assert ours == torchs, (ours.describe(), torchs.describe())
    assert (ours.count > 0) != arenas, ours.describe()


def test_registered_layers_own_their_arena_and_it_stops_growing():
    model, step = _setup(True)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    rt = layers[0].runtime.runtime
    assert [m.workspace for m in layers] == [h.workspace for h in rt.handles]
    assert layers[0].workspace is not layers[1].workspace
    for _ in range(3):
        step()
    held = rt.workspace_bytes()
    assert held > 0
    step()
    assert rt.workspace_bytes() == held


def test_arena_reuses_only_free_buffers_and_serves_varying_sizes_from_one_class():
    arena = workspace.Arena()
    with workspace.arena_scope(arena):
        a = workspace.empty((10, 3), torch.float32)
        b = workspace.empty((10, 3), torch.float32)
        assert a.data_ptr() != b.data_ptr()  # a is held: not handed out twice
        ptr = a.data_ptr()
        del a
        c = workspace.empty((7, 4), torch.float32)  # 112 bytes: the same 128-byte class
        assert c.data_ptr() == ptr and c.shape == (7, 4)
        big = workspace.empty((workspace.MIN_BYTES // 4,), torch.float32)
    assert arena.nbytes == 2 * 128  # the large buffer is not the arena's (it has no workspace)
    assert big.numel() == workspace.MIN_BYTES // 4
    assert workspace.empty((4,), torch.float32).data_ptr() not in (ptr, b.data_ptr())  # no arena


@pytest.mark.parametrize("shape", [(), (0,), (5, 0, 3), (7,), (3, 5), (2, 3, 4), (300, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_buffers_are_shaped_strided_and_typed_as_torch_empty_gives_them(shape, dtype):
    """Arena and cache buffers are handed out as one as_strided view of a longer buffer (the
    cache's reinterpreted from bytes): the same sizes, strides and dtype as torch.empty's,
    writable, and holding the buffer live while they exist."""
    want = torch.empty(shape, dtype=dtype)
    with workspace.arena_scope(workspace.Arena()):
        t = workspace.empty(shape, dtype)
        assert (t.shape, t.stride(), t.dtype) == (want.shape, want.stride(), want.dtype)
        assert t.is_contiguous() and t.storage_offset() == 0
        t.copy_(torch.ones(shape, dtype=dtype))  # every element its own memory
        assert t.numel() == 0 or bool(t.all())
        if t.numel():
            again = workspace.empty(shape, dtype)  # t is live: another buffer
            assert again.data_ptr() != t.data_ptr()


def test_arena_keeps_a_bounded_number_of_buffers_per_class():
    arena = workspace.Arena()
    held = [arena.empty((16,), torch.int64) for _ in range(arena.MAX_PER_CLASS + 5)]
    assert len({t.data_ptr() for t in held}) == len(held)
    assert arena.nbytes == arena.MAX_PER_CLASS * 128


def test_gate_gemm_matches_autograd_of_the_matmul_bitwise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g, requires_grad=True)
    w = torch.randn(12, 96, generator=g, requires_grad=True)
    grad = torch.randn(300, 12, generator=g)
    with workspace.arena_scope(workspace.Arena()):
        ours = router_logits(x, w)
        ours.backward(grad)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = x @ w.t()
    ref.backward(grad)
    assert ours.grad_fn.name().endswith("_LinearBackward")
    assert torch.equal(ours, ref) and torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


@pytest.mark.parametrize("terms, acc, words", [
    ([("z_loss", 1e-3)], None, ["loss type 'z_loss' unknown", "Fix: use one of aux_loss"]),
    ([("global_aux_loss", 1e-2)], None, ["global_aux_loss needs acc_counts_E",
                                          "Fix: pass the step's accumulated expert counts"]),
])
def test_aux_losses_from_stats_refuses_bad_terms_naming_the_fix(terms, acc, words):
    mean_BE, counts_BE = torch.rand(1, 8), torch.randint(0, 5, (1, 8))
    with workspace.arena_scope(workspace.Arena()), pytest.raises(ValueError) as e:
        WL.aux_losses_from_stats(mean_BE, counts_BE, 16, 2, terms, acc)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("B, E", [(1, 8), (1, 64), (3, 16)])
def test_aux_loss_from_stats_matches_the_torch_composition_bitwise(B, E):
    g = torch.Generator().manual_seed(E)
    mean_BE = torch.rand(B, E, generator=g).requires_grad_(True)
    counts_BE = torch.randint(0, 50, (B, E), generator=g)
    T, K, coeff = 777, 3, 1e-2
    with workspace.arena_scope(workspace.Arena()):
        total, value = switch_aux_loss_from_stats(mean_BE, counts_BE, T, K, coeff)
        (total * 3.7).backward()
    ours = mean_BE.grad.clone()
    mean_BE.grad = None
    ref_value = switch_aux_loss_from_mean(mean_BE.mean(dim=0), counts_BE.sum(dim=0), T, K)
    ref_total = mean_BE.new_zeros(()) + coeff * ref_value
    (ref_total * 3.7).backward()
    assert torch.equal(total, ref_total) and torch.equal(value, ref_value)
    assert not value.requires_grad
    assert torch.equal(ours, mean_BE.grad)


def test_permute_probs_matches_index_put_bitwise():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (50, 3), generator=g)
    _, row_map, _ = permute(torch.randn(50, 8), ids, 6)
    probs = torch.rand(50, 3, generator=g, requires_grad=True)
    grad = torch.randn(150, generator=g)
    with workspace.arena_scope(workspace.Arena()):
        ours = permute_probs(probs, row_map)
        ours.backward(grad)
    gp = probs.grad.clone()
    probs.grad = None
    ref = probs.new_zeros(150).index_put((row_map.reshape(-1),), probs.reshape(-1))
    ref.backward(grad)
    assert torch.equal(ours, ref) and torch.equal(gp, probs.grad)


def _aux_composition(mean_BE, counts_BE, T, K, terms, acc_counts_E, acc_tokens):
    # The router's general path over the fused router's statistics (plugins routers.py).
    B = mean_BE.shape[0]
    total, values = mean_BE.new_zeros(()), {}
    for loss_type, coeff in terms:
        if loss_type == "aux_loss":
            value = switch_aux_loss_from_mean(mean_BE.mean(dim=0), counts_BE.sum(dim=0), T, K)
        elif loss_type == "global_aux_loss":
            value = switch_aux_loss_from_mean(mean_BE.mean(dim=0), acc_counts_E, acc_tokens, K)
        else:
            value = seq_aux_loss_from_stats(mean_BE, counts_BE, T // B, K)
        values[loss_type] = value.detach()
        total = total + coeff * value
    return total, values


@pytest.mark.parametrize("B, E", [(1, 8), (4, 16), (3, 64)])
@pytest.mark.parametrize("types", [["seq_aux_loss"], ["global_aux_loss"],
                                   ["aux_loss", "seq_aux_loss"],
                                   ["seq_aux_loss", "global_aux_loss"],
                                   ["aux_loss", "seq_aux_loss", "global_aux_loss"],
                                   ["global_aux_loss", "aux_loss", "seq_aux_loss"]])
def test_aux_losses_from_stats_match_the_torch_composition_bitwise(types, B, E):
    g = torch.Generator().manual_seed(E + B)
    mean_BE = torch.rand(B, E, generator=g).requires_grad_(True)
    counts_BE = torch.randint(0, 50, (B, E), generator=g)
    acc_counts_E = counts_BE.sum(0) + torch.randint(0, 90, (E,), generator=g)
    T, K, acc_tokens = 777 * B, 3, 777 * B * 3
    terms = [(t, c) for t, c in zip(types, (1e-2, 3.3e-3, 7e-4))]
    with workspace.arena_scope(workspace.Arena()):
        total, values = WL.aux_losses_from_stats(mean_BE, counts_BE, T, K, terms, acc_counts_E,
                                                 acc_tokens)
        (total * 3.7).backward()
    ours = mean_BE.grad.clone()
    mean_BE.grad = None
    ref_total, ref_values = _aux_composition(mean_BE, counts_BE, T, K, terms, acc_counts_E,
                                             acc_tokens)
    (ref_total * 3.7).backward()
    assert torch.equal(total, ref_total)
    assert values.keys() == ref_values.keys()
    assert all(torch.equal(values[t], ref_values[t]) and not values[t].requires_grad
               for t in types)
    assert torch.equal(ours, mean_BE.grad)


@pytest.mark.parametrize("T, E, scale", [(1, 8, 1.0), (300, 16, 3.0), (77, 64, 30.0)])
@pytest.mark.parametrize("total_grad", [True, False])
def test_add_z_loss_matches_the_torch_composition_bitwise(T, E, scale, total_grad):
    g = torch.Generator().manual_seed(T)
    logits = (scale * torch.randn(T, E, generator=g)).requires_grad_(True)
    with torch.no_grad():
        logits[0, 0] = float("-inf")  # a masked expert: exp(-inf) = 0 in the sum and the grad
    total_in = torch.rand((), generator=g).requires_grad_(total_grad)
    with workspace.arena_scope(workspace.Arena()):
        total, z = WL.add_z_loss(total_in, logits, 1e-3)
        (total * 3.7).backward()
    ours = logits.grad.clone(), None if total_in.grad is None else total_in.grad.clone()
    logits.grad = total_in.grad = None
    ref_z = z_loss(logits)
    ref_total = total_in + 1e-3 * ref_z
    (ref_total * 3.7).backward()
    assert torch.equal(total, ref_total) and torch.equal(z, ref_z) and not z.requires_grad
    assert torch.equal(ours[0], logits.grad)
    assert (ours[1] is None) == (total_in.grad is None)
    assert ours[1] is None or torch.equal(ours[1], total_in.grad)


@pytest.mark.parametrize("keep", [False, True])
def test_expert_counts_in_the_arena_match_bincount(keep):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (500, 4), generator=g)
    keep_TK = torch.rand(500, 4, generator=g) > 0.3 if keep else None
    with workspace.arena_scope(workspace.Arena()):
        ours = expert_counts(ids, 12, keep_TK)
    ref = torch.bincount(ids.reshape(-1) if keep_TK is None else ids[keep_TK], minlength=12)
    assert torch.equal(ours, ref)


def _routed(T=200, E=8, K=2, seed=0, ties=False, nan=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].contiguous()
    probs = torch.rand(T, K, generator=g)
    if ties:  # equal weights: the stable sort's token order decides
        probs = (probs * 4).round() / 4
    if nan:  # a stable descending sort puts NaN first: the kernel must agree
        probs[torch.rand(T, K, generator=g) < 0.05] = float("nan")
    return probs.requires_grad_(True), ids


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("ties,nan", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("capacity", [1, 30, 49])
def test_capacity_dropping_in_the_arena_matches_torch_exactly(policy, ties, nan, capacity):
    probs, ids = _routed(ties=ties, nan=nan)
    grad = torch.randn(200, 2, generator=torch.Generator().manual_seed(1))
    with workspace.arena_scope(workspace.Arena()):
        ours_p, ours_d = drop_over_capacity(probs, ids, 8, capacity, policy)
        ours_p.backward(grad)
        frac = capacity_mod.dropped_fraction(ours_d)
        keep = capacity_mod.kept(ours_d)
    assert ours_p.grad_fn.name().endswith("_ZeroDroppedBackward")
    gp = probs.grad.clone()
    probs.grad = None
    ref_d = capacity_mod._dropped_by_torch(probs, ids, 8, capacity, policy)
    ref_p = probs.masked_fill(ref_d, 0.0)
    ref_p.backward(grad)
    assert ref_d.any() and not ref_d.all()  # something dropped, something kept
    assert torch.equal(ours_d, ref_d) and torch.equal(ours_p.nan_to_num(), ref_p.nan_to_num())
    assert torch.equal(gp, probs.grad)
    assert torch.equal(frac, ref_d.float().mean()) and torch.equal(keep, ~ref_d)


@pytest.mark.parametrize("seed", range(4))
def test_capacity_kernel_matches_torch_on_larger_routings(seed):
    # Many ties (probs on a grid of 8 values) at a training-like shape, bf16 probs (the kernel
    # reads an fp32 copy) and a capacity that drops from most experts.
    probs, ids = _routed(T=1024, E=16, K=4, seed=seed, ties=True)
    probs = (probs.detach() * 2).round().div(2).to(torch.bfloat16)
    capacity = 200 + 10 * seed
    with workspace.arena_scope(workspace.Arena()):
        ours = capacity_mod._dropped_in_workspace(probs, ids, 16, capacity, "probs")
    ref = capacity_mod._dropped_by_torch(probs, ids, 16, capacity, "probs")
    assert ref.sum() > 0 and torch.equal(ours, ref)


def test_capacity_kernel_names_a_bad_expert_id():
    probs, ids = _routed()
    ids[7, 1] = 8
    with pytest.raises(ValueError, match=r"ids\[7, 1\] = 8 is not a valid expert id"):
        capacity_mod._dropped_in_workspace(probs, ids, 8, 10, "probs")


def test_sink_rows_in_the_arena_match_torch_exactly():
    g = torch.Generator().manual_seed(2)
    probs, ids = _routed()
    dropped = torch.rand(200, 2, generator=g) > 0.7
    x = torch.randn(400, 16, generator=g, requires_grad=True)
    y = torch.randn(300, 16, generator=g, requires_grad=True)
    gx, gy = torch.randn(300, 16, generator=g), torch.randn(350, 16, generator=g)
    with workspace.arena_scope(workspace.Arena()):
        sunk = sink_dropped(ids, dropped, 8)
        head, tail = first_rows(x, 300), append_sink_rows(y, 50)
        head.backward(gx)
        tail.backward(gy)
    ours = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    x[:300].backward(gx)
    torch.cat([y, y.new_zeros(50, 16)]).backward(gy)
    assert torch.equal(sunk, ids.masked_fill(dropped, 8))
    assert torch.equal(head, x[:300]) and torch.equal(tail, torch.cat([y, y.new_zeros(50, 16)]))
    assert torch.equal(ours[0], x.grad) and torch.equal(ours[1], y.grad)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("T", [1, 64, 77])
def test_shared_experts_in_the_arena_match_nn_linear_and_the_activation_bitwise(T, autocast,
                                                                               gate, activation):
    from moeplug.config import MoEConfig
    from moeplug.moe.shared_experts import SharedExperts, add_shared
    torch.manual_seed(T)
    m = SharedExperts(32, MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=32,
                                    shared_expert_ffn_hidden_size=48, shared_expert_gate=gate,
                                    activation=activation))
    # x is a layer's output, as in the MoE layer (autocast caches the cast of a leaf); both
    # linears use it, so its grad is the sum of their cast-back grads. Under bf16 autocast the
    # routed output is bf16 too.
    x_leaf = torch.randn(T, 32, requires_grad=True)
    y = torch.randn(T, 32, dtype=torch.bfloat16 if autocast else torch.float32,
                    requires_grad=True)
    grad = torch.randn(T, 32, dtype=y.dtype)
    params = [x_leaf, y, *m.parameters()]

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            x = x_leaf * 2.0
            assert m._in_workspace(x) == (m._in_workspace is not _torch_path)
            out = add_shared(y, m(x))
        out.backward(grad)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out, grads

    with workspace.arena_scope(workspace.Arena()):
        out, ours = run()
    assert out.grad_fn.name().endswith("_AddOutputsBackward")
    m._in_workspace = _torch_path  # the nn.Linear / cat / activations path
    ref, theirs = run()
    assert out.dtype == ref.dtype == y.dtype and torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_shared_experts_leave_an_autocast_cached_input_to_torch():
    # Autocast casts a leaf that requires grad once per region and sums its grads in bf16
    # before the cast back; the per-linear casts would not, so such an input keeps torch.
    from moeplug.config import MoEConfig
    from moeplug.moe.shared_experts import SharedExperts
    m = SharedExperts(32, MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=32,
                                    shared_expert_ffn_hidden_size=48))
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not m._in_workspace(x) and m._in_workspace(x * 1.0)
    assert m._in_workspace(x)


def _torch_path(_x):
    return False


@pytest.mark.parametrize("capacity, multiple", [(None, 16), (None, 5), (40, 1), (20, 1)])
def test_padded_counts_in_the_arena_match_torch(capacity, multiple):
    counts_L = torch.tensor([3, 0, 17, 16, 1, 20])
    with workspace.arena_scope(workspace.Arena()):
        ours = padded_counts(counts_L, capacity, multiple, ep_size=1 if capacity == 40 else 2)
    limit = 40
    ref = (torch.full_like(counts_L, limit) if capacity else
           (counts_L + multiple - 1) // multiple * multiple)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)


def _pad_composition(x_SD, probs_S, counts_L, target_L):
    # rows.pad_rows's torch path (taken off the CPU), written out.
    src_start_L = torch.cumsum(counts_L, 0) - counts_L
    dst_start_L = torch.cumsum(target_L, 0) - target_L
    expert_S = torch.repeat_interleave(torch.arange(len(counts_L)), counts_L)
    index_S = torch.arange(x_SD.shape[0]) - src_start_L[expert_S] + dst_start_L[expert_S]
    P = int(target_L.sum())
    return (x_SD.new_zeros(P, x_SD.shape[1]).index_copy(0, index_S, x_SD),
            probs_S.new_zeros(P).index_copy(0, index_S, probs_S), index_S)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity, multiple", [(None, 16), (25, 1)])
def test_pad_and_unpad_rows_in_the_arena_match_torch_bitwise(dtype, capacity, multiple):
    g = torch.Generator().manual_seed(3)
    counts_L = torch.tensor([3, 0, 17, 16, 25, 1])  # an empty expert, one already full
    S = int(counts_L.sum())
    x_SD = torch.randn(S, 24, generator=g).to(dtype).requires_grad_(True)
    probs_S = torch.rand(S, generator=g).requires_grad_(True)
    target_L = padded_counts(counts_L, capacity, multiple)
    grad_S = torch.randn(S, 24, generator=g).to(dtype)
    grad_S[::7] = -0.0  # 0 + (-0.0) is +0.0 in the unpad's backward: not a plain copy
    grad_P = torch.randn(int(target_L.sum()), generator=g)

    def run(pad, unpad):
        x_PD, probs_P, index_S = pad(x_SD, probs_S, counts_L, target_L)
        y_SD = unpad(x_PD * 3, index_S)  # the experts' output, back to the real rows
        torch.autograd.backward([y_SD, probs_P], [grad_S, grad_P])
        out = [x_PD, probs_P, index_S, y_SD, x_SD.grad, probs_S.grad]
        x_SD.grad = probs_S.grad = None
        return out, x_PD

    with workspace.arena_scope(workspace.Arena()):
        ours, x_PD = run(pad_rows, unpad_rows)
    assert x_PD.grad_fn.name().endswith("_PadRowsBackward")
    theirs, _ = run(_pad_composition, lambda y, i: y.index_select(0, i))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs))
    # the -0.0 grads: unpad's backward made them +0.0, which 3 * keeps apart from -0.0
    assert torch.equal(ours[4].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       theirs[4].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_jitter_in_the_arena_matches_the_torch_composition_bitwise(dtype):
    """_Jitter draws the same noise from the global RNG as ``empty_like(x).uniform_`` and gives
    the same product and gradient as ``x * noise``; a non-contiguous x takes the torch path."""
    from moeplug.routing.gating import input_jitter
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 24, generator=g).to(dtype).requires_grad_(True)
    grad = torch.randn(37, 24, generator=g).to(dtype)

    def run(fn):
        torch.manual_seed(11)
        y = fn(x)
        y.backward(grad)
        out = (y.detach().clone(), x.grad.clone(), torch.rand(3))  # the RNG moved alike
        x.grad = None
        return out
    with workspace.arena_scope(workspace.Arena()):
        ours = run(lambda t: input_jitter(t, 0.3))
    ref = run(lambda t: t * torch.empty_like(t).uniform_(0.7, 1.3))
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert not torch.equal(ours[0], x.detach())  # noise was applied
    # a non-contiguous x takes the torch path: the same as the composition on that view
    strided = run(lambda t: input_jitter(t.t(), 0.3).t())
    strided_ref = run(lambda t: (lambda v: v * torch.empty_like(v).uniform_(0.7, 1.3))(t.t()).t())
    assert all(torch.equal(a, b) for a, b in zip(strided, strided_ref))


def test_force_balanced_logits_in_the_arena_match_randn_bitwise():
    from moeplug.routing.gating import force_balanced_logits
    logits = torch.randn(29, 8).requires_grad_(True)
    with workspace.arena_scope(workspace.Arena()):
        ours = force_balanced_logits(logits, seed=7)
    ref = torch.randn(29, 8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(ours, ref)
    ours.sum().backward()
    assert torch.equal(logits.grad, torch.ones(29, 8))  # straight through


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_rows_in_the_arena_matches_the_broadcast_mul_bitwise(dtype):
    from moeplug.ops.scale_rows import ones, scale_rows
    g = torch.Generator().manual_seed(5)
    x_SD = torch.randn(77, 40, generator=g).to(dtype).requires_grad_(True)
    probs_S = torch.rand(77, generator=g).requires_grad_(True)
    grad = torch.randn(77, 40, generator=g).to(dtype)
    with workspace.arena_scope(workspace.Arena()):
        ours = scale_rows(x_SD, probs_S)
        ours.backward(grad)
        one = ones(probs_S)
    assert ours.grad_fn.name().endswith("_ScaleRowsBackward")
    gx, gp = x_SD.grad.clone(), probs_S.grad.clone()
    x_SD.grad = probs_S.grad = None
    ref = x_SD * probs_S.unsqueeze(-1).to(dtype)  # moe.py's composition before
    ref.backward(grad)
    assert torch.equal(ours, ref) and torch.equal(one, torch.ones_like(probs_S))
    assert gx.dtype == dtype and gp.dtype == torch.float32
    assert torch.equal(gx, x_SD.grad) and torch.equal(gp, probs_S.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ranges_and_their_cat_in_the_arena_match_slicing_and_torch_cat_bitwise(dtype):
    # moe_overlap's chunks: x sliced per chunk (three slices, so x's grad is a sum of three
    # slice backwards), the chunks' outputs joined.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(77, 16, generator=g).to(dtype).requires_grad_(True)
    grad = torch.randn(77, 16, generator=g).to(dtype)
    spans = [(0, 25), (25, 51), (51, 77)]

    def run(rows, cat):
        out = cat([rows(x, t0, t1) * (i + 2) for i, (t0, t1) in enumerate(spans)])
        out.backward(grad)
        gx = x.grad
        x.grad = None
        return out, gx

    with workspace.arena_scope(workspace.Arena()):
        ours = run(row_range, cat_rows)
    assert ours[0].grad_fn.name().endswith("_CatRowsBackward")
    theirs = run(lambda t, t0, t1: t[t0:t1], torch.cat)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "squared_relu"])
def test_activation_times_probs_into_buffers_matches_autograd_bitwise(activation, dtype,
                                                                      probs_dtype):
    # grouped_mlp's act(h) * p and its vjp (moeplug.ops.activations) against autograd over
    # activation_fn's composition: same values, dp in the routing weights' own dtype.
    from moeplug.ops.activations import (act_times_probs, act_times_probs_backward,
                                         activation_fn, fc1_rows)
    g = torch.Generator().manual_seed(5)
    S, F = 37, 21  # odd widths: the vector kernels' scalar tails
    h = (torch.randn(S, fc1_rows(activation, F), generator=g) * 3).to(dtype)
    h[0, :4] = torch.tensor([0.0, -0.0, 1e-3, -1e-3]).to(dtype)  # relu's and gelu's kinks
    p = None if probs_dtype is None else torch.rand(S, generator=g).to(probs_dtype)
    grad = torch.randn(S, F, generator=g).to(dtype)

    h_ref = h.clone().requires_grad_(True)
    p_ref = None if p is None else p.clone().requires_grad_(True)
    a_ref = activation_fn(activation)(h_ref)
    if p_ref is not None:
        a_ref = a_ref * p_ref.unsqueeze(-1).to(a_ref.dtype)
    want = torch.autograd.grad(a_ref, [h_ref] + ([p_ref] if p is not None else []), grad)

    def empty(shape, dt):
        return torch.full(shape, float("nan"), dtype=dt)  # poisoned: every element is written

    a = act_times_probs(h, p, activation, empty)
    dh, dp = act_times_probs_backward(grad, h, p, activation, p is not None, empty)
    assert torch.equal(a, a_ref) and torch.equal(dh, want[0])
    if p is not None:
        assert dp.dtype == p.dtype and torch.equal(dp, want[1])
    else:
        assert dp is None


# Per dispatcher (and options): the exchanges the counter must see allocate when the arenas
# are off. hierarchical runs as one node of 2 ranks (its shared-memory fan-out) and as 2 nodes
# of 1 (its network all-to-all).
EP2_CASES = {
    "alltoall": ("alltoall", {}, ("_AllToAll", "_MoveChunks")),
    "allgather": ("allgather", {}, ("_GatherScatter <-", "_GatherScatterBackward")),
    "direct_write": ("direct_write", {}, ("_DispatchStart", "_CombineWait")),
    "hierarchical-1x2": ("hierarchical", {}, ("_ShmMove", "_IndexRows")),
    "hierarchical-2x1": ("hierarchical", {"node_size": 1}, ("_AllToAll", "_IndexRows")),
}


@pytest.mark.parametrize("case", sorted(EP2_CASES))
def test_ep2_steps_allocate_next_to_nothing_on_the_moe_path(case):
    # Real gloo ranks: the count exchange, the row exchanges (all-to-all; all-gather and
    # reduce-scatter; direct_write's shared-memory plan and sums; hierarchical's dedupe,
    # network and fan-out) and the sort by local expert (and their backwards) take their
    # buffers from the layer's workspace. Not exactly zero as in one process: the rows each
    # expert receives depend on the other rank's routing, and a step that brings a new peak
    # (a row count past every earlier one, or more buffers of one size class live at once)
    # still allocates its buffer, a few times in ten steps (at most 4 in a step seen).
    # Without the arenas the same steps allocate ~150 buffers each (allgather ~270,
    # direct_write ~260, hierarchical ~370), and the counter must see the exchanges among
    # them (else the bound proves nothing).
    dispatcher, options, exchanges = EP2_CASES[case]
    from moeplug.testing.distributed import run_distributed
    from moeplug.testing.steps import two_rank_moe_allocations
    on = run_distributed(two_rank_moe_allocations, 2, dispatcher, True, options, timeout=240)
    off = run_distributed(two_rank_moe_allocations, 2, dispatcher, False, options, timeout=240)
    for (count_on, where_on), (count_off, where_off) in zip(on, off):
        assert count_on <= 8, "\n".join(f"{n} x {k}" for k, n in where_on.items())
        assert count_off >= 100, where_off
        for exchange in exchanges:
            assert any(exchange in k for k in where_off), (exchange, where_off)


def test_ep2_sync_free_steps_allocate_nothing_on_the_moe_path():
    # runtime.sync_free at EP2 (real gloo ranks, the stash on): every exchange has a static
    # shape (equal chunks of L*C rows, the [W, L] counts), so unlike the dynamic dispatchers'
    # row counts no step brings a new size: exactly zero. With the arenas off the counter sees
    # the static stages' Functions and the exchanges allocate.
    from moeplug.testing.distributed import run_distributed
    from moeplug.testing.steps import two_rank_moe_allocations
    args = (None, None, None, {"sync_free": True})
    on = run_distributed(two_rank_moe_allocations, 2, "alltoall", True, *args, timeout=240)
    off = run_distributed(two_rank_moe_allocations, 2, "alltoall", False, *args, timeout=240)
    for (count_on, where_on), (_, where_off) in zip(on, off):
        assert count_on == 0, "\n".join(f"{n} x {k}" for k, n in where_on.items())
        for op in ("_ToSlots", "_GroupedFFN", "_FromSlotsBackward", "_AllToAll"):
            assert any(op in k for k in where_off), (op, where_off)


# TP2: the MoE layer's input, this rank's chunk of the tokens, is a [B, S/tp, D] view of s-major
# ([S, B, D]) activations, flattened (and its grad reshaped back) by a copy, and the router's
# losses run over the token group: f_i counts the group's tokens (the counts all-reduced over
# it) and the layer averages the ranks' losses (an all-reduce / W). All of it ran as torch ops
# (92 allocating ops in the two steps, 208 with all three aux losses, measured 2026-11-27) and
# now runs in the layer's arena.
TP2_CASES = {
    "tp2": ({"tp": 2}, {}),
    "tp2_all_aux_losses": ({"tp": 2}, {"load_balancing_type": ["aux_loss", "seq_aux_loss",
                                                               "global_aux_loss"],
                                       "aux_loss_coeff": [1e-2, 2e-2, 3e-2]}),
}


@pytest.mark.parametrize("case", sorted(TP2_CASES))
def test_tp2_steps_allocate_nothing_on_the_moe_path_and_match_the_torch_ops(case):
    parallel, router_options = TP2_CASES[case]
    from moeplug.testing.distributed import run_distributed
    from moeplug.testing.steps import two_rank_moe_allocations, two_rank_trajectory
    args = ("alltoall", True, None, parallel, router_options)
    off_args = ("alltoall", False, None, parallel, router_options)
    on = run_distributed(two_rank_moe_allocations, 2, *args, timeout=240)
    off = run_distributed(two_rank_moe_allocations, 2, *off_args, timeout=240)
    for (count_on, where_on), (_, where_off) in zip(on, off):
        assert count_on == 0, "\n".join(f"{n} x {k}" for k, n in where_on.items())
        # With the arenas off the layer runs the torch ops again (the flatten's copy, its
        # grad's, the all-reduce's clone) and the loss Function takes torch's buffers: the
        # counter must see each of them.
        for op in ("aten::clone <- aten::reshape <- moeplug::moe_forward",
                   "aten::reshape <- ViewBackward0", "_AllReduce", "_AuxFromStats"):
            assert any(op in k for k in where_off), (op, where_off)
    # Without the arenas the flatten, its grad and the ranks' mean are the torch ops again:
    # losses, grad norms and parameters after four steps are bitwise the same.
    for (log_on, params_on), (log_off, params_off) in zip(
            run_distributed(two_rank_trajectory, 2, *args, timeout=240),
            run_distributed(two_rank_trajectory, 2, *off_args, timeout=240)):
        assert log_on == log_off
        assert all(torch.equal(p, params_off[n]) for n, p in params_on.items())
