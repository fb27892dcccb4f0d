"""Built-in router ``topk``: every Megatron-Core top-k router feature, composed from the pure
functions in :mod:`moeplug.routing`.

Legend: T tokens, D hidden, E experts, K top-k, B sequences in the micro-batch.

forward(x_TD, num_sequences=B):
    1. jitter      x * U(1 - eps, 1 + eps)                      (training only, input_jitter_eps)
    2. gate        logits_TE = x_TD @ W_ED^T in fp32 or fp64     (dtype; autocast off), or in
                   the input's dtype with fp32 logits (dtype "input": Megatron's default)
                   replaced by seeded random logits when force_load_balancing (benchmarks)
    3. route       scores, expert bias, group-limited top-k (group_score rule), scaling
                   (moeplug.routing.scores)
    4. drop        capacity C = ceil(T*K/E * capacity_factor); over-capacity choices get prob 0
                   and dropped_TK = True; pad_to_capacity asks the dispatcher for exactly C rows
    5. losses      sum over load_balancing_type of coeff * loss, plus z_loss_coeff * z-loss;
                   hf_aux_loss: the statistics of transformers' pooled loss, which the model
                   adds once over all layers (RouterOutput.pooled_aux, moeplug.routing.pooled)
    6. count       step counts for the expert-bias update / global aux loss (training + grad)
finalize_step(group): expert bias b += rate * sign(mean n - n) over the step's counts (summed
over ``group``), then both per-step count buffers reset.

Defaults keep Mixtral semantics: softmax, renormalised top-k, Switch aux loss with the model's
``moe.aux_loss_coeff``; the gate ``weight`` [E, D] is named like HF Mixtral's ``gate.weight``.
The two count buffers are per-*step* state (they must outlive a micro-batch), deliberately kept
on the module; they change only in training with grad enabled, so evaluation and activation
recomputation under no_grad do not count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from moeplug.api import (ConfigError, HF_AUX_LOSS, hookimpl, ModelConfig, pooled_aux_stats,
                         recomputing, Router, RouterOutput, routing as R, row_alignment,
                         will_recompute, workspace, workspace_losses as WL)


def _fail(name: str, value, rule: str, fix: str) -> None:
    raise ConfigError(f"TopKOptions.{name} = {value!r}: {rule}. Fix: {fix}")


# The largest row multiple padding_for_quantization takes: 2x the largest quantization block
# (FP8 blockwise's 128 rows).
MAX_ROW_PADDING = 256


@dataclass(frozen=True)
class TopKOptions:
    """Options of router ``topk`` (Megatron's ``moe_router_*`` / ``moe_*`` names, prefix dropped)."""

    # How it runs, not what it computes (the same math): a resume may change them.
    execution_only: ClassVar[tuple[str, ...]] = ("fused", "fused_cuda")
    # What only training reads (its losses, the jitter it adds, how fast the expert bias moves):
    # the trained model routes the same whatever they are, so a resume may change them too
    # (the fine-tuning of an import with another loss above all).
    training_only: ClassVar[tuple[str, ...]] = (
        "load_balancing_type", "aux_loss_coeff", "aux_loss_counts", "z_loss_coeff",
        "input_jitter_eps", "bias_update_rate")

    # Score function. softmax + renormalize=True is Megatron's post-softmax (= Mixtral);
    # softmax + renormalize=False is Megatron's pre_softmax. For sigmoid/sqrtsoftplus,
    # renormalize divides the K chosen scores by their sum (+1e-20) when K > 1 (Megatron).
    # None (default): True when top_k >= 2, False at top_k = 1, where a renormalised softmax
    # weight is the constant 1.0 and the gate would get no gradient from the main loss.
    score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    renormalize: bool | None = None
    topk_scaling_factor: float = 1.0
    # Group-limited routing: experts split into num_groups contiguous groups; each token picks
    # its group_topk best groups first (DeepSeek-V3: 8 groups, 4 kept). Both set or both None.
    # A group scores the sum of its best top_k // group_topk selection scores ("topk_share",
    # Megatron) or of its best 2 ("top2_sum", what HF and DeepSeek-V3's code compute); they
    # differ unless top_k // group_topk == 2. DeepSeek-V3 import picks top2_sum.
    num_groups: int | None = None
    group_topk: int | None = None
    group_score: Literal["topk_share", "top2_sum"] = "topk_share"
    # Aux-loss-free balancing: a bias for selection only, updated once per optimizer step.
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # Load-balancing losses: one name or a list; coefficients: None = model.moe.aux_loss_coeff
    # for each, a number for all, or a list matching the types. aux_loss, seq_aux_loss and
    # global_aux_loss are Megatron's, one per MoE layer, summed over the layers; hf_aux_loss is
    # transformers' load_balancing_loss_func: one loss over every MoE layer's tokens pooled
    # (moeplug.routing.pooled), about K / L times the per-layer sum at the same coefficient.
    load_balancing_type: str | list = "aux_loss"
    aux_loss_coeff: float | list | None = None
    # Which token counts feed the aux losses: "plain_topk" (Megatron, default) recomputes a plain
    # top-k ignoring group limits and the bias (Megatron #2767); "routed" uses the real choices.
    aux_loss_counts: Literal["plain_topk", "routed"] = "plain_topk"
    z_loss_coeff: float = 0.0
    input_jitter_eps: float = 0.0
    # The gate GEMM's dtype (Megatron's moe_router_dtype): "fp32" (the default here) or "fp64";
    # "input" is Megatron's default (moe_router_dtype unset): the GEMM in the input's dtype,
    # bf16 in a bf16-autocast run, with fp32 logits for the rest (moeplug.routing.gating).
    dtype: Literal["fp32", "fp64", "input"] = "fp32"
    # Capacity: None = dropless. Drop policy: "probs" keeps each expert's highest-weight choices,
    # "position" keeps the earliest tokens. pad_to_capacity gives every expert exactly C rows.
    # C counts the tokens this router call routes: under TP/SP and CP a rank's chunk of the
    # sequences (Megatron's local tokens), so those layouts drop per chunk, unlike one process.
    capacity_factor: float | None = None
    token_drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False
    # Pad each expert's rows to a multiple of this (16 FP8, 32 MXFP8/NVFP4); 1 = the low-
    # precision recipe's alignment when one is active (moeplug.quant.row_alignment), else off.
    padding_for_quantization: int = 1
    # Step 3 and the aux statistics in one C++ pass (moeplug.routing.fused) where it applies
    # (fp32 CPU logits); false: the plain-torch path (same math, the reference).
    fused: bool = True
    # With ``fused``, run the CUDA route kernels on GPU logits too (moeplug._runtime_cuda).
    # The first kernels were equal on an H200 (tests/test_fused_router.py -m cuda) but slower
    # than the torch path (the layer at 0.90x, docs/GPU.md). The warp-per-token rewrite passes
    # on the CPU under the warp emulator (ctest) and has not run on a GPU: off until it has.
    fused_cuda: bool = False
    # Benchmarks: random (seeded, hence repeatable) logits, so the load is balanced.
    force_load_balancing: bool = False
    force_load_balancing_seed: int = 42

    def __post_init__(self) -> None:
        types = self.loss_types()
        for t in types:
            if t not in (*R.AUX_LOSS_TYPES, HF_AUX_LOSS):
                _fail("load_balancing_type", self.load_balancing_type, f"unknown type {t!r}",
                      f"use 'none' or any of {', '.join((*R.AUX_LOSS_TYPES, HF_AUX_LOSS))} "
                      f"(one or a list)")
        if len(set(types)) != len(types):
            _fail("load_balancing_type", self.load_balancing_type, "lists a type twice",
                  "list each loss type once")
        if isinstance(self.aux_loss_coeff, list):
            if len(self.aux_loss_coeff) != len(types):
                _fail("aux_loss_coeff", self.aux_loss_coeff,
                      f"has {len(self.aux_loss_coeff)} entries but load_balancing_type has "
                      f"{len(types)} ({types})", "give one coefficient per loss type")
            coeffs = self.aux_loss_coeff
        else:
            coeffs = [] if self.aux_loss_coeff is None else [self.aux_loss_coeff]
        for c in coeffs:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
                _fail("aux_loss_coeff", self.aux_loss_coeff, "coefficients must be numbers >= 0",
                      "write e.g. aux_loss_coeff: 1e-2 or [1e-2, 1e-3]")
        for name in ("z_loss_coeff", "input_jitter_eps", "bias_update_rate"):
            if getattr(self, name) < 0:
                _fail(name, getattr(self, name), "must be >= 0", f"set {name} to 0 (off) or more")
        if self.input_jitter_eps >= 1:
            _fail("input_jitter_eps", self.input_jitter_eps, "must be < 1 (the noise is "
                  "U(1 - eps, 1 + eps))", "use a small value such as 1e-2")
        if self.topk_scaling_factor <= 0:
            _fail("topk_scaling_factor", self.topk_scaling_factor, "must be > 0",
                  "use 1.0 (off) or e.g. 2.5 (DeepSeek-V3)")
        if self.enable_expert_bias and self.score_function == "softmax":
            _fail("enable_expert_bias", True, "the expert bias needs score_function 'sigmoid' or "
                  "'sqrtsoftplus' (Megatron rejects it with softmax)",
                  "set score_function: sigmoid, or enable_expert_bias: false")
        if (self.num_groups is None) != (self.group_topk is None):
            _fail("num_groups" if self.num_groups is None else "group_topk",
                  None, "num_groups and group_topk go together",
                  "set both (e.g. num_groups: 8, group_topk: 4) or neither")
        for name in ("num_groups", "group_topk"):
            v = getattr(self, name)
            if v is not None and v < 1:
                _fail(name, v, "must be >= 1", f"set {name} to a positive integer or leave it unset")
        if self.num_groups is not None and self.group_topk > self.num_groups:
            _fail("group_topk", self.group_topk, f"exceeds num_groups ({self.num_groups})",
                  f"set group_topk <= {self.num_groups}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            _fail("capacity_factor", self.capacity_factor, "must be > 0",
                  "leave it unset (dropless) or use e.g. 1.25")
        if self.pad_to_capacity and self.capacity_factor is None:
            _fail("pad_to_capacity", True, "needs a capacity", "set capacity_factor (e.g. 1.0)")
        if not 1 <= self.padding_for_quantization <= MAX_ROW_PADDING:
            # each expert's rows round up to it: a huge value allocates gigabytes per layer
            _fail("padding_for_quantization", self.padding_for_quantization,
                  f"must be between 1 and {MAX_ROW_PADDING}",
                  "use 1 (off), 16 (FP8), 32 (MXFP8/NVFP4) or 128 (FP8 blockwise)")
        if self.pad_to_capacity and self.padding_for_quantization > 1:
            _fail("padding_for_quantization", self.padding_for_quantization,
                  "cannot combine with pad_to_capacity (capacity fixes the row count)",
                  "choose one of them")

    def check_parallel(self, parallel) -> None:
        """hf_aux_loss pools the tokens of every MoE layer of one micro-batch; layouts that
        split a micro-batch's tokens (TP/SP, CP) or its layers (PP) over ranks would pool only
        a share of them, which is another loss."""
        if HF_AUX_LOSS not in self.loss_types():
            return
        split = [f"parallel.{n} = {getattr(parallel, n)}" for n in ("tp", "cp", "pp")
                 if getattr(parallel, n) > 1]
        if split:
            raise ValueError(
                f"TopKOptions.load_balancing_type = {self.load_balancing_type!r}: hf_aux_loss "
                f"pools every MoE layer's tokens of a micro-batch into one loss, but "
                f"{' and '.join(split)} splits them over ranks. Fix: train it with data and "
                f"expert parallelism only, or use load_balancing_type: aux_loss (per layer)")

    def loss_types(self) -> list[str]:
        types = ([self.load_balancing_type] if isinstance(self.load_balancing_type, str)
                 else list(self.load_balancing_type))
        return [t for t in types if t != "none"]


def _check_against_model(model: ModelConfig, o: TopKOptions) -> None:
    E, K = model.moe.num_experts, model.moe.top_k
    if HF_AUX_LOSS in o.loss_types() and model.mtp_num_layers:
        _fail("load_balancing_type", o.load_balancing_type, f"hf_aux_loss pools the main "
              f"model's MoE layers as transformers does, which has no multi-token-prediction "
              f"blocks (model.mtp_num_layers = {model.mtp_num_layers})",
              "set model.mtp_num_layers: 0, or use load_balancing_type: aux_loss")
    if K == 1 and o.score_function == "softmax" and o.renormalize is True:
        _fail("renormalize", True, "with top_k = 1 and softmax the renormalised weight is always "
              "1.0, so the gate gets no gradient from the main loss (Megatron rejects post-softmax "
              "top-1)", "set renormalize: false (pre-softmax) or use top_k >= 2")
    if o.num_groups is not None:
        if E % o.num_groups:
            _fail("num_groups", o.num_groups, f"does not divide num_experts ({E}): "
                  f"{E} % {o.num_groups} = {E % o.num_groups}", "choose a divisor of num_experts")
        if o.group_topk > K and o.group_score == "topk_share":
            # Megatron scores a group by its top top_k // group_topk experts: none here.
            _fail("group_topk", o.group_topk, f"exceeds top_k ({K}), so group_score topk_share "
                  f"would score each group by its top {K} // {o.group_topk} = 0 experts",
                  f"set group_topk <= {K}, or group_score: top2_sum")
        if o.group_topk * (E // o.num_groups) < K:
            _fail("group_topk", o.group_topk, f"the {o.group_topk} kept groups hold "
                  f"{o.group_topk * (E // o.num_groups)} experts, fewer than top_k ({K})",
                  "raise group_topk or lower num_groups")
        members = R.group_members(K, o.group_topk, o.group_score)
        if members > E // o.num_groups:
            _fail("group_score", o.group_score, f"sums each group's best {members} scores but a "
                  f"group holds {E // o.num_groups} experts (num_experts {E} / num_groups "
                  f"{o.num_groups})", "lower num_groups, or use group_score: topk_share")


class TopKRouter(Router):
    """fp32 gate ``weight`` [E, D]; ``expert_bias`` [E] buffer when enabled."""

    accepts_num_sequences = True
    # Under TP the MoE layer routes one chunk of each sequence per rank and passes the TP group:
    # expert counts are summed over it so f_i is the whole batch's (see MoELayer.token_group).
    accepts_token_group = True
    # And the ranks that train the step's other micro-batches (TP x DP x CP of this stage): the
    # global aux loss sums its counts over them each micro-batch, as Megatron reduces n_i over
    # TP x DP x CP (MoELayer.batch_group).
    accepts_batch_group = True

    def __init__(self, model: ModelConfig, options: TopKOptions):
        super().__init__()
        _check_against_model(model, options)
        self.num_experts = model.moe.num_experts
        self.top_k = model.moe.top_k
        self.options = options
        self.renormalize = self.top_k > 1 if options.renormalize is None else options.renormalize
        types = options.loss_types()
        coeff = options.aux_loss_coeff
        if coeff is None:
            coeff = model.moe.aux_loss_coeff
        coeffs = coeff if isinstance(coeff, list) else [coeff] * len(types)
        self.aux_loss_coeffs = {t: float(c) for t, c in zip(types, coeffs)}
        # transformers' loss over all layers: this layer hands its statistics to the model
        self.pooled_coeff = self.aux_loss_coeffs.pop(HF_AUX_LOSS, 0.0)
        self.weight = nn.Parameter(torch.empty(self.num_experts, model.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=model.init_std)
        E = self.num_experts
        # Per-step state (see the module docstring). expert_bias is model state: saved.
        self.register_buffer("expert_bias", torch.zeros(E) if options.enable_expert_bias else None)
        self.register_buffer("step_counts_E", torch.zeros(E, dtype=torch.int64) if
                             options.enable_expert_bias else None, persistent=False)
        wants_global = "global_aux_loss" in self.aux_loss_coeffs
        self.register_buffer("global_counts_E", torch.zeros(E, dtype=torch.int64) if wants_global
                             else None, persistent=False)
        # Tokens seen this step, for the global aux loss's f_i = sum n_i / (K * sum T). Kept and
        # used on the device, never read on the host (runtime.sync_free: no sync); a buffer, so
        # a rerun's buffer restore puts it back with the counts.
        self.register_buffer("global_tokens", torch.zeros((), dtype=torch.int64) if wants_global
                             else None, persistent=False)
        # Under recompute: the global aux loss's accumulated counts of each checkpointed
        # micro-batch, for its re-run in backward (moeplug.modules.recompute).
        self._replay: list = []

    def forward(self, x_TD: torch.Tensor, num_sequences: int = 1, token_group=None,
                batch_group=None) -> RouterOutput:
        o, E, K = self.options, self.num_experts, self.top_k
        T = x_TD.shape[0]
        # Not while recompute re-runs this forward in backward: a micro-batch counts once.
        counting = self.training and torch.is_grad_enabled() and not recomputing()
        # 1. jitter  2. gate
        if self.training and o.input_jitter_eps > 0:
            x_TD = R.input_jitter(x_TD, o.input_jitter_eps)
        logits_TE = R.router_logits(x_TD, self.weight, R.ROUTER_DTYPES[o.dtype])
        if o.force_load_balancing:
            logits_TE = R.force_balanced_logits(logits_TE, o.force_load_balancing_seed)
        # 3. route (fused: the aux statistics come out of the same pass)
        route = dict(score_function=o.score_function, renormalize=self.renormalize,
                     expert_bias_E=self.expert_bias, num_groups=o.num_groups,
                     group_topk=o.group_topk, group_score=o.group_score,
                     scaling_factor=o.topk_scaling_factor)
        stats = None
        if self._fused_applies(logits_TE, num_sequences):
            active = self._active_aux_losses()
            fused = R.fused_topk_routing(
                logits_TE, K, **route, aux_counts=o.aux_loss_counts if active else None,
                num_sequences=num_sequences if "seq_aux_loss" in active else 1)
            probs_TK, ids_TK, stats = fused.probs_TK, fused.ids_TK, fused.stats
        else:
            probs_TK, ids_TK = R.topk_routing(logits_TE, K, **route)
        # 4. drop over capacity
        dropped_TK, capacity = None, None
        if o.capacity_factor is not None:
            capacity = R.expert_capacity(T, K, E, o.capacity_factor)
            probs_TK, dropped_TK = R.drop_over_capacity(probs_TK, ids_TK, E, capacity,
                                                        o.token_drop_policy)
        # 5. losses
        losses: dict[str, torch.Tensor] = {}
        aux_loss = self._aux_losses(logits_TE, ids_TK, num_sequences, counting, losses, token_group,
                                    stats, batch_group)
        if o.z_loss_coeff > 0 and WL.z_loss_applies(logits_TE):
            # The composition below in one Function over workspace buffers (issue 7).
            aux_loss, losses["z_loss"] = WL.add_z_loss(aux_loss, logits_TE, o.z_loss_coeff)
        elif o.z_loss_coeff > 0:
            z = R.z_loss(logits_TE)
            losses["z_loss"] = z.detach().float()
            aux_loss = aux_loss + o.z_loss_coeff * z
        if dropped_TK is not None:
            losses["dropped_fraction"] = R.dropped_fraction(dropped_TK) if T else torch.zeros(())
        pooled = (pooled_aux_stats(logits_TE, K, self.pooled_coeff) if self.pooled_coeff
                  else None)
        # 6. step counts for the expert-bias update
        if counting and self.step_counts_E is not None:
            with torch.no_grad():
                self.step_counts_E += R.expert_counts(ids_TK, E, None if dropped_TK is None
                                                      else R.kept(dropped_TK))
        return RouterOutput(probs_TK=probs_TK.float(), ids_TK=ids_TK, aux_loss=aux_loss.float(),
                            logits_TE=logits_TE.float(), losses=losses, dropped_TK=dropped_TK,
                            capacity=capacity if o.pad_to_capacity else None,
                            pad_multiple=row_alignment(o.padding_for_quantization),
                            pooled_aux=pooled)

    def _active_aux_losses(self) -> dict[str, float]:
        return {t: c for t, c in self.aux_loss_coeffs.items() if c != 0.0}

    def _fused_applies(self, logits_TE: torch.Tensor, num_sequences: int) -> bool:
        """The C++ kernel covers every option of step 3 and the aux statistics; it does not
        run for fp64 logits or, without ``fused_cuda``, CUDA tensors (moeplug.routing.fused),
        nor for a seq_aux_loss whose tokens do not split into equal sequences (the torch path
        reports that)."""
        if not self.options.fused or not R.fused_routing_applies(logits_TE,
                                                                 cuda=self.options.fused_cuda):
            return False
        return ("seq_aux_loss" not in self._active_aux_losses()
                or logits_TE.shape[0] % num_sequences == 0)

    def _aux_losses(self, logits_TE: torch.Tensor, ids_TK: torch.Tensor, num_sequences: int,
                    counting: bool, losses: dict, token_group=None,
                    stats: R.AuxStats | None = None, batch_group=None) -> torch.Tensor:
        """Sum of coeff * loss over the configured types; unscaled values go to ``losses``.
        ``stats``: the fused router's per-sequence means and counts (else computed here).
        ``batch_group`` (else ``token_group``): the ranks whose counts the global aux loss sums."""
        active = self._active_aux_losses()
        T, K, E = ids_TK.shape[0], self.top_k, self.num_experts
        if stats is not None and T > 0 and stats.mean_BE.device.type == "cpu":
            # One autograd Function over workspace buffers: the same numbers as the general
            # path below, no allocation after warm-up (issue 7). Over a token group (TP / SP)
            # f_i counts the group's tokens: counts summed over it, T times its size.
            counts_BE, W = R.sum_over_group(stats.counts_BE, token_group)
            acc_counts_E, acc_tokens = None, 0
            if "global_aux_loss" in active:
                local_E = torch.sum(stats.counts_BE, 0, out=workspace.empty((E,),
                                                                            counts_BE.dtype))
                counts_E, Wb = R.sum_over_group(local_E, batch_group or token_group)
                acc_counts_E, acc_tokens = self._accumulate_global(counts_E, T * Wb, counting)
            total, values = WL.aux_losses_from_stats(
                stats.mean_BE, counts_BE, T * W, K, list(active.items()),
                acc_counts_E, acc_tokens)
            losses.update(values)
            return total
        if not active and logits_TE.device.type == "cpu":
            return workspace.empty((), logits_TE.dtype).zero_()  # new_zeros, from the arena
        total = logits_TE.new_zeros(())
        if not active or T == 0:
            return total
        S = T // num_sequences
        if stats is None:
            s_TE = R.aux_scores(logits_TE, self.options.score_function)
        with torch.no_grad():
            if stats is None:
                count_ids_TK = R.counts_for_aux(s_TE, ids_TK, self.options.aux_loss_counts)
                counts_E = R.expert_counts(count_ids_TK, E)
            else:
                counts_E = stats.counts_E
            local_E, T_local = counts_E, T
            # f_i over every rank of token_group (T counts the group's tokens); P_i stays this
            # rank's mean, and MoELayer averages the ranks' losses.
            counts_E, W = R.sum_over_group(counts_E, token_group)
            T = T * W
            if "global_aux_loss" in active:  # over the step's other micro-batches' ranks too
                global_E, Wb = R.sum_over_group(local_E, batch_group or token_group)
                global_T = T_local * Wb

        def switch(counts, tokens):
            if stats is None:
                return R.switch_aux_loss(s_TE, counts, tokens, K)
            return R.switch_aux_loss_from_mean(stats.mean_E, counts, tokens, K)

        for loss_type, coeff in active.items():
            if loss_type == "aux_loss":
                value = switch(counts_E, T)
            elif loss_type == "seq_aux_loss" and stats is None:
                value = R.seq_aux_loss(s_TE, count_ids_TK, num_sequences, token_group)
            elif loss_type == "seq_aux_loss":
                value = R.seq_aux_loss_from_stats(stats.mean_BE, stats.counts_BE, S, K,
                                                  token_group)
            else:
                value = switch(*self._accumulate_global(global_E, global_T, counting))
            losses[loss_type] = value.detach().float()
            total = total + coeff * value
        return total

    @torch.no_grad()
    def _accumulate_global(self, counts_E: torch.Tensor, T: int, counting: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | int]:
        """The global aux loss's (counts, tokens) so far this step, this micro-batch's
        included (tokens a 0-d int64 device tensor); counted into the step's buffers when
        ``counting``."""
        if self.global_counts_E is None:
            return counts_E, T
        if recomputing():
            # The counts already hold this micro-batch: replay the forward's values
            # (backward runs micro-batches in forward order, also under 1F1B).
            return self._replay.pop(0)
        if counts_E.device.type == "cpu":  # into the layer's arena (no allocation)
            acc_counts_E = torch.add(self.global_counts_E, counts_E,
                                     out=workspace.empty(tuple(counts_E.shape), counts_E.dtype))
            acc_tokens = torch.add(self.global_tokens, T,
                                   out=workspace.empty((), self.global_tokens.dtype))
        else:
            acc_counts_E = self.global_counts_E + counts_E
            acc_tokens = self.global_tokens + T
        if counting:
            self.global_counts_E.copy_(acc_counts_E)
            self.global_tokens.copy_(acc_tokens)
            if will_recompute():
                self._replay.append((acc_counts_E, acc_tokens))
        return acc_counts_E, acc_tokens

    @torch.no_grad()
    def finalize_step(self, group=None) -> None:
        """After optimizer.step(): update the expert bias from the step's counts (summed over
        ``group``), then reset the per-step counts (bias and global aux loss)."""
        if self.expert_bias is not None:
            self.expert_bias.copy_(R.updated_expert_bias(
                self.expert_bias, self.step_counts_E, self.options.bias_update_rate, group))
            self.step_counts_E.zero_()
        if self.global_counts_E is not None:
            self.global_counts_E.zero_()
            self.global_tokens.zero_()
            self._replay.clear()


def make_topk(model: ModelConfig, options: TopKOptions) -> TopKRouter:
    return TopKRouter(model, options)


@hookimpl
def moeplug_register_routers(registry) -> None:
    registry.add("topk", make_topk, options_cls=TopKOptions,
                 description="top-k router with every Megatron-Core feature: softmax/sigmoid/"
                             "sqrtsoftplus, group-limited, expert bias, aux/seq/global/z losses, "
                             "capacity dropping, padding (Mixtral semantics by default)")
