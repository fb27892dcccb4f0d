"""An up-front memory check for ``moeplug train``: refuse a config whose model cannot fit before
anything is allocated, instead of an allocator traceback seconds (or hours) later.

The estimate is a documented **lower bound** per process, so a run that could fit is never
refused: only the fp32 weights (4 bytes per parameter, no gradients, no AdamW moments, no
activations but the logits), with the parallel degrees dividing what they shard (experts over
EP·ETP·PP, dense weights over TP·PP, logits over TP·CP). Real use is several times higher.
"""

from __future__ import annotations

import os

from moeplug.config import ConfigError, RootConfig

_F32 = 4  # bytes per fp32 value


def _vocab(cfg: RootConfig) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    return 256 if cfg.data.tokenizer == "bytes" else cfg.data.vocab_size


def lower_bound_terms(cfg: RootConfig) -> dict[str, int]:
    """Bytes per process, by the config field that drives each term (a lower bound)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    D, V = m.hidden_size, _vocab(cfg)
    freq = m.moe.layer_freq  # counted, not listed: num_layers may be absurdly large here
    moe_layers = (sum(1 for i, v in enumerate(freq) if v and i >= m.first_k_dense)
                  if isinstance(freq, list) else
                  len(range(-(-m.first_k_dense // freq) * freq, m.num_layers, freq)))
    dense_layers = m.num_layers - moe_layers
    fc1 = 2 if m.moe.activation in ("swiglu", "geglu") else 1
    # Attention: at least the q and output projections (D x D each), whatever the variant.
    attention = m.num_layers * 2 * D * D // (p.tp * p.pp)
    experts = moe_layers * m.moe.num_experts * (fc1 + 1) * D * m.moe.ffn_hidden_size
    experts //= p.ep * p.etp * p.pp
    dense = dense_layers * 2 * D * m.dense_ffn_hidden_size // (p.tp * p.pp)
    embeddings = (1 if m.tie_embeddings else 2) * V * D // p.tp
    logits = t.micro_batch_size * t.seq_len * V // (p.tp * p.cp)
    return {"model.hidden_size": _F32 * (attention + dense),
            "model.moe.num_experts": _F32 * experts,
            "model.vocab_size": _F32 * embeddings,
            "train.micro_batch_size": _F32 * logits}


def available_bytes(device: str) -> tuple[int, str]:
    """Free memory where the model will live (``train.device``): the GPU's free memory for
    cuda (auto: when torch sees one), else the RAM's MemAvailable."""
    if device != "cpu":
        import torch
        if torch.cuda.is_available():
            index = int(device.partition(":")[2] or 0)
            return torch.cuda.mem_get_info(index)[0], f"free on cuda:{index}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in RAM"
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical RAM"


_FIX = {"model.hidden_size": "lower model.hidden_size (or raise parallel.tp / parallel.pp)",
        "model.moe.num_experts": "lower model.moe.num_experts or ffn_hidden_size "
                                 "(or raise parallel.ep)",
        "model.vocab_size": "lower the vocabulary (model.vocab_size / data.vocab_size)",
        "train.micro_batch_size": "lower train.micro_batch_size or train.seq_len"}


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_fits(cfg: RootConfig, processes_here: int = 1) -> None:
    """ConfigError naming the dominant field, bytes needed vs available, and the fix, when even
    the lower bound for ``processes_here`` processes sharing this RAM (one GPU each) does not
    fit."""
    terms = lower_bound_terms(cfg)
    free, where = available_bytes(cfg.train.device)
    shared = 1 if where.startswith("free on cuda") else processes_here
    needed = sum(terms.values()) * shared
    if needed <= free:
        return
    field = max(terms, key=terms.get)
    value = {"model.hidden_size": cfg.model.hidden_size,
             "model.moe.num_experts": cfg.model.moe.num_experts,
             "model.vocab_size": _vocab(cfg),
             "train.micro_batch_size": cfg.train.micro_batch_size}[field]
    raise ConfigError(f"{field} = {value}: the model needs at least {_gib(needed)} "
                      f"({_gib(terms[field] * shared)} of it from this field; fp32 weights and "
                      f"logits only) but {_gib(free)} is available ({where}). Fix: {_FIX[field]}")
