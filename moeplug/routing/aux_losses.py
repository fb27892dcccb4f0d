"""Load-balancing losses (Switch / DeepSeek style) and the ST-MoE z-loss. All return the
*unscaled* loss (the coefficient is applied by the caller), so a perfectly uniform router gives
exactly 1.0 for every aux-loss type.

Legend: T tokens, E experts, K top-k, B sequences, S tokens per sequence (T = B * S, b-major).

    aux_loss         L = E * sum_i f_i * P_i,  f_i = n_i / (T*K) (constant), P_i = mean_t s[t, i]
    seq_aux_loss     the same per sequence, averaged over the B sequences (DeepSeek-V2); equals
                     aux_loss at B = 1 and the mean of per-sequence aux losses otherwise
    global_aux_loss  f_i from counts accumulated over every micro-batch of the optimizer step so
                     far: f_i = (sum n_i) / (K * sum T), i.e. the running mean of the counts over
                     the running mean of the token count (Megatron #7213: normalising the
                     accumulated counts by the *current* micro-batch's T is wrong when
                     micro-batches differ in size); P_i from the current micro-batch
    z_loss           mean_t logsumexp(z_t)^2
s is the full score distribution (``moeplug.routing.scores.aux_scores``) and n_i the number of
token choices counted for expert i (``counts_for_aux``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeplug.runtime import workspace
from moeplug.parallel.comm import blocking
from moeplug.routing.scores import select_topk
from moeplug.routing.workspace_losses import aux_losses_from_stats

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
AUX_LOSS_COUNTS = ("plain_topk", "routed")


def expert_counts(ids_TK: torch.Tensor, num_experts: int, keep_TK: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """int64 [E]: token choices per expert (only those with ``keep_TK`` True when given)."""
    # scatter_add, not bincount or a boolean mask: the output size is known without reading
    # the ids on the host (runtime.sync_free; on a GPU bincount and x[mask] wait for the device).
    ids = ids_TK.reshape(-1)
    if ids.device.type == "cpu":  # the same integers in the running MoE layer's arena
        ones = workspace.empty((ids.numel(),), ids.dtype)
        ones.fill_(1) if keep_TK is None else ones.copy_(keep_TK.reshape(-1))
        counts = workspace.empty((num_experts,), ids.dtype).zero_()
        return counts.scatter_add_(0, ids, ones)
    ones = torch.ones_like(ids) if keep_TK is None else keep_TK.reshape(-1).to(ids.dtype)
    return ids.new_zeros(num_experts).scatter_add_(0, ids, ones)


def counts_for_aux(aux_scores_TE: torch.Tensor, routed_ids_TK: torch.Tensor, mode: str
                   ) -> torch.Tensor:
    """The ids whose counts n_i feed the aux losses ([T, K], no gradient).

    ``plain_topk`` (Megatron's choice, default): a separately recomputed plain top-k of the aux
    scores, ignoring group limits and the expert bias (Megatron #2767), so the loss balances the
    router's *preferences*. ``routed``: the experts the router actually chose (group limits and
    bias included, before capacity dropping), so the loss balances the real *load*.
    """
    if mode == "plain_topk":
        return select_topk(aux_scores_TE.detach(), routed_ids_TK.shape[1])[1]
    if mode == "routed":
        return routed_ids_TK
    raise ValueError(f"aux_loss_counts = {mode!r}: unknown. Fix: use one of {', '.join(AUX_LOSS_COUNTS)}")


def switch_aux_loss(aux_scores_TE: torch.Tensor, counts_E: torch.Tensor,
                    num_tokens: float | torch.Tensor, top_k: int) -> torch.Tensor:
    """E * sum_i (counts_i / (num_tokens*K)) * mean_t s[t, i]; counts carry no gradient.
    ``num_tokens`` may be a 0-d device count (the global aux loss's): never read on the host."""
    if aux_scores_TE.shape[0] == 0:
        return aux_scores_TE.new_zeros(())
    return switch_aux_loss_from_mean(aux_scores_TE.mean(dim=0), counts_E, num_tokens, top_k)


def switch_aux_loss_from_mean(mean_E: torch.Tensor, counts_E: torch.Tensor,
                              num_tokens: float | torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`switch_aux_loss` from P_i = mean_t s[t, i] already taken (the fused router's)."""
    f_E = counts_E.to(mean_E.dtype) / (num_tokens * top_k)
    return mean_E.shape[0] * torch.sum(f_E * mean_E)


def switch_aux_loss_from_stats(mean_BE: torch.Tensor, counts_BE: torch.Tensor, num_tokens: int,
                               top_k: int, coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(coeff * aux_loss, aux_loss detached) from the fused router's per-sequence means and
    counts (:class:`moeplug.routing.fused.AuxStats`): the Switch aux loss with f_i from the
    summed counts and P_i the mean of ``mean_BE``. CPU only; no allocation after warm-up
    (:func:`moeplug.routing.workspace_losses.aux_losses_from_stats` with the one term)."""
    total, values = aux_losses_from_stats(mean_BE, counts_BE, num_tokens, top_k,
                                          [("aux_loss", coeff)])
    return total, values["aux_loss"]


def sum_over_group(counts: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """(counts summed over ``group``, group size). Used when the ranks of ``group`` hold equal
    chunks of the same sequences (tensor/sequence parallel): f_i must count the whole batch."""
    if group is None or dist.get_world_size(group) == 1:
        return counts, 1
    # A copy to reduce into: on the CPU a workspace buffer (no allocation in a layer's arena).
    counts = (workspace.empty(tuple(counts.shape), counts.dtype).copy_(counts)
              if counts.device.type == "cpu" else counts.clone())
    blocking(dist.all_reduce, counts, group=group)  # the twin inside combined 1F1B's backward
    return counts, dist.get_world_size(group)


def seq_aux_loss(aux_scores_TE: torch.Tensor, ids_TK: torch.Tensor, num_sequences: int,
                 group=None) -> torch.Tensor:
    """Mean over sequences of each sequence's aux loss; tokens are b-major (t = b * S + s).
    ``group``: ranks holding other equal chunks of the same B sequences; counts are summed over
    it and this rank's P_i is a mean over its chunk (average the ranks' losses after)."""
    T, E = aux_scores_TE.shape
    B, K = num_sequences, ids_TK.shape[1]
    if T == 0:
        return aux_scores_TE.new_zeros(())
    if T % B:
        raise ValueError(f"seq_aux_loss: {T} tokens do not split into num_sequences = {B} equal "
                         f"sequences. Fix: pass the batch size of the [B, S, D] input as num_sequences")
    S = T // B
    seq_B1 = torch.arange(B, device=ids_TK.device).repeat_interleave(S * K).view(-1)
    flat = seq_B1 * E + ids_TK.reshape(-1)  # scatter_add: no host sync (see expert_counts)
    counts_BE = flat.new_zeros(B * E).scatter_add_(0, flat, torch.ones_like(flat)).view(B, E)
    return seq_aux_loss_from_stats(aux_scores_TE.view(B, S, E).mean(dim=1), counts_BE, S, K,
                                   group)


def seq_aux_loss_from_stats(mean_BE: torch.Tensor, counts_BE: torch.Tensor, tokens_per_seq: int,
                            top_k: int, group=None) -> torch.Tensor:
    """:func:`seq_aux_loss` from each sequence's mean aux scores and expert counts (the fused
    router's statistics); counts are summed over ``group`` here."""
    B, E = mean_BE.shape
    counts_BE, W = sum_over_group(counts_BE, group)
    f_BE = counts_BE.to(mean_BE.dtype) / (tokens_per_seq * W * top_k)
    return E * torch.sum(f_BE * mean_BE) / B


def global_aux_loss(aux_scores_TE: torch.Tensor, accumulated_counts_E: torch.Tensor,
                    accumulated_tokens: float | torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch loss with f_i from counts accumulated over the step's micro-batches so far
    (including this one): f_i = accumulated_counts_i / (K * accumulated_tokens)."""
    return switch_aux_loss(aux_scores_TE, accumulated_counts_E, accumulated_tokens, top_k)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    if logits_TE.shape[0] == 0:
        return logits_TE.new_zeros(())
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
