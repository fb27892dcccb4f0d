"""moeplug's public plugin API: everything a plugin may import from moeplug, and nothing else.

A plugin (the built-in ones under ``plugins/`` included) imports moeplug only as
``from moeplug.api import NAME`` (``moeplug.testing`` too, for its contract tests). Every name in
``__all__`` is documented in docs/plugins.md ("The plugin API"), one line each;
tests/test_plugin_api.py fails naming file:line on any other import from moeplug under
``plugins/``, and on any plugin that loads the compiled extension itself (the runtime loader
does: :func:`get_runtime`, :func:`core_feature_missing`).

The names load on first use, so ``from moeplug.api import hookimpl`` (a plugin's registration
module) imports pluggy and nothing heavy; the ops and collectives import torch when a plugin
first takes them. Five names are modules, kept as namespaces because plugins call them as a
family: ``comm`` (differentiable collectives), ``shm_rows`` (direct-write rows through the
shared-memory heap), ``workspace`` (the model runtime's buffers), ``routing`` (router math) and
``workspace_losses`` (its aux losses on workspace buffers).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, attribute in it; None: the module itself). Grouped as docs/plugins.md lists them.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    # Writing a plugin: the hook marker, the interfaces and the types they exchange.
    "hookimpl": ("moeplug.hookspecs", "hookimpl"),
    "Router": ("moeplug.interfaces", "Router"),
    "RouterOutput": ("moeplug.interfaces", "RouterOutput"),
    "Dispatcher": ("moeplug.interfaces", "Dispatcher"),
    "Dispatched": ("moeplug.interfaces", "Dispatched"),
    "Experts": ("moeplug.interfaces", "Experts"),
    "Precision": ("moeplug.interfaces", "Precision"),
    "PluginHost": ("moeplug.plugin_host", "PluginHost"),
    # Config types a plugin takes or raises.
    "ConfigError": ("moeplug.config", "ConfigError"),
    "ModelConfig": ("moeplug.config", "ModelConfig"),
    # Dataset plugins (a corpus reader).
    "CorpusReader": ("moeplug.data.reader", "CorpusReader"),
    "Chunk": ("moeplug.data.reader", "Chunk"),
    "RecordError": ("moeplug.data.reader", "RecordError"),
    "file_or_files_under": ("moeplug.data.reader", "file_or_files_under"),
    # The runtime.
    "get_runtime": ("moeplug.runtime", "get_runtime"),
    "core_feature_missing": ("moeplug.runtime", "core_feature_missing"),
    "workspace": ("moeplug.runtime.workspace", None),
    # Runtime ops: permutation and the expert FFN implementations.
    "permute": ("moeplug.ops.permute", "permute"),
    "permute_probs": ("moeplug.ops.permute", "permute_probs"),
    "unpermute": ("moeplug.ops.permute", "unpermute"),
    "activation_fn": ("moeplug.ops.activations", "activation_fn"),
    "fc1_rows": ("moeplug.ops.activations", "fc1_rows"),
    "expert_mlp": ("moeplug.ops.grouped_ffn", "expert_mlp"),
    "grouped_mlp": ("moeplug.ops.grouped_ffn", "grouped_mlp"),
    "grouped_ffn_packed": ("moeplug.ops.grouped_ffn", "grouped_ffn_packed"),
    "batched_ffn": ("moeplug.ops.cuda_ffn", "batched_ffn"),
    "same_rows": ("moeplug.ops.cuda_ffn", "same_rows"),
    # Routing math and the dropped/padded rows dispatchers handle.
    "routing": ("moeplug.routing", None),
    "workspace_losses": ("moeplug.routing.workspace_losses", None),
    "HF_AUX_LOSS": ("moeplug.routing.pooled", "HF_AUX_LOSS"),
    "pooled_aux_stats": ("moeplug.routing.pooled", "pooled_aux_stats"),
    "expert_counts": ("moeplug.routing", "expert_counts"),
    "padded_counts": ("moeplug.routing", "padded_counts"),
    "pad_rows": ("moeplug.routing", "pad_rows"),
    "unpad_rows": ("moeplug.routing", "unpad_rows"),
    "first_rows": ("moeplug.routing", "first_rows"),
    "append_sink_rows": ("moeplug.routing", "append_sink_rows"),
    "sink_dropped": ("moeplug.routing", "sink_dropped"),
    # Collectives and the one-machine shared-memory heap.
    "comm": ("moeplug.parallel.comm", None),
    "active_group": ("moeplug.parallel.comm", "active_group"),
    "shm_rows": ("moeplug.parallel.shm_rows", None),
    "SymmetricHeap": ("moeplug.parallel.shm_heap", "SymmetricHeap"),
    "heap_for": ("moeplug.parallel.shm_heap", "heap_for"),
    "MiB": ("moeplug.parallel.shm_heap", "MiB"),
    "expert_param_names": ("moeplug.parallel", "expert_param_names"),
    "global_param_names": ("moeplug.training.reshard", "global_names"),
    "model_parts": ("moeplug.training.reshard", "parts"),
    # Activation recompute (a router keeps its aux statistics out of the recomputed forward).
    "recomputing": ("moeplug.modules.recompute", "recomputing"),
    "will_recompute": ("moeplug.modules.recompute", "will_recompute"),
    # Precision recipes.
    "active_recipe": ("moeplug.quant", "active_recipe"),
    "recipe_plan": ("moeplug.quant", "recipe_plan"),
    "row_alignment": ("moeplug.quant", "row_alignment"),
    "quant_expert_mlp": ("moeplug.quant", "quant_expert_mlp"),
    "quant_linear": ("moeplug.quant", "quant_linear"),
    "quantized_exchange": ("moeplug.quant.wire", "quantized_exchange"),
    "Tensorwise": ("moeplug.quant", "Tensorwise"),
    "Delayed": ("moeplug.quant", "Delayed"),
    "Blockwise": ("moeplug.quant", "Blockwise"),
    "MXFP8": ("moeplug.quant", "MXFP8"),
    "NVFP4": ("moeplug.quant", "NVFP4"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"moeplug.api has no attribute {name!r}: it is not part of the "
                             f"plugin API (docs/plugins.md lists it)")
    module, attr = target
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
