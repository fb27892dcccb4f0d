"""The fused router: scores, expert bias, group-limited top-k, routing weights and the aux-loss
statistics in one C++ pass over the logits (runtime_cpp/src/route.cpp), with its backward.

Legend: T tokens, E experts, K top-k, B sequences (T = B * S, b-major).

    fused_topk_routing(logits_TE, K, ...) -> FusedRouting(probs_TK, ids_TK, stats)
``probs_TK, ids_TK`` equal :func:`moeplug.routing.scores.topk_routing`'s; ``stats`` (when an
aux-loss count mode is given) holds what the aux losses need instead of the [T, E] aux scores:
``mean_BE`` = each sequence's mean of :func:`moeplug.routing.scores.aux_scores` (differentiable)
and ``counts_BE`` = each sequence's expert counts from :func:`counts_for_aux`'s ids.

Covered: every score function, renormalize, expert bias, group-limited top-k (both group-score
rules), scaling, aux statistics for aux_loss / seq_aux_loss / global_aux_loss with plain_topk or
routed counts. Everything else composes in torch around it (jitter and forced balance before,
z-loss on the logits, capacity dropping after). :func:`fused_routing_applies` says when the
kernel runs: fp32 logits with at least one token on the CPU (runtime_cpp/src/route.cpp), and,
when asked for (``cuda=True``), on a GPU where moeplug._runtime_cuda is loaded: its route
kernels (runtime_cpp/cuda/src/route.cu) take the same arguments on device pointers, on torch's
current stream. Otherwise (fp64 router dtype, CUDA without the extension) the router keeps the
plain-torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeplug.ops import cuda_ops
from moeplug.runtime import workspace
from moeplug.routing.scores import SCORE_FUNCTIONS, group_members
from moeplug.runtime import runtime_for

_AUX_COUNT_CODES = {None: 0, "plain_topk": 1, "routed": 2}


@dataclass(frozen=True)
class AuxStats:
    """Per-sequence aux-loss inputs: ``mean_BE`` (differentiable) and ``counts_BE`` (int64)."""

    mean_BE: torch.Tensor
    counts_BE: torch.Tensor

    @property
    def mean_E(self) -> torch.Tensor:
        """Mean aux score over all T tokens (sequences have equal length)."""
        return self.mean_BE.mean(dim=0)

    @property
    def counts_E(self) -> torch.Tensor:
        return self.counts_BE.sum(dim=0)


@dataclass(frozen=True)
class FusedRouting:
    probs_TK: torch.Tensor
    ids_TK: torch.Tensor
    stats: AuxStats | None


def fused_routing_applies(logits_TE: torch.Tensor, cuda: bool = False) -> bool:
    """The fused kernel runs on fp32 logits [T > 0, E] on the CPU, and with ``cuda`` on a GPU
    where the CUDA extension is loaded."""
    if logits_TE.dtype != torch.float32 or logits_TE.dim() != 2 or logits_TE.shape[0] == 0:
        return False
    return logits_TE.device.type == "cpu" or (cuda and cuda_ops.available(logits_TE))


def _spec(T: int, E: int, k: int, score_function: str, renormalize: bool,
          num_groups: int | None, group_topk: int | None, group_score: str,
          scaling_factor: float, aux_counts: str | None, num_sequences: int) -> dict:
    grouped = bool(num_groups) and num_groups > 1
    return dict(num_tokens=T, num_experts=E, top_k=k,
                score=SCORE_FUNCTIONS.index(score_function), renormalize=bool(renormalize),
                num_groups=num_groups if grouped else 0,
                group_topk=group_topk if grouped else 0,
                group_members=group_members(k, group_topk, group_score) if grouped else 0,
                scaling=float(scaling_factor), aux_counts=_AUX_COUNT_CODES[aux_counts],
                num_sequences=num_sequences)


class _FusedRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, spec):
        T, E, K, B = spec["num_tokens"], spec["num_experts"], spec["top_k"], spec["num_sequences"]
        # On the CPU from the running MoE layer's workspace arena (moeplug.runtime.workspace): no
        # allocation after warm-up.
        empty = workspace.allocator(logits_TE.device)
        probs_TK = empty((T, K), torch.float32)
        ids_TK = empty((T, K), torch.int64)
        mean_BE = empty((B, E), torch.float32).zero_()
        counts_BE = empty((B, E), torch.int64).zero_()
        runtime, extra = runtime_for(logits_TE)
        runtime.route_forward(
            logits=logits_TE.data_ptr(), bias=0 if bias_E is None else bias_E.data_ptr(),
            probs=probs_TK.data_ptr(), ids=ids_TK.data_ptr(), aux_mean=mean_BE.data_ptr(),
            counts=counts_BE.data_ptr(), **spec, **extra)
        ctx.save_for_backward(logits_TE, ids_TK)
        ctx.spec = spec
        ctx.arena = workspace.current_arena()
        ctx.mark_non_differentiable(ids_TK, counts_BE)
        ctx.set_materialize_grads(False)  # an unused output's grad arrives as None: skipped
        return probs_TK, ids_TK, mean_BE, counts_BE

    @staticmethod
    def backward(ctx, grad_probs_TK, _grad_ids, grad_mean_BE, _grad_counts):
        logits_TE, ids_TK = ctx.saved_tensors
        if grad_probs_TK is None and grad_mean_BE is None:
            return None, None, None
        gp = None if grad_probs_TK is None else grad_probs_TK.float().contiguous()
        gm = None
        if grad_mean_BE is not None and ctx.spec["aux_counts"]:
            gm = grad_mean_BE.float().contiguous()
        with workspace.ctx_arena(ctx):
            grad_TE = workspace.allocator(logits_TE.device)(tuple(logits_TE.shape),
                                                             logits_TE.dtype)
        runtime, extra = runtime_for(logits_TE)
        runtime.route_backward(
            logits=logits_TE.data_ptr(), ids=ids_TK.data_ptr(),
            grad_probs=0 if gp is None else gp.data_ptr(),
            grad_aux_mean=0 if gm is None else gm.data_ptr(), grad_logits=grad_TE.data_ptr(),
            **ctx.spec, **extra)
        return grad_TE, None, None


def fused_topk_routing(logits_TE: torch.Tensor, k: int, *, score_function: str = "softmax",
                       renormalize: bool = True, expert_bias_E: torch.Tensor | None = None,
                       num_groups: int | None = None, group_topk: int | None = None,
                       group_score: str = "topk_share", scaling_factor: float = 1.0,
                       aux_counts: str | None = None, num_sequences: int = 1) -> FusedRouting:
    """:func:`moeplug.routing.scores.topk_routing` (same arguments) in one kernel, plus the
    aux statistics when ``aux_counts`` is ``"plain_topk"`` or ``"routed"``. Needs
    :func:`fused_routing_applies` (``cuda=True``: on a GPU too); ``num_sequences`` must divide
    T when ``aux_counts`` is set."""
    if not fused_routing_applies(logits_TE, cuda=True):
        raise ValueError(f"fused_topk_routing: needs fp32 logits [T > 0, E] on the CPU, or on a "
                         f"GPU with moeplug._runtime_cuda loaded; got {logits_TE.dtype} "
                         f"{tuple(logits_TE.shape)} on {logits_TE.device}. Fix: use "
                         f"moeplug.routing.topk_routing for this input")
    if score_function == "softmax" and expert_bias_E is not None:
        raise ValueError("fused_topk_routing: expert_bias_E with score_function='softmax'. Fix: "
                         "use 'sigmoid' or 'sqrtsoftplus' with an expert bias")
    if aux_counts not in _AUX_COUNT_CODES:
        raise ValueError(f"fused_topk_routing: aux_counts = {aux_counts!r}: unknown. Fix: use "
                         f"None, 'plain_topk' or 'routed'")
    T, E = logits_TE.shape
    spec = _spec(T, E, k, score_function, renormalize, num_groups, group_topk, group_score,
                 scaling_factor, aux_counts, num_sequences if aux_counts else 1)
    bias = None if expert_bias_E is None else expert_bias_E.detach().float().contiguous()
    probs_TK, ids_TK, mean_BE, counts_BE = _FusedRoute.apply(logits_TE.contiguous(), bias, spec)
    stats = AuxStats(mean_BE, counts_BE) if aux_counts else None
    return FusedRouting(probs_TK, ids_TK, stats)
