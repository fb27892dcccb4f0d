"""The proof matrix: every parallel layout trains exactly like one process.

For each layout, every rank runs the REAL trainer pieces (moeplug.training.trainer.train_step,
step_batches, build_rank_optimizer; moeplug.training.distributed.build_rank_model) for 3 AdamW
steps, and so does a single-process reference built on the same rank from the same seed with
``single_process_equivalent`` (parallel section reset, grad_accum_steps x DP: DP rank r trains
micro-batches r*A..(r+1)*A-1 of each step). Compared after every step, on EVERY rank (rank 0
logs its own values, so each rank's must be one process's): the logged loss terms
(``StepStats.losses()``, the train record's loss / lm_loss / aux_loss: mean over micro-batches
and DP; without pipelines also its per-layer router losses and dropped fractions), the global
grad norm (clipping acts: the norm is above grad_clip), every gradient of
this rank against its shard of the reference gradient (TP/EP/ETP slices by shard_state_dict,
pipeline chunks by name); after 3 steps every parameter and the logged validation loss
(``evaluate`` on fixed batches, as the trainer's val record). The aux loss is on (coefficient
0.05): slicing whole micro-batches keeps it identical.

With the distributed optimizer the model's .grad hold the local, unreduced gradients (only the
owned slices are reduced), so there loss, norm and parameters are compared.

Packed documents (``*_docs`` rows, ``data.document_mask``): the tokens are a stream of short
documents ended by EOD; every micro-batch (validation's too) carries its document positions
(moeplug.data.documents.with_positions), CP-sharded with the tokens, passed through the
pipeline stages, whole under SP; compared with one process masking the same documents.

Pipelines cover tied embeddings (the last stage's embedding copy: its grad summed with the
first stage's, counted once in the grad norm, also by the distributed optimizer) and, at world
8, PP2 x EP2 x TP2 with sequence parallelism (one spawn of 8 ranks). CP composes with TP (with
and without SP, both K/V exchanges) and with PP: there each CP rank holds other tokens, so a
logged loss taken from one rank's chunk would differ from one process even with right grads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeplug.testing.distributed import run_distributed, run_layouts

V = 64
TOL = 2e-5       # fp32, 3 AdamW steps, absolute, on loss / grad norm / every grad and parameter
GRAD_CLIP = 0.05  # below the tiny model's grad norm, so clipping always acts
# AdamW divides by sqrt(v) + eps: at torch's 1e-8, a gradient element near 0 (|g| ~ 1e-8) turns
# the layout's different reduction order into an update of any size up to lr (cp2's
# parameters once differed by 4.8e-5 with every gradient within TOL). At 1e-5 such an element's
# update is ~lr * g / eps, so a rounding difference d in g moves the parameter by ~lr * d / eps
# (~1e-6 for a rounding of 1e-9): the parameters compare what the layouts compute, not the
# conditioning.
ADAM_EPS = 1e-5

# name -> (parallel overrides, dispatcher, grad_accum_steps[, model overrides]); the dispatcher
# is a name, or a plugins section (dispatcher, its options, router options) as made by _hier,
# _a2a and _dw.
TIED = {"tie_embeddings": True}
MTP = {"mtp_num_layers": 1}
DENSE_STAGE = {"first_k_dense": 2}  # pp2 over 4 layers: stage 0 holds the 2 dense ones
FP8_BF16_ENDS = {"dispatcher": "alltoall", "precision": "fp8_tensorwise",
                 "precision_options": {"bf16_first_layers": 1, "bf16_last_layers": 1}}
# fp8_delayed folds a step's amaxes into its histories once, the max over its micro-batches: the
# pipeline's schedule (2 micro-batches per rank, as one process) takes one process's scales.
DELAYED = {"dispatcher": "alltoall", "precision": "fp8_delayed"}
DROP = {"capacity_factor": 0.5}                        # the tiny model drops some choices
DROP_PAD = {"capacity_factor": 0.5, "pad_to_capacity": True}
DOCS = {"document_mask": True}  # the data section of the packed-documents rows
EOD = 0
MLA = {"attention": "mla", "mla": {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                   "qk_rope_head_dim": 4, "v_head_dim": 4}}
MLA_NO_Q_LORA = {"attention": "mla", "mla": {**MLA["mla"], "q_lora_rank": 0}}


def _hier(node_size: int, router: dict | None = None) -> dict:
    """hierarchical with ``node_size`` EP ranks per "node" (EP4 node 2: 2 nodes x 2 ranks)."""
    return {"dispatcher": "hierarchical", "dispatcher_options": {"node_size": node_size},
            "router_options": router or {}}


def _a2a(router: dict) -> dict:
    return {"dispatcher": "alltoall", "router_options": router}


def _dw(router: dict | None = None) -> dict:
    """direct_write (the shared-memory heap; every rank of these tests is on one machine)."""
    return {"dispatcher": "direct_write", "router_options": router or {}}


WORLD2 = {
    "ep2": ({"ep": 2}, "alltoall", 1),
    "ep2_allgather": ({"ep": 2}, "allgather", 1),
    "etp2": ({"etp": 2}, "alltoall", 1),
    "tp2": ({"tp": 2}, "alltoall", 1),
    "tp2_sp": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1),
    "cp2": ({"cp": 2}, "alltoall", 1),
    "pp2_1f1b": ({"pp": 2}, "alltoall", 2),
    "pp2_vpp2": ({"pp": 2, "vpp": 2}, "alltoall", 2),
    "pp2_tied": ({"pp": 2}, "alltoall", 2, TIED),
    "pp2_tied_distopt": ({"pp": 2, "distributed_optimizer": True}, "alltoall", 2, TIED),
    # A first stage of dense layers only: its rank has no MoE layer, yet must join the stash's
    # and sync-free's per-step flag all-reduce (it once skipped it, and both ranks hung).
    "pp2_dense_stage_stash": ({"pp": 2}, "alltoall", 2, DENSE_STAGE, {"stash": True}),
    "pp2_dense_stage_sync_free": ({"pp": 2}, "alltoall", 2, DENSE_STAGE, {"sync_free": True}),
    # The static region under ETP: the arrived chunks all-gathered over ETP, the F-slices'
    # partial outputs reduce-scattered back (moeplug.moe.budgeted.exchange).
    "etp2_sync_free": ({"etp": 2}, "alltoall", 1, None, {"sync_free": True}),
    # bf16_first/last_layers count the model's blocks, not each pipeline chunk's (they once
    # kept every stage's first and last block in bf16: another model than one process's).
    "pp2_fp8_bf16_ends": ({"pp": 2}, FP8_BF16_ENDS, 2),
    "pp2_fp8_delayed": ({"pp": 2}, DELAYED, 2),
    # Megatron layouts at PP2 x VPP2 (vpp from the string): an embedding-only first stage, a
    # loss-only last stage, 3 + 1 layers (rank 0: E, then layer 3; rank 1: layers 0-2, then L).
    "pp2_vpp2_layout_uneven": ({"pp": 2, "pipeline_layout": "E|ttt|t|L"}, "alltoall", 2),
    # MTP in its own stage, the last chunk of rank 0: that rank's two chunks share one embedding
    # (no copy, no embedding group) and the loss stage gets the MTP hidden states.
    "pp2_vpp2_layout_mtp": ({"pp": 2, "pipeline_layout": "Ett|tt|m|L"}, "alltoall", 2, MTP),
    # ... and tied: the loss stage's head is the embedding, a copy on rank 1.
    "pp2_vpp2_layout_mtp_tied": ({"pp": 2, "pipeline_layout": "Ett|tt|m|L"}, "alltoall", 2,
                                 {**MTP, **TIED}),
    # Megatron's account_for_embedding/loss_in_pipeline_split: 6 layers + E + L over 4 stages
    # of 2 (E t | tt | tt | t L), the split of the published Qwen3-235B rows.
    "pp2_vpp2_account_for": ({"pp": 2, "vpp": 2, "account_for_embedding_in_pipeline_split": True,
                              "account_for_loss_in_pipeline_split": True}, "alltoall", 2,
                             {"num_layers": 6}),
    "dp2_distopt": ({"distributed_optimizer": True}, "alltoall", 1),
    "dp2_ep2_distopt": ({"ep": 2, "distributed_optimizer": True}, "alltoall", 1),
    "ep2_hier": ({"ep": 2}, _hier(1), 1),
    "ep2_drop": ({"ep": 2}, _a2a(DROP), 1),
    "ep2_hier_drop": ({"ep": 2}, _hier(1, DROP), 1),
    "ep2_drop_pad": ({"ep": 2}, _a2a(DROP_PAD), 1),
    "ep2_hier_drop_pad": ({"ep": 2}, _hier(1, DROP_PAD), 1),
    "dp2_ep2_distopt_hier": ({"ep": 2, "distributed_optimizer": True}, _hier(1), 1),
    # direct_write at every EP layout, dropping and padding on and off
    "ep2_direct_write": ({"ep": 2}, _dw(), 1),
    "ep2_drop_direct_write": ({"ep": 2}, _dw(DROP), 1),
    "ep2_drop_pad_direct_write": ({"ep": 2}, _dw(DROP_PAD), 1),
    "dp2_ep2_distopt_direct_write": ({"ep": 2, "distributed_optimizer": True}, _dw(), 1),
    # packed documents, masked (attention within each document, RoPE restarting per document)
    "cp2_docs": ({"cp": 2}, "alltoall", 1, None, None, DOCS),
    "cp2_ring_docs": ({"cp": 2, "cp_comm": "ring"}, "alltoall", 1, None, None, DOCS),
    "tp2_sp_docs": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1, None, None, DOCS),
    "tp2_sp_mla_docs": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1, MLA, None, DOCS),
    # MLA split over TP (Megatron's): the down projections whole on every rank, their latents
    # entering the region, the up projections and o_proj split by heads; with and without SP,
    # with q_proj in place of the q LoRA, and with mla_up_proj recomputed
    "tp2_mla": ({"tp": 2}, "alltoall", 1, MLA),
    "tp2_sp_mla_no_q_lora": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1, MLA_NO_Q_LORA),
    "tp2_mla_no_q_lora": ({"tp": 2}, "alltoall", 1, MLA_NO_Q_LORA),
    "tp2_sp_mla_recompute_up": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1,
                                {**MLA, "recompute": {"granularity": "selective",
                                                      "modules": ["mla_up_proj", "core_attn"]}}),
    "ep2_docs": ({"ep": 2}, "alltoall", 1, None, None, DOCS),
    "pp2_docs": ({"pp": 2}, "alltoall", 2, None, None, DOCS),
    # MTP under TP (Megatron's MTP layer): eh_proj column-parallel with its output gathered,
    # the MTP block (MoE, as the last layer) tensor-parallel, the shared head vocab-parallel;
    # seq 8 leaves the depth 7 positions with a target, which no TP shard split could.
    "tp2_mtp": ({"tp": 2}, "alltoall", 1, MTP),
    "tp2_sp_mtp": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1, MTP),
    # DeepSeek-V3's shape: MLA (split over TP) in the decoder and in the MTP block, tied
    "tp2_sp_mla_mtp_tied": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1,
                            {**MLA, **MTP, **TIED}),
    "tp2_sp_mtp_docs": ({"tp": 2, "sequence_parallel": True}, "alltoall", 1, MTP, None, DOCS),
    # MTP under CP: a rank holds chunks r and 2W-1-r of each sequence, so the tokens and targets
    # k ahead cross its shards (ParallelWiring.ahead all-gathers the ids); depth 1's loss is the
    # CP group's mean over its S - 1 targets, the MTP block's aux loss takes CP's grad scale.
    "cp2_mtp": ({"cp": 2}, "alltoall", 1, MTP),
    "cp2_ring_mtp_docs": ({"cp": 2, "cp_comm": "ring"}, "alltoall", 1, MTP, None, DOCS),
}
WORLD4 = {
    "ep4": ({"ep": 4}, "alltoall", 1),
    "ep4_allgather": ({"ep": 4}, "allgather", 1),
    "tp2_ep4_folded": ({"tp": 2, "ep": 4, "sequence_parallel": True}, "alltoall", 1),
    "tp2_ep4_folded_allgather": ({"tp": 2, "ep": 4, "sequence_parallel": True}, "allgather", 1),
    "cp2_ep2": ({"cp": 2, "ep": 2}, "alltoall", 1),
    "cp2_ep2_allgather": ({"cp": 2, "ep": 2}, "allgather", 1),
    "pp2_ep2": ({"pp": 2, "ep": 2}, "alltoall", 2),
    "pp2_ep2_allgather": ({"pp": 2, "ep": 2}, "allgather", 2),
    "cp2_tp2": ({"cp": 2, "tp": 2}, "alltoall", 1),
    "cp2_tp2_sp": ({"cp": 2, "tp": 2, "sequence_parallel": True}, "alltoall", 1),
    "cp2_tp2_ring": ({"cp": 2, "tp": 2, "cp_comm": "ring"}, "alltoall", 1),
    "cp2_tp2_sp_ring": ({"cp": 2, "tp": 2, "sequence_parallel": True, "cp_comm": "ring"},
                        "alltoall", 1),
    "pp2_cp2": ({"pp": 2, "cp": 2}, "alltoall", 2),
    # PP4 layouts: embedding-only and loss-only ends with 3 + 1 layers between them; MTP alone
    # on rank 2 (embedding group {0, 2}: a new group of two of the pipeline's four ranks),
    # tied too (group {0, 2, 3}); a stage holding nothing (rank 1 passes the activation on).
    "pp4_layout_uneven": ({"pp": 4, "pipeline_layout": "E|ttt|t|L"}, "alltoall", 2),
    "pp4_layout_mtp": ({"pp": 4, "pipeline_layout": "Et|ttt|m|L"}, "alltoall", 2, MTP),
    "pp4_layout_mtp_tied": ({"pp": 4, "pipeline_layout": "Et|ttt|m|L"}, "alltoall", 2,
                            {**MTP, **TIED}),
    "pp4_layout_empty_stage": ({"pp": 4, "pipeline_layout": "Ett||tt|L"}, "alltoall", 2),
    "pp4_layout_empty_stage_distopt": ({"pp": 4, "pipeline_layout": "Ett||tt|L",
                                        "distributed_optimizer": True}, "alltoall", 2),
    "ep2_dp4_distopt": ({"ep": 2, "distributed_optimizer": True}, "alltoall", 1),
    "ep2_etp2": ({"ep": 2, "etp": 2}, "alltoall", 1),
    "ep2_etp2_sync_free": ({"ep": 2, "etp": 2}, "alltoall", 1, None, {"sync_free": True}),
    "ep2_etp2_sync_free_stash": ({"ep": 2, "etp": 2}, "alltoall", 1, None,
                                 {"sync_free": True, "stash": True}),
    "ep4_hier": ({"ep": 4}, _hier(2), 1),
    "ep4_drop": ({"ep": 4}, _a2a(DROP), 1),
    "ep4_hier_drop": ({"ep": 4}, _hier(2, DROP), 1),
    "ep4_drop_pad": ({"ep": 4}, _a2a(DROP_PAD), 1),
    "ep4_hier_drop_pad": ({"ep": 4}, _hier(2, DROP_PAD), 1),
    "tp2_ep4_folded_hier": ({"tp": 2, "ep": 4, "sequence_parallel": True}, _hier(2), 1),
    "cp2_ep2_hier": ({"cp": 2, "ep": 2}, _hier(1), 1),
    "pp2_ep2_hier": ({"pp": 2, "ep": 2}, _hier(1), 2),
    "ep2_dp4_distopt_hier": ({"ep": 2, "distributed_optimizer": True}, _hier(1), 1),
    "ep4_direct_write": ({"ep": 4}, _dw(), 1),
    "ep4_drop_direct_write": ({"ep": 4}, _dw(DROP), 1),
    "ep4_drop_pad_direct_write": ({"ep": 4}, _dw(DROP_PAD), 1),
    "tp2_ep4_folded_direct_write": ({"tp": 2, "ep": 4, "sequence_parallel": True}, _dw(), 1),
    "cp2_ep2_direct_write": ({"cp": 2, "ep": 2}, _dw(), 1),
    "pp2_ep2_direct_write": ({"pp": 2, "ep": 2}, _dw(), 2),
    "pp2_ep2_drop_pad_direct_write": ({"pp": 2, "ep": 2}, _dw(DROP_PAD), 2),
    "ep2_dp4_distopt_direct_write": ({"ep": 2, "distributed_optimizer": True}, _dw(), 1),
    "cp2_ep2_ring_docs": ({"cp": 2, "ep": 2, "cp_comm": "ring"}, "alltoall", 1, None, None, DOCS),
    "cp2_tp2_sp_docs": ({"cp": 2, "tp": 2, "sequence_parallel": True}, "alltoall", 1, None, None,
                        DOCS),
    # MTP under TP x PP: on the loss stage (the default split), and in its own stage, whose
    # activation then carries each depth's sequence-parallel hidden state; TP without SP, tied.
    "pp2_tp2_sp_mtp": ({"pp": 2, "tp": 2, "sequence_parallel": True}, "alltoall", 2, MTP),
    "pp2_tp2_sp_layout_mtp": ({"pp": 2, "tp": 2, "sequence_parallel": True,
                               "pipeline_layout": "Ett|tt|m|L"}, "alltoall", 2, MTP),
    "pp2_tp2_mtp_tied": ({"pp": 2, "tp": 2}, "alltoall", 2, {**MTP, **TIED}),
    # MTP under CP x TP + SP, and under PP x CP in its own stage (the activation then carries
    # each depth's CP-sharded hidden state), tied.
    "cp2_tp2_sp_mtp": ({"cp": 2, "tp": 2, "sequence_parallel": True}, "alltoall", 1, MTP),
    "pp2_cp2_layout_mtp_tied": ({"pp": 2, "cp": 2, "pipeline_layout": "Ett|tt|m|L"},
                                "alltoall", 2, {**MTP, **TIED}),
    # MLA split over TP, folded with EP4, and with PP and MTP (DeepSeek-V3's shape)
    "tp2_sp_ep4_mla_folded": ({"tp": 2, "ep": 4, "sequence_parallel": True}, "alltoall", 1, MLA),
    "pp2_tp2_sp_mla_mtp": ({"pp": 2, "tp": 2, "sequence_parallel": True}, "alltoall", 2,
                           {**MLA, **MTP}),
}
WORLD8 = {
    "pp2_ep2_tp2_sp": ({"pp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}, "alltoall", 2),
    "pp2_ep2_tp2_sp_hier": ({"pp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}, _hier(1), 2),
    "pp2_ep2_tp2_sp_direct_write": ({"pp": 2, "ep": 2, "tp": 2, "sequence_parallel": True},
                                    _dw(), 2),
}
# FSDP2 (parallel.fsdp, moeplug.parallel.fsdp): parameters, grads and AdamW state sharded over
# DP x CP / expert-DP by torch's fully_shard. Grads and parameters are compared whole (each
# DTensor's full_tensor: this rank's TP/EP slice). At world 2 the experts are whole under EP2
# (EDP 1); at world 4 DP4 x EP2 shards them over EDP 2 (their reduce-scatter divided by |DP|).
FSDP = {"fsdp": True}
WORLD2_FSDP = {
    "fsdp_dp2": (FSDP, "alltoall", 1),
    "fsdp_dp2_ep2": ({**FSDP, "ep": 2}, "alltoall", 1),
    "fsdp_dp2_keep_gathered": ({**FSDP, "fsdp_reshard_after_forward": False}, "alltoall", 2),
}
WORLD4_FSDP = {
    "fsdp_dp4": (FSDP, "alltoall", 1),
    "fsdp_dp4_ep2": ({**FSDP, "ep": 2}, "alltoall", 1),
    "fsdp_dp2_tp2": ({**FSDP, "tp": 2}, "alltoall", 1),
    "fsdp_dp2_tp2_sp_ep2_etp2": ({**FSDP, "tp": 2, "sequence_parallel": True, "ep": 2,
                                  "etp": 2}, "alltoall", 1),
    "fsdp_dp2_cp2": ({**FSDP, "cp": 2}, "alltoall", 1),
    "fsdp_pp2_dp2": ({**FSDP, "pp": 2}, "alltoall", 2),
    "fsdp_dp2_tp2_sp_mla": ({**FSDP, "tp": 2, "sequence_parallel": True}, "alltoall", 1, MLA),
}
# hierarchical vs alltoall at the same layout (each also equals one process above)
HIER_PAIRS = {
    2: [("ep2", "ep2_hier"), ("ep2_drop", "ep2_hier_drop"), ("ep2_drop_pad", "ep2_hier_drop_pad"),
        ("dp2_ep2_distopt", "dp2_ep2_distopt_hier")],
    4: [("ep4", "ep4_hier"), ("ep4_drop", "ep4_hier_drop"), ("ep4_drop_pad", "ep4_hier_drop_pad"),
        ("tp2_ep4_folded", "tp2_ep4_folded_hier"), ("cp2_ep2", "cp2_ep2_hier"),
        ("pp2_ep2", "pp2_ep2_hier"), ("ep2_dp4_distopt", "ep2_dp4_distopt_hier")],
    8: [("pp2_ep2_tp2_sp", "pp2_ep2_tp2_sp_hier")],
}


def _cfg(parallel: dict, dispatcher: str | dict, grad_accum: int, model: dict | None = None,
         runtime: dict | None = None, data: dict | None = None):
    from moeplug.config import config_from_dict
    return config_from_dict({
        "runtime": runtime or {},
        "data": data or {},
        "model": {"hidden_size": 16, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 16, "first_k_dense": 1, "dense_ffn_hidden_size": 16,
                  "init_std": 0.1,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8,
                          "aux_loss_coeff": 0.05},
                  **(model or {})},
        "plugins": {"dispatcher": dispatcher} if isinstance(dispatcher, str) else dispatcher,
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 8, "grad_accum_steps": grad_accum,
                  "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1, "grad_clip": GRAD_CLIP,
                  "seed": 7, "adam_eps": ADAM_EPS},
        "parallel": parallel,
    })


def _ref_shards(model, ref, groups) -> dict[str, torch.Tensor]:
    """This rank's shard of the reference model's gradients, by parameter name."""
    from moeplug.parallel.sharding import shard_state_dict
    from moeplug.training.distributed import pipeline_chunks
    grads = {n: p.grad for n, p in ref.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for part in pipeline_chunks(model) or [model]:
        out.update(shard_state_dict(part, grads, groups))
    return out


def _ref_params(model, ref, groups) -> dict[str, torch.Tensor]:
    from moeplug.parallel.sharding import shard_state_dict
    from moeplug.training.distributed import pipeline_chunks
    params = {n: p.detach() for n, p in ref.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for part in pipeline_chunks(model) or [model]:
        out.update(shard_state_dict(part, params, groups))
    return out


def _named(model, groups) -> dict[str, torch.Tensor]:
    from moeplug.training.distributed import pipeline_chunks
    out = {}
    for part in pipeline_chunks(model) or [model]:
        out.update(dict(part.named_parameters()))
    return out


def _moe_err(got: dict, want: dict) -> float:
    """Largest difference of the train record's per-layer router losses and dropped fractions."""
    assert got["router_losses"].keys() == want["router_losses"].keys() == {"aux_loss"}
    pairs = [*zip(got["dropped_fraction"], want["dropped_fraction"])]
    for k, values in got["router_losses"].items():
        pairs += zip(values, want["router_losses"][k])
    assert pairs and len(got["dropped_fraction"]) == len(want["dropped_fraction"])
    # An MTP block's MoE layer logs no router losses (None), in one process as in the layout.
    assert all((a is None) == (b is None) for a, b in pairs)
    return max(abs(a - b) for a, b in pairs if a is not None)


def _run_layouts(rank: int, world: int, layouts: dict) -> dict[str, dict]:
    from moeplug.data import get_batch
    from moeplug.data.documents import with_positions
    from moeplug.parallel import ParallelGroups
    from moeplug.parallel.fsdp import is_sharded, whole
    from moeplug.plugin_host import PluginHost
    from moeplug.training.distributed import build_rank_model, single_process_equivalent
    from moeplug.training.optim import lr_at
    from moeplug.training.trainer import (build_rank_optimizer, evaluate, seed_everything,
                                          step_batches, train_step)

    host = PluginHost.load()
    rng = np.random.default_rng(3)
    plain_ids = rng.integers(0, V, 2048).astype(np.int64)
    doc_ids = rng.integers(1, V, 2048).astype(np.int64)
    # Documents of ~7 tokens: most samples of 8 hold a boundary. (At ~4 tokens, many are a lone
    # EOD, whose only key is itself: its exactly-zero score gradient is a difference of two
    # roundings, which AdamW then amplifies past TOL in the TP rows; real corpora have few.)
    doc_ids[rng.random(2048) < 0.15] = EOD
    report: dict[str, dict] = {}
    for name, (parallel, dispatcher, accum, *extra) in layouts.items():
        cfg = _cfg(parallel, dispatcher, accum, *extra)
        eod = EOD if cfg.data.document_mask else None
        ids = doc_ids if eod is not None else plain_ids
        # one instance per model: a stateful recipe (fp8_delayed) keeps each model's own state
        precision, ref_precision = (host.create("precision", cfg.plugins.precision,
                                                dict(cfg.plugins.precision_options))
                                    for _ in "ab")
        groups = ParallelGroups.build(cfg.parallel.layout(), world, rank)
        ref_cfg = single_process_equivalent(cfg, groups.size("dp"))
        seed_everything(cfg.train.seed)
        model = build_rank_model(cfg, host, V, groups)
        seed_everything(cfg.train.seed)
        ref = build_rank_model(ref_cfg, host, V, None)
        opt, ref_opt = build_rank_optimizer(model, cfg, groups), build_rank_optimizer(ref, ref_cfg)
        errs = {"loss": 0.0, "lm_loss": 0.0, "aux_loss": 0.0, "val_loss": 0.0,
                "router_losses": 0.0, "grad_norm": 0.0, "grad": 0.0, "param": 0.0}
        losses, grad_norms, min_ref_norm, num_grads, dropped = [], [], float("inf"), 0, 0.0
        static_steps = 0  # sync-free steps that kept the static path (no over-budget rerun)
        boundaries = 0
        for step in range(3):
            for o in (opt, ref_opt):
                for g in o.param_groups:
                    g["lr"] = lr_at(step, cfg.train)
            batches = with_positions(step_batches(ids, cfg.train, step, groups), eod)
            # document starts inside this rank's samples (the mask must have work to do)
            boundaries += sum(int((b[2][:, 1:] == 0).sum()) for b in batches if len(b) > 2)
            got = train_step(model, opt, batches, cfg.train, precision, groups)
            want = train_step(ref, ref_opt,
                              with_positions(step_batches(ids, ref_cfg.train, step), eod),
                              ref_cfg.train, ref_precision)
            losses.append(got.loss)
            static_steps += got.sync_free is not None and not got.sync_free["reruns"]
            grad_norms.append(got.grad_norm)
            # (with MTP blocks the train record logs mtp_loss too)
            assert got.losses().keys() == want.losses().keys() == {
                "loss", "lm_loss", "aux_loss", *(["mtp_loss"] * bool(cfg.model.mtp_num_layers))}
            for key, value in got.losses().items():  # as the train record logs them
                errs[key] = max(errs.get(key, 0.0), abs(value - want.losses()[key]))
            if groups.size("pp") == 1:  # pipeline runs log no per-layer router losses
                errs["router_losses"] = max(errs["router_losses"], _moe_err(got.moe, want.moe))
                dropped = max(dropped, *got.moe["dropped_fraction"])
            else:  # but every layer's tokens per expert, in the model's layer order
                errs["tokens"] = max(errs.get("tokens", 0.0), float(
                    got.moe["tokens"] != want.moe["tokens"]))
            errs["grad_norm"] = max(errs["grad_norm"], abs(got.grad_norm - want.grad_norm))
            min_ref_norm = min(min_ref_norm, want.grad_norm)
            if not cfg.parallel.distributed_optimizer:
                # after train_step: this rank's synced and clipped grads vs the reference's
                for pname, expect in _ref_shards(model, ref, groups).items():
                    p = _named(model, groups)[pname]
                    errs["grad"] = max(errs["grad"], (whole(p.grad) - expect).abs().max().item())
                    num_grads += 1
        for pname, expect in _ref_params(model, ref, groups).items():
            p = _named(model, groups)[pname]
            errs["param"] = max(errs["param"], (whole(p.detach()) - expect).abs().max().item())
        fsdp_sharded = sum(is_sharded(p) for p in _named(model, groups).values())
        # The val record's loss: whole sequences on every rank, as the trainer passes them.
        gen = torch.Generator().manual_seed(11)
        val = with_positions([get_batch(ids, cfg.train.micro_batch_size, cfg.train.seq_len, gen)
                              for _ in "ab"], eod)
        errs["val_loss"] = abs(evaluate(model, val, precision, groups)
                               - evaluate(ref, val, ref_precision))
        report[name] = {"errs": errs, "losses": losses, "grad_norms": grad_norms, "dropped": dropped,
                        "min_ref_norm": min_ref_norm, "static_steps": static_steps,
                        "num_grads": num_grads, "dp": groups.size("dp"),
                        "num_params": len(_named(model, groups)),
                        "boundaries": boundaries, "fsdp_sharded": fsdp_sharded}
    return report


def _check(reports, name):
    parallel, dispatcher, _, *extra = {**WORLD2, **WORLD4, **WORLD8, **WORLD2_FSDP,
                                       **WORLD4_FSDP}[name]
    sync_free = len(extra) > 1 and (extra[1] or {}).get("sync_free", False)
    distopt = parallel.get("distributed_optimizer", False)
    router = dispatcher.get("router_options", {}) if isinstance(dispatcher, dict) else {}
    # pipeline runs log no per-layer dropped fractions
    drops = "capacity_factor" in router and parallel.get("pp", 1) == 1
    for rank, report in enumerate(reports):
        r = report[name]
        assert not drops or r["dropped"] > 0, f"{name}: capacity must drop for the case to bite"
        assert r["min_ref_norm"] > 2 * GRAD_CLIP, "clipping must act for the norm to be tested"
        # (a pipeline rank whose stages hold nothing has no gradient to compare)
        assert distopt or r["num_grads"] > 0 or (r["num_params"] == 0 and "empty" in name)
        assert not name.endswith("_docs") or r["boundaries"] > 0, "packed samples must be tested"
        # a sync-free layout must have trained on its static path, not only on reruns
        assert not sync_free or r["static_steps"] == 3, (name, rank, r["static_steps"])
        # an FSDP row must really shard (fully_shard put DTensors in place), a plain one not
        assert (r["fsdp_sharded"] > 0) == parallel.get("fsdp", False), (name, r["fsdp_sharded"])
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, f"{name}, rank {rank}: differs from one process by more than {TOL}: {bad}"


@pytest.fixture(scope="module")
def world2():
    return run_layouts(_run_layouts, 2, WORLD2, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_layouts(_run_layouts, 4, WORLD4, timeout=400)


@pytest.fixture(scope="module")
def world8():
    return run_distributed(_run_layouts, 8, WORLD8, timeout=400)


@pytest.fixture(scope="module")
def world2_fsdp():
    return run_layouts(_run_layouts, 2, WORLD2_FSDP, timeout=300)


@pytest.fixture(scope="module")
def world4_fsdp():
    return run_layouts(_run_layouts, 4, WORLD4_FSDP, timeout=400)


@pytest.mark.parametrize("name", list(WORLD2_FSDP))
def test_world2_fsdp_layout_equals_single_process(world2_fsdp, name):
    _check(world2_fsdp, name)


@pytest.mark.parametrize("name", list(WORLD4_FSDP))
def test_world4_fsdp_layout_equals_single_process(world4_fsdp, name):
    _check(world4_fsdp, name)


@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_layout_equals_single_process(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_layout_equals_single_process(world4, name):
    _check(world4, name)


@pytest.mark.parametrize("name", list(WORLD8))
def test_world8_layout_equals_single_process(world8, name):
    _check(world8, name)


def test_world8_direct_write_equals_alltoall(world8):
    for report in world8:
        a, b = (report[n]["losses"] for n in ("pp2_ep2_tp2_sp", "pp2_ep2_tp2_sp_direct_write"))
        assert max(abs(x - y) for x, y in zip(a, b)) <= TOL


@pytest.mark.parametrize("pair", [("ep2", "ep2_allgather"), ("ep2", "ep2_direct_write"),
                                  ("ep2_drop", "ep2_drop_direct_write"),
                                  ("ep2_drop_pad", "ep2_drop_pad_direct_write"),
                                  ("dp2_ep2_distopt", "dp2_ep2_distopt_direct_write")])
def test_alltoall_equals_allgather_world2(world2, pair):
    for report in world2:
        a, b = (report[n]["losses"] for n in pair)
        assert max(abs(x - y) for x, y in zip(a, b)) <= TOL


@pytest.mark.parametrize("pair", [("ep4", "ep4_allgather"),
                                  ("tp2_ep4_folded", "tp2_ep4_folded_allgather"),
                                  ("cp2_ep2", "cp2_ep2_allgather"),
                                  ("pp2_ep2", "pp2_ep2_allgather"),
                                  ("ep4", "ep4_direct_write"),
                                  ("ep4_drop_pad", "ep4_drop_pad_direct_write"),
                                  ("tp2_ep4_folded", "tp2_ep4_folded_direct_write"),
                                  ("cp2_ep2", "cp2_ep2_direct_write"),
                                  ("pp2_ep2", "pp2_ep2_direct_write"),
                                  ("ep2_dp4_distopt", "ep2_dp4_distopt_direct_write")])
def test_alltoall_equals_allgather_world4(world4, pair):
    for report in world4:
        a, b = (report[n]["losses"] for n in pair)
        assert max(abs(x - y) for x, y in zip(a, b)) <= TOL


def _hier_pair_errs(reports, pair) -> float:
    """Largest gap between alltoall's and hierarchical's logged losses and grad norms."""
    err = 0.0
    for report in reports:
        a, b = report[pair[0]], report[pair[1]]
        err = max(err, *(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
                  *(abs(x - y) for x, y in zip(a["grad_norms"], b["grad_norms"])))
    return err


@pytest.mark.parametrize("pair", HIER_PAIRS[2])
def test_hierarchical_equals_alltoall_world2(world2, pair):
    assert _hier_pair_errs(world2, pair) <= TOL


@pytest.mark.parametrize("pair", HIER_PAIRS[4])
def test_hierarchical_equals_alltoall_world4(world4, pair):
    assert _hier_pair_errs(world4, pair) <= TOL


@pytest.mark.parametrize("pair", HIER_PAIRS[8])
def test_hierarchical_equals_alltoall_world8(world8, pair):
    assert _hier_pair_errs(world8, pair) <= TOL


@pytest.mark.parametrize("name", [n for n in WORLD2 if "drop" in n])
def test_drop_layouts_really_drop(world2, name):
    # Guard: the capacity bites on the tiny model (else "dropping on" would test nothing).
    assert max(r[name]["dropped"] for r in world2) > 0


def test_data_parallel_ranks_train_disjoint_micro_batches_in_one_process_order():
    # step_batches: DP rank r's micro-batches are r*A..(r+1)*A-1 of what one process with
    # grad_accum_steps = DP * A draws, so together the ranks cover the step exactly once.
    from types import SimpleNamespace

    from moeplug.training.trainer import step_batches
    ids = np.arange(500, dtype=np.int64)
    tc = SimpleNamespace(seed=1, micro_batch_size=2, seq_len=4, grad_accum_steps=2)
    one = step_batches(ids, SimpleNamespace(**{**vars(tc), "grad_accum_steps": 6}), step=5)
    groups = [SimpleNamespace(size=lambda k: 3, rank_in=lambda k, r=r: r) for r in range(3)]
    parts = [b for g in groups for b in step_batches(ids, tc, 5, g)]
    assert len(parts) == len(one) == 6
    for (t1, y1), (t2, y2) in zip(parts, one):
        assert torch.equal(t1, t2) and torch.equal(y1, y2)


def _logged(out_dir: str) -> tuple[list[float], list[float]]:
    import os

    from moeplug.training.metrics import read_metrics
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return ([r["lm_loss"] for r in records if r["kind"] == "train"],
            [r["val_loss"] for r in records if r["kind"] == "val"])


@pytest.mark.slow
def test_cli_tp2_cp2_logs_the_one_process_losses(run_cli, tiny_config_file, tmp_path):
    # The reported bug: at TP2 x CP2 rank 0 logged its own CP chunk's lm_loss and val_loss (and
    # printed them in the final lines). DP = 4 / (TP * CP) = 1: the same config in one process.
    import re
    cfg = tiny_config_file(str(tmp_path / "unused"))
    common = ["--steps", "3", "--set", "train.log_interval=1", "--set", "train.warmup_steps=1",
              "--set", "train.eval_interval=2"]
    par, one = str(tmp_path / "tp2cp2"), str(tmp_path / "one")
    proc = run_cli("train", "--config", cfg, "--out", par, "--nproc", "4", "--set",
                   "parallel.tp=2", "--set", "parallel.cp=2", *common, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = run_cli("train", "--config", cfg, "--out", one, *common, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    (got_lm, got_val), (want_lm, want_val) = _logged(par), _logged(one)
    assert len(got_lm) == len(want_lm) == 3 and len(got_val) == len(want_val) == 3  # 0, 2, 3
    assert max(abs(a - b) for a, b in zip(got_lm + got_val, want_lm + want_val)) < 1e-4, (
        got_lm, want_lm, got_val, want_val)
    verdict = re.compile(r"validation loss (\S+) nats/token")  # the final lines rank 0 prints
    (got,), (want,) = verdict.findall(proc.stdout), verdict.findall(ref.stdout)
    assert abs(float(got) - float(want)) <= 2e-4, (got, want)
