"""Build a MoETransformer from a validated RootConfig and the plugin host: make the plugins and
the modules (for one process), apply the parallel layout and memory levers from outside
(moeplug.parallelize, in its fixed order), then initialise the parameters."""

from __future__ import annotations

from typing import Any

from moeplug.config import ConfigError, ParallelConfig, RootConfig
from moeplug.config.modes import check_modes
from moeplug.modules.transformer import MoETransformer
from moeplug.moe import MoELayer
from moeplug.moe.budgeted import budget_rows, budgeted_dispatcher
from moeplug.moe.shared_experts import SharedExperts
from moeplug.ops.activations import fc1_rows
from moeplug.parallel.embedding_group import build_embedding_group
from moeplug.parallelize import expert_layout, parallelize_model
from moeplug.parallelize.pipeline import PipelineChunk, model_layout, split_model
from moeplug.runtime.stash import ModelRuntime, layer_stash_bytes


def build_model(cfg: RootConfig, host: Any, vocab_size: int, ep_group: Any = None,
                groups: Any = None) -> MoETransformer:
    """One router, dispatcher and experts backend (+ shared experts when
    ``moe.shared_expert_ffn_hidden_size > 0``) per MoE layer of ``model.moe_layer_pattern``,
    each plugin made by ``host.create``.

    ``vocab_size`` comes from the tokenizer; ``cfg.model.vocab_size`` (if non-zero) may pad it up
    (e.g. to a multiple of 64 for faster GEMMs) but never below. ``ep_group`` is the
    expert-parallel process group (None: single process). ``groups`` (a ParallelGroups, None =
    single process) is the layout moeplug.parallelize applies (TP/SP -> CP -> EP/ETP ->
    recompute -> offload); its ``ep`` group is used when ``ep_group`` is not given.
    """
    m, p = cfg.model, cfg.plugins
    if m.vocab_size and m.vocab_size < vocab_size:
        raise ConfigError(
            f"ModelConfig.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({vocab_size}); token ids would overflow the embedding. Fix: set model.vocab_size=0 "
            f"(use the tokenizer's) or >= {vocab_size}")
    # EP / ETP are chosen as the plugins are made (the dispatcher is the EP exchange).
    experts_for = expert_layout(groups, ep_group)
    moe_layers = []
    runtime = ModelRuntime(cfg.runtime)  # every MoE layer registers once, here
    # The transformer places them by the pattern; MTP blocks follow the last layer's kind.
    num_mtp_moe = m.mtp_num_layers if m.moe_layer_pattern[-1] else 0
    for _ in range(sum(m.moe_layer_pattern) + num_mtp_moe):
        router = host.create("router", p.router, dict(p.router_options), m)
        dispatcher = host.create("dispatcher", p.dispatcher, dict(p.dispatcher_options), m,
                                 experts_for.ep_group)
        # ETP: all-gather rows over groups.etp around experts built with ffn_hidden_size / ETP.
        dispatcher = experts_for.dispatcher(dispatcher)
        experts = host.create("experts", p.experts, dict(p.experts_options),
                              experts_for.experts_config(m), dispatcher.num_local_experts)
        if not moe_layers:  # the modes' rules on its declared capabilities, as check_plugins
            check_modes(cfg, experts=type(experts))  # does before any rank (a build by hand)
        shared = (SharedExperts(m.hidden_size, m.moe) if m.moe.shared_expert_ffn_hidden_size
                  else None)
        handle = register_moe_layer(runtime, cfg, len(moe_layers), dispatcher.num_local_experts)
        # runtime.sync_free: the budgeted pair around the dispatcher (moeplug.moe.budgeted).
        budgeted = budgeted_dispatcher(dispatcher, experts,
                                       runtime.sync_free if cfg.runtime.sync_free else None,
                                       group=experts_for.ep_group,
                                       etp_group=experts_for.etp_group,
                                       weighted_input=m.moe.apply_probs_on_input)
        moe_layers.append(MoELayer(router, dispatcher, experts, shared,
                                   apply_probs_on_input=m.moe.apply_probs_on_input,
                                   overlap_chunks=m.moe.overlap_chunks, runtime=handle,
                                   budgeted=budgeted))
    runtime.finalize()
    model = MoETransformer(m, m.vocab_size or vocab_size, moe_layers)
    model.runtime = runtime
    parallelize_model(model, cfg, groups)
    # After parallelizing (torchtitan's init_weights): a parallel rank initialises its own
    # shards, in the order and from the generator draws it always did.
    model.reset_parameters()
    return model


def build_stage_modules(cfg: RootConfig, host: Any, vocab_size: int, groups: Any,
                        pipe: ParallelConfig | None = None) -> list[PipelineChunk]:
    """Build this rank's model chunks for ``groups`` (a ParallelGroups).

    The full model is built with :func:`build_model` (so the parallelize step applies TP/CP/EP
    unchanged) and then sliced (moeplug.parallelize.pipeline.split_model). Cost: the whole model
    exists briefly on every rank; gain: with the same seed every rank's chunks hold exactly the
    single-process initial weights, with no broadcast. Layout errors raise before building.
    Collective (the embedding group, see :func:`build_embedding_group`)."""
    pipe = pipe or ParallelConfig()
    pp, pp_rank = groups.size("pp"), groups.rank_in("pp")
    layout = model_layout(pipe, cfg.model, pp)  # validate before the (larger) build
    embedding_group = build_embedding_group(groups, cfg.model, layout)
    model = build_model(cfg, host, vocab_size, groups=groups)
    return split_model(model, pipe, pp, pp_rank, embedding_group)


def register_moe_layer(runtime: ModelRuntime, cfg: RootConfig, index: int,
                       num_local_experts: int) -> Any:
    """Registers MoE layer ``index`` with the runtime; its reservation is the stash of one
    micro-batch at average routing (T*K rows on every rank; sync_free: the E*C budget rows;
    times the ETP size, at F/ETP)."""
    m, tc = cfg.model, cfg.train
    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(cfg.plugins.precision,
                                                        cfg.plugins.precision)
    itemsize = 2 if dtype == "bfloat16" else 4
    rows = tc.micro_batch_size * tc.seq_len * m.moe.top_k
    if cfg.runtime.sync_free:  # static buffers: E experts x C budget rows each
        rows = m.moe.num_experts * budget_rows(tc.micro_batch_size * tc.seq_len, m.moe.top_k,
                                               m.moe.num_experts, cfg.runtime.token_budget)
    # ETP: the experts see the rows of every ETP rank, each with its F/ETP slice.
    etp = cfg.parallel.etp
    F = m.moe.ffn_hidden_size
    rows, F_local = rows * etp, F // etp
    fc1 = fc1_rows(m.moe.activation, F_local)
    # With overlap_chunks = N the experts run N times per micro-batch, each stashing its own
    # page-rounded tensors: reserve N chunks' worth (moeplug.moe.overlap).
    chunks = m.moe.overlap_chunks
    stash_bytes = chunks * layer_stash_bytes(-(-rows // chunks), m.hidden_size, fc1, F_local,
                                             itemsize, cfg.runtime.stash_page_bytes)
    return runtime.register_layer(
        index=index, num_experts=m.moe.num_experts, top_k=m.moe.top_k, hidden=m.hidden_size,
        ffn_hidden=F, num_local_experts=num_local_experts, dtype=dtype,
        activation=m.moe.activation, stash_bytes=stash_bytes)
