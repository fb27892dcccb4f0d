"""The router's losses as autograd Functions over the running MoE layer's workspace arena
(moeplug.runtime.workspace): no allocation after warm-up (issue 7).

Legend: T tokens, E experts, K top-k, B sequences (T = B * S, b-major).

    aux_losses_from_stats(mean_BE, counts_BE, T, K, terms, acc) -> (total, {type: value})
        total = 0 + c_1 * L_1 + c_2 * L_2 + ... over the configured aux-loss types, from the
        fused router's statistics (moeplug.routing.fused.AuxStats)
    add_z_loss(total, logits_TE, coeff) -> (total + coeff * z, z),  z = mean_t lse(z_t)^2

Each Function runs, forward and backward, the very ops (out= forms) that autograd runs for the
torch composition it replaces (moeplug.routing.aux_losses: ``switch_aux_loss_from_mean``,
``seq_aux_loss_from_stats``, ``z_loss``, and the router's ``total = total + coeff * value``), in
the same order, so values and gradients are bitwise the same (tests/test_moe_allocations.py
compares each with its composition). Python numbers enter as 0-d workspace tensors of the
operand's dtype: torch would wrap each number in a fresh 0-d tensor; IEEE operations on the same
fp32 operands give the same results either way. CPU only.
"""

from __future__ import annotations

import torch

from moeplug.runtime import workspace

# The aux-loss types that the stats path computes; "aux_loss" and "global_aux_loss" are the
# Switch loss (f_i from this micro-batch's counts, resp. the step's accumulated ones), the
# sequence one is DeepSeek-V2's per-sequence loss averaged over the B sequences.
STATS_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _ws(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return workspace.empty(shape, dtype)


class _AuxFromStats(torch.autograd.Function):
    """Forward: for each (type, coeff) of ``terms``, in order, the unscaled loss L and
    ``total = total + coeff * L`` from ``total = zeros(())``, as the router's general path
    composes them:
        aux_loss         E * sum(counts_E.to(f32) / (T*K) * mean_BE.mean(0))
        global_aux_loss  the same with (acc_counts_E, acc_tokens) for (counts_E, T)
        seq_aux_loss     E * sum(counts_BE.to(f32) / (S*K) * mean_BE) / B
    Backward: each term's chain of MulBackward / DivBackward / SumBackward / MeanBackward
    nodes, op for op; the [B, E] grads of several terms are summed last term first, the order
    in which autograd's engine (latest node first) accumulates them into ``mean_BE``'s grad."""

    @staticmethod
    def forward(ctx, mean_BE, counts_BE, acc_counts_E, terms, T, top_k, acc_tokens):
        B, E = mean_BE.shape
        dt = mean_BE.dtype
        S = T // B
        total = _ws((), dt).zero_()
        saved, values = [], []
        mean_E = None
        for loss_type, coeff in terms:
            if loss_type == "seq_aux_loss":
                f = _ws((B, E), dt).copy_(counts_BE).div_(workspace.number(S * top_k, dt))
                prod = torch.mul(f, mean_BE, out=_ws((B, E), dt))
                s = torch.sum(prod, (0, 1), out=_ws((), dt))  # all dims: torch.sum(prod)
                v = torch.mul(s, workspace.number(E, dt), out=_ws((), dt))
                value = torch.div(v, workspace.number(B, dt), out=_ws((), dt))
            else:
                if mean_E is None:  # torch.mean on the CPU is sum_out(...).div_(count)
                    mean_E = torch.sum(mean_BE, 0, out=_ws((E,), dt)).div_(workspace.number(B, dt))
                if loss_type == "aux_loss":
                    counts_E, tokens = torch.sum(counts_BE, 0, out=_ws((E,), counts_BE.dtype)), T
                else:
                    counts_E, tokens = acc_counts_E, acc_tokens
                # tokens: an int, or the global aux loss's 0-d device count (never read on the
                # host); either way the float of the same integer.
                n = (workspace.number(tokens * top_k, dt) if isinstance(tokens, int) else
                     _ws((), dt).copy_(tokens).mul_(workspace.number(top_k, dt)))
                f = _ws((E,), dt).copy_(counts_E).div_(n)
                prod = torch.mul(f, mean_E, out=_ws((E,), dt))
                s = torch.sum(prod, 0, out=_ws((), dt))
                value = torch.mul(s, workspace.number(E, dt), out=_ws((), dt))
            scaled = torch.mul(value, workspace.number(coeff, dt), out=_ws((), dt))
            total = torch.add(total, scaled, out=_ws((), dt))
            saved.append(f)
            values.append(value)
        ctx.save_for_backward(*saved)
        ctx.terms = terms
        ctx.shape = (B, E)
        ctx.arena = workspace.current_arena()
        ctx.mark_non_differentiable(*values)
        ctx.set_materialize_grads(False)  # no zero grads allocated for the values
        return (total, *values)

    @staticmethod
    def backward(ctx, grad_total, *_grad_values):
        none = (None,) * 6
        if grad_total is None:
            return (None, *none)
        B, E = ctx.shape
        dt = grad_total.dtype
        grads = []
        with workspace.ctx_arena(ctx):
            for (loss_type, coeff), f in zip(ctx.terms, ctx.saved_tensors):
                g = torch.mul(grad_total, workspace.number(coeff, dt), out=_ws((), dt))
                if loss_type == "seq_aux_loss":  # DivBackward0, MulBackward0, Sum-, Mul-
                    g = torch.div(g, workspace.number(B, dt), out=_ws((), dt))
                    g = torch.mul(g, workspace.number(E, dt), out=_ws((), dt))
                    g_BE = torch.mul(g.expand(B, E), f, out=_ws((B, E), dt))
                else:  # MulBackward0, SumBackward0, MulBackward0, MeanBackward0
                    g = torch.mul(g, workspace.number(E, dt), out=_ws((), dt))
                    g_E = torch.mul(g.expand(E), f, out=_ws((E,), dt))
                    g_BE = torch.div(g_E.unsqueeze(0).expand(B, E), workspace.number(B, dt),
                                     out=_ws((B, E), dt))
                grads.append(g_BE)
            grad_BE = grads.pop()
            while grads:
                grad_BE.add_(grads.pop())
        return (grad_BE, *none)


def aux_losses_from_stats(mean_BE: torch.Tensor, counts_BE: torch.Tensor, num_tokens: int,
                          top_k: int, terms: list[tuple[str, float]],
                          acc_counts_E: torch.Tensor | None = None,
                          acc_tokens: int | torch.Tensor = 0
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of coeff * loss over ``terms``, {type: unscaled loss, detached}) from the fused
    router's per-sequence means and counts over ``num_tokens`` tokens (B = mean_BE.shape[0]
    equal sequences; B = 1 when no seq_aux_loss is configured). ``global_aux_loss`` needs the step's accumulated
    counts (this micro-batch's included) and token count in ``acc_counts_E``, ``acc_tokens``."""
    for loss_type, _ in terms:
        if loss_type not in STATS_LOSS_TYPES:
            raise ValueError(f"aux_losses_from_stats: loss type {loss_type!r} unknown. Fix: use "
                             f"one of {', '.join(STATS_LOSS_TYPES)}")
    if any(t == "global_aux_loss" for t, _ in terms) and acc_counts_E is None:
        raise ValueError("aux_losses_from_stats: global_aux_loss needs acc_counts_E. Fix: pass "
                         "the step's accumulated expert counts and token count")
    terms = tuple((t, float(c)) for t, c in terms)
    out = _AuxFromStats.apply(mean_BE, counts_BE, acc_counts_E, terms, num_tokens, top_k,
                              acc_tokens)
    return out[0], {t: v for (t, _), v in zip(terms, out[1:])}


class _AddZLoss(torch.autograd.Function):
    """``(total + coeff * z_loss(logits_TE), z_loss(logits_TE))``. Forward repeats torch's CPU
    logsumexp (amax, non-finite maxima set to 0, sum of exp(x - max), log, + max), square
    (pow 2 is x * x) and mean (sum, / T); backward repeats AddBackward0, MulBackward0,
    MeanBackward0, PowBackward0 (g * (2 * lse)) and LogsumexpBackward0
    (g[:, None] * exp(x - lse[:, None]))."""

    @staticmethod
    def forward(ctx, total, logits_TE, coeff):
        T, E = logits_TE.shape
        dt = logits_TE.dtype
        max_T1 = torch.amax(logits_TE, -1, True, out=_ws((T, 1), dt))
        inf_T1 = torch.eq(torch.abs(max_T1, out=_ws((T, 1), dt)),
                          workspace.number(float("inf"), dt), out=_ws((T, 1), torch.bool))
        max_T1.masked_fill_(inf_T1, workspace.number(0.0, dt))
        shifted_TE = torch.sub(logits_TE, max_T1, out=_ws((T, E), dt)).exp_()
        lse_T = torch.sum(shifted_TE, -1, out=_ws((T,), dt)).log_().add_(max_T1.view(T))
        sq_T = torch.mul(lse_T, lse_T, out=_ws((T,), dt))
        z = torch.sum(sq_T, 0, out=_ws((), dt)).div_(workspace.number(T, dt))
        scaled = torch.mul(z, workspace.number(coeff, dt), out=_ws((), dt))
        out = torch.add(total, scaled, out=_ws((), torch.result_type(total, scaled)))
        ctx.save_for_backward(logits_TE, lse_T)
        ctx.coeff = coeff
        ctx.arena = workspace.current_arena()
        ctx.mark_non_differentiable(z)
        ctx.set_materialize_grads(False)
        return out, z

    @staticmethod
    def backward(ctx, grad_out, _grad_z):
        if grad_out is None:
            return None, None, None
        logits_TE, lse_T = ctx.saved_tensors
        T, E = logits_TE.shape
        dt = logits_TE.dtype
        grad_logits = None
        if ctx.needs_input_grad[1]:
            with workspace.ctx_arena(ctx):
                g = torch.mul(grad_out, workspace.number(ctx.coeff, dt), out=_ws((), dt))
                g_T = torch.div(g.expand(T), workspace.number(T, dt), out=_ws((T,), dt))
                two_lse_T = torch.mul(lse_T, workspace.number(2.0, dt), out=_ws((T,), dt))
                g_T = torch.mul(g_T, two_lse_T, out=_ws((T,), dt))
                e_TE = torch.sub(logits_TE, lse_T.unsqueeze(-1), out=_ws((T, E), dt)).exp_()
                grad_logits = torch.mul(g_T.unsqueeze(-1), e_TE, out=_ws((T, E), dt))
        return grad_out if ctx.needs_input_grad[0] else None, grad_logits, None


def z_loss_applies(logits_TE: torch.Tensor) -> bool:
    """:func:`add_z_loss` runs on contiguous fp32 CPU logits [T > 0, E]."""
    return (logits_TE.device.type == "cpu" and logits_TE.dtype == torch.float32
            and logits_TE.dim() == 2 and logits_TE.shape[0] > 0 and logits_TE.is_contiguous())


def add_z_loss(total: torch.Tensor, logits_TE: torch.Tensor, coeff: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total + coeff * z, z)`` with z = mean_t logsumexp(logits_TE[t])^2 (ST-MoE z-loss;
    :func:`moeplug.routing.aux_losses.z_loss`), z detached. Needs :func:`z_loss_applies`."""
    return _AddZLoss.apply(total, logits_TE, float(coeff))
