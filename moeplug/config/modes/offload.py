"""model.offload (moeplug.modules.offload): chosen module inputs moved to the stash's second
tier in forward, prefetched before backward. A tensor that a recompute discards is never kept,
so there is nothing to offload. (The expert names' backend capability: recompute.py; the
captured region ignoring them: capture.py; a GPU's sync-free region: sync_free.py.)"""

from __future__ import annotations

from moeplug.config._checks import _fail
from moeplug.config.model import RecomputeConfig
from moeplug.config.modes._rule import Facts, Rule

# The recompute names that drop an offload name's tensors (a checkpoint's internals; the
# outputs layernorm and mla_up_proj discard: the q/k/v projections' input, attention's q, k, v)
# or hold them for their rebuild (a discarded norm's input).
_OFFLOAD_INSIDE_RECOMPUTE = {"core_attn": ("core_attn",),
                             "layernorm": ("attn_norm", "mlp_norm", "qkv_linear"),
                             "mla_up_proj": ("core_attn",), "moe": ("expert_fc1", "moe_act")}


def _recompute(f: Facts) -> RecomputeConfig | None:
    m = f.cfg.model
    ok = isinstance(m.offload, list) and isinstance(m.recompute, RecomputeConfig)
    return m.recompute if ok else None


def _not_under_full_recompute(f: Facts) -> None:
    m, rc = f.cfg.model, _recompute(f)
    if rc is not None and m.offload and rc.granularity == "full":
        _fail(m, "offload", m.offload, "is kept by nothing under full recompute (each block "
              "keeps only its input)", "drop offload or use recompute granularity selective")


def _not_inside_recompute(f: Facts) -> None:
    m, rc = f.cfg.model, _recompute(f)
    if rc is None or rc.granularity != "selective" or not isinstance(rc.modules, list):
        return
    for r in rc.modules:
        clash = [o for o in _OFFLOAD_INSIDE_RECOMPUTE.get(r, ()) if o in m.offload]
        if clash:
            _fail(m, "offload", m.offload, f"names {clash}, whose tensors recompute module "
                  f"{r!r} already drops or keeps for its rebuild",
                  f"drop {clash} from offload or {r!r} from recompute.modules")


RULES = (
    Rule("offload", "config", "ModelConfig.offload", _not_under_full_recompute,
         {"model": {"offload": ["core_attn"], "recompute": {"granularity": "full"}}}),
    Rule("offload", "config", "ModelConfig.offload", _not_inside_recompute,
         {"model": {"offload": ["expert_fc1"],
                    "recompute": {"granularity": "selective", "modules": ["moe"]}}}),
)
