"""AdamW with parameter groups, and the warmup + cosine learning-rate schedule.

Weight decay policy: decoupled decay (AdamW) applies only to matrices that do linear maps
(attention/MLP/expert/router weights, ``ndim >= 2``). Norm gains and biases (``ndim < 2``) and
embedding tables are not decayed: decaying a gain pulls it toward 0 instead of toward identity,
and embedding rows of rare tokens receive few gradients, so decay would mostly just shrink them.
With tied embeddings the shared table counts as an embedding (not decayed).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeplug.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr.

    Warmup reaches ``lr`` at the end of step ``warmup - 1`` (step 0 uses lr/warmup, never 0,
    so the first update is not wasted; warmup = ``cfg.effective_warmup_steps``, at most
    ``steps``). After warmup, a half cosine from ``lr`` down to ``min_lr`` at ``steps``; steps
    past the end stay at ``min_lr``.
    """
    warmup = cfg.effective_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    decay_steps = max(1, cfg.steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into a decayed and a non-decayed group (policy in the module docstring)."""
    from moeplug.parallel.tensor_parallel import VocabParallelEmbedding  # TP's embedding table
    embedding_ids = {id(m.weight) for m in model.modules()
                     if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() already de-duplicates tied weights
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embedding_ids:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # lr here is a placeholder: the trainer sets every group's lr from lr_at(step) each step.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=lr_at(0, cfg),
                             betas=(cfg.beta1, cfg.beta2), eps=1e-8)
