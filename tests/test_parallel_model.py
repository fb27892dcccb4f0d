"""The whole model trained on 2 real ranks equals one process trained on the concatenated batch.

Layouts on 2 ranks (tp = cp = pp = 1): EP2 (experts split, attention/router/embeddings replicated
and data-parallel: EP = world, EDP = 1, DP = 2) with each dispatcher, and plain DP2 (EP1). Every
rank builds the single-process reference itself from the same seed, copies its shard of the
weights (moeplug.parallel.sharding.load_expert_shard) and runs 3 AdamW steps with
sync_gradients + the global-norm clip; the reference runs the same steps on the whole batch with
torch's own clip_grad_norm_. Compared: the loss sequence (mean over every token: the ranks' mean
losses averaged over DP, equal token counts), the grad norm (clipping is active: the norms are
above MAX_NORM), and every final parameter (expert params against the rank's slice).

aux_loss_coeff = 0 in the concatenated-batch layouts: the Switch aux loss is a product of two
per-batch means, so a rank's loss on half the tokens is not half of the whole batch's. A last
layout keeps the aux loss and compares with one process that averages the per-shard losses
(Megatron's micro-batch aux loss, which is what data parallelism computes).
"""

from __future__ import annotations

import pytest
import torch

from moeplug.testing.distributed import run_distributed

WORLD, V, B_PER_RANK, SEQ = 2, 64, 2, 8
MAX_NORM = 0.05   # well under the tiny model's grad norm, so clipping always acts
TOL = 1e-5        # fp32, 3 AdamW steps

# (name, ep, dispatcher, aux_loss_coeff)
LAYOUTS = [("ep2_alltoall", 2, "alltoall", 0.0), ("ep2_allgather", 2, "allgather", 0.0),
           ("dp2_ep1", 1, "alltoall", 0.0), ("ep2_alltoall_aux", 2, "alltoall", 0.05)]


def _cfg(dispatcher: str, aux: float):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "model": {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "init_std": 0.1,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8,
                          "aux_loss_coeff": aux}},
        "plugins": {"dispatcher": dispatcher},
        "train": {"seq_len": SEQ},
    })


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (WORLD * B_PER_RANK, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _train_layouts(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    from moeplug.build import build_model
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.experts import expert_param_names, local_expert_ids
    from moeplug.parallel.sharding import load_expert_shard
    from moeplug.parallel.grad_sync import clip_grad_norm, sync_gradients
    from moeplug.plugin_host import PluginHost

    host = PluginHost.load()
    report: dict[str, dict[str, float]] = {}
    for name, ep, dispatcher, aux in LAYOUTS:
        cfg = _cfg(dispatcher, aux)
        groups = ParallelGroups.build(ParallelConfig(ep=ep), world, rank)
        ep_rank, ep_size = groups.rank_in("ep"), groups.size("ep")
        dp_rank, dp_size = groups.rank_in("dp"), groups.size("dp")
        torch.manual_seed(0)
        ref = build_model(cfg, host, V)
        model = build_model(cfg, host, V, ep_group=groups.ep)
        load_expert_shard(model, ref.state_dict(), ep_rank, ep_size)
        opt_ref, opt = _adamw(ref.parameters()), _adamw(model.parameters())
        errs = {"loss": 0.0, "grad_norm": 0.0, "min_ref_norm": float("inf")}
        for step in range(3):
            tokens, targets = _batch(step)
            # reference: one process, the whole batch
            if aux:  # per-shard losses averaged (see the module docstring)
                ref_loss = sum(ref(t, y).loss for t, y in zip(tokens.chunk(dp_size),
                                                              targets.chunk(dp_size))) / dp_size
            else:
                ref_loss = ref(tokens, targets).loss
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
            # this rank: its DP shard of the batch
            rows = slice(dp_rank * B_PER_RANK * world // dp_size,
                         (dp_rank + 1) * B_PER_RANK * world // dp_size)
            loss = model(tokens[rows], targets[rows]).loss
            loss.backward()
            sync_gradients(model, groups)
            norm = clip_grad_norm(model, groups, MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # every rank holds one DP shard here (tp = cp = 1)
            global_loss /= world
            errs["loss"] = max(errs["loss"], abs(global_loss.item() - ref_loss.item()))
            errs["grad_norm"] = max(errs["grad_norm"], abs(norm.item() - ref_norm.item()))
            errs["min_ref_norm"] = min(errs["min_ref_norm"], ref_norm.item())
        expert_names = expert_param_names(model)
        mine = local_expert_ids(cfg.model.moe.num_experts, ep_size, ep_rank)
        ref_params = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            want = ref_params[pname]
            if pname in expert_names:
                want = want[mine.start:mine.stop]
            errs[f"param/{pname}"] = (p.detach() - want.detach()).abs().max().item()
        errs["num_expert_params"] = float(len(expert_names))
        report[name] = errs
    return report


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_train_layouts, WORLD, timeout=180)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_three_adamw_steps_match_single_process(reports, layout):
    for rank, report in enumerate(reports):
        errs = report[layout]
        assert errs["num_expert_params"] == 2  # gate_up_proj + down_proj of the one MoE layer
        assert errs["min_ref_norm"] > 2 * MAX_NORM, "clipping must act for the norm to be tested"
        bad = {k: v for k, v in errs.items()
               if k not in ("min_ref_norm", "num_expert_params") and not v <= TOL}
        assert not bad, f"{layout}, rank {rank}: differs from one process by more than {TOL}: {bad}"


def test_single_process_sync_is_a_no_op_and_clip_matches_torch():
    # One process: sync_gradients leaves every grad as it is (DP = 1), and the global-norm clip
    # is torch's clip_grad_norm_ (same norm, same scaled grads).
    from moeplug.build import build_model
    from moeplug.parallel import ParallelConfig, ParallelGroups
    from moeplug.parallel.grad_sync import clip_grad_norm, sync_gradients
    from moeplug.plugin_host import PluginHost

    host = PluginHost.load()
    tokens, targets = _batch(0)
    grads = []
    for ours in (True, False):
        torch.manual_seed(0)
        model = build_model(_cfg("alltoall", 0.01), host, V)
        model(tokens, targets).loss.backward()
        if ours:
            before = [p.grad.clone() for p in model.parameters()]
            groups = ParallelGroups.build(ParallelConfig(), 1, 0)
            sync_gradients(model, groups)
            assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
            norm = clip_grad_norm(model, groups, MAX_NORM)
        else:
            norm_ref = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        grads.append([p.grad for p in model.parameters()])
    assert norm_ref > MAX_NORM
    torch.testing.assert_close(norm, norm_ref, rtol=1e-6, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
