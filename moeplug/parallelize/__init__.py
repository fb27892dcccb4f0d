"""Parallelism and memory levers applied to a built model from outside its modules
(torchtitan's ``parallelize.py``): the modules under moeplug.modules are built for one process
and import nothing of moeplug.parallel; this package changes a built model, in a fixed order:

    1. TP / SP     (tp.apply_tp)        attention q/k/v column- and o row-parallel, dense MLP
                                        gate/up column- and down row-parallel, vocab-parallel
                                        embedding and head, the MTP blocks and eh_proj,
                                        ``sequence_parallel`` grad flags,
                                        the TP region hooks (wiring.ParallelWiring)
    2. CP          (cp.apply_cp)        CP attention and the CP loss / aux-loss hooks, added
                                        to the TP wiring; then the wiring is installed
    3. EP / ETP    (ep.apply_ep)        the MoE layers' token and batch groups; their plugins
                                        were made for EP / ETP by the builder (ep.expert_layout)
    4. recompute   (modules.recompute)  selective marks (full recompute: run_blocks reads it)
    5. offload     (modules.offload)    chosen module inputs to the runtime's second tier

The order matters: TP replaces layers that offload marks (``attn_proj`` marks the
row-parallel o_proj, not the layer it replaced), CP's hooks extend TP's, and an offloaded
module that is also recomputed runs its offload scope around the checkpoint (the marks nest in
the order applied, moeplug.modules.marks). The builder (moeplug.build.build_model) calls
:func:`parallelize_model` before initialising the parameters, so a parallel model's weights
are drawn from the same generator stream as before; FSDP is applied last, by the training
setup (moeplug.training.distributed), over the layout this leaves. Under PP the builder then
cuts the parallelized model into this rank's chunks (pipeline.split_model).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moeplug.config import RootConfig
from moeplug.modules.offload import Offloader, apply_offload
from moeplug.modules.recompute import apply_recompute
from moeplug.parallelize.cp import apply_cp
from moeplug.parallelize.ep import ExpertLayout, apply_ep, expert_layout
from moeplug.parallelize.tp import apply_tp
from moeplug.parallelize.wiring import ParallelWiring, install

ORDER = ("tp", "cp", "ep", "recompute", "offload")


def parallelize_model(model: nn.Module, cfg: RootConfig, groups: Any = None) -> None:
    """Apply the steps of :data:`ORDER` to ``model`` (a freshly built MoETransformer; its
    ``runtime`` set) for ``groups`` (a ParallelGroups; None: one process, steps 1-3 do
    nothing)."""
    wiring = apply_tp(model, groups)
    wiring = apply_cp(model, groups, wiring)
    if wiring is not None:  # the model's stages, its blocks and the MTP blocks
        model.wiring = wiring
        install([*model.blocks, *model.mtp], wiring)
    apply_ep(model, groups)
    m = cfg.model
    apply_recompute(model, m.recompute)  # selective: marks modules; full: run_blocks reads it
    if m.offload:  # chosen module inputs go to the second tier (moeplug.modules.offload)
        rc, runtime = cfg.runtime, model.runtime
        runtime.offloader = Offloader(rc.offload_dir, rc.stash_page_bytes, rc.offload_max_bytes,
                                      rc.offload_min_bytes)
        apply_offload(model, m.offload, runtime.offloader)
        runtime.offload_modules = list(m.offload)


__all__ = ["ORDER", "ExpertLayout", "ParallelWiring", "expert_layout", "parallelize_model"]
