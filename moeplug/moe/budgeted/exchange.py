"""The budgeted dispatcher's stages 3 and 5: its rows to the ranks owning their experts and
back, over the EP group and, under expert tensor parallelism, the ETP group. Every split is
static (equal chunks of L*C rows), so nothing waits for the device to learn a size.

Legend: W EP ranks, P ETP ranks (the F-slices of the same experts), L local experts, C budget
rows per (source rank, expert), B = W*C rows per local expert (P*W*C under ETP), D hidden.

Two layouts, as the budgeted dispatcher lays its slots out:
  * packed (the CPU): W equal chunks of L*C rows to the ranks owning their experts, with each
    source's kept counts per local expert (a [W, L] exchange of static shape: the experts'
    grouped GEMM reads them, nothing waits on the host); under ETP the arrived chunks are then
    all-gathered (P*W chunks, each with its counts) and ``back`` first sums the P partial
    outputs and keeps this rank's chunks (a reduce-scatter), as Megatron's A2A(EP) -> AG(ETP)
    -> experts -> RS(ETP) -> A2A(EP) (moeplug.parallel.expert_tp). Split in two for the chunked
    overlap: the rows travel on the backend's threads between start and wait
    (comm.all_to_all_start, whose backward splits the same way); the counts and the ETP
    collectives stay blocking.
  * budget rows (Experts.budget_rows: every expert B rows): [W, L*C] chunks exchanged, then each
    expert's rows source-rank-major ([L, W*C]), all-gathered over ETP (ETP-rank-major); back:
    the P partial outputs summed (a reduce-scatter), the inverse exchange. Under a recipe with
    ``quantize_dispatch`` whose layer's dispatcher quantizes its rows, the rows cross in the
    recipe's row format (moeplug.quant.wire), as that dispatcher sends them.
At one rank every exchange is a view.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from moeplug.parallel import comm
from moeplug.quant.wire import quantized_exchange


class BudgetExchange:
    """The static exchanges of one layer over ``group`` (EP, None at one rank) and
    ``etp_group`` (None without ETP). Holds the groups and their sizes only: every call's
    tensors go in and out."""

    def __init__(self, ep_size: int, group: Any, etp_group: Any = None):
        self.ep_size, self.group = ep_size, group
        self.etp_group, self.etp_size = etp_group, comm.group_size(etp_group)

    @property
    def is_identity(self) -> bool:
        """One EP rank, no ETP: every exchange is a view."""
        return self.ep_size == 1 and self.etp_size == 1

    # ---- packed chunks ----------------------------------------------------------------------

    def packed(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the arrived chunks' rows, their [P*W, L] kept counts)."""
        if self.ep_size > 1:
            chunks = self._chunks(x_ECD, counts_WL)
            x_ECD = comm.all_to_all(x_ECD, chunks, chunks, self.group)
        return self._gathered(x_ECD, self._counts_exchanged(counts_WL))

    def packed_back(self, y_ECD: torch.Tensor) -> torch.Tensor:
        y_ECD = self._reduced(y_ECD)
        if self.ep_size == 1:
            return y_ECD
        chunks = [y_ECD.shape[0] // self.ep_size] * self.ep_size
        return comm.all_to_all(y_ECD, chunks, chunks, self.group)

    def packed_start(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor
                     ) -> Callable[[], tuple]:
        """:meth:`packed` begun: returns its ``wait() -> (x_ECD, counts_WL)``."""
        chunks = self._chunks(x_ECD, counts_WL)
        pending = comm.all_to_all_start(x_ECD, chunks, chunks, self.group)
        counts_WL = self._counts_exchanged(counts_WL)
        return lambda: self._gathered(pending.wait(), counts_WL)

    def packed_back_start(self, y_ECD: torch.Tensor) -> Callable[[], torch.Tensor]:
        """:meth:`packed_back` begun: returns its ``wait() -> y_ECD``."""
        y_ECD = self._reduced(y_ECD)
        chunks = [y_ECD.shape[0] // self.ep_size] * self.ep_size
        return comm.all_to_all_start(y_ECD, chunks, chunks, self.group).wait

    def _chunks(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor) -> list[int]:
        return [x_ECD.shape[0] // counts_WL.shape[0]] * self.ep_size

    def _counts_exchanged(self, counts_WL: torch.Tensor) -> torch.Tensor:
        """Each source's [1, L] kept counts to the rank owning those experts."""
        if self.ep_size == 1:
            return counts_WL
        ones = [1] * self.ep_size
        return comm.all_to_all(counts_WL, ones, ones, self.group)

    def _gathered(self, x_ECD: torch.Tensor, counts_WL: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The arrived chunks and counts of every ETP rank (P*W chunks); as they are without."""
        if self.etp_size == 1:
            return x_ECD, counts_WL
        P = self.etp_size
        return (comm.all_gather(x_ECD, self.etp_group, [x_ECD.shape[0]] * P),
                comm.all_gather(counts_WL, self.etp_group, [counts_WL.shape[0]] * P))

    def _reduced(self, y_ECD: torch.Tensor) -> torch.Tensor:
        """The P partial outputs summed, this rank's chunks kept; as it is without ETP."""
        return y_ECD if self.etp_size == 1 else comm.reduce_scatter(y_ECD, self.etp_group)

    # ---- budget rows ------------------------------------------------------------------------

    def rows(self, x_ECD: torch.Tensor, num_local: int, budget: int,
             recipe: Any = None) -> torch.Tensor:
        """[E*C, ...] on each rank -> [L, B, ...] on the experts' rank; with ``recipe`` the rows
        cross in its row format (at one rank too: every layout sees the same numerics),
        their grads in full."""
        L, C, W = num_local, budget, self.ep_size
        if recipe is None:
            x_LBD = self._to_experts(x_ECD, L, C)
        else:
            x_LBD = quantized_exchange(
                x_ECD, recipe, lambda t: self._to_experts(t, L, C).reshape(L * W * C, -1),
                lambda g: self._from_experts(g.view(L, W * C, -1), C)).view(L, W * C, -1)
        return self._etp_gather(x_LBD)

    def rows_back(self, y_LBD: torch.Tensor, budget: int) -> torch.Tensor:
        """The inverse of :meth:`rows`: [L, B, D] partial outputs -> [E*C, D] on the source."""
        return self._from_experts(self._etp_reduce(y_LBD), budget)

    def _to_experts(self, x_ECD: torch.Tensor, L: int, C: int) -> torch.Tensor:
        W = self.ep_size
        if W > 1:  # equal chunks of L*C rows: every split is known without asking the device
            x_ECD = comm.all_to_all(x_ECD, [L * C] * W, [L * C] * W, self.group)
        # arrival [W (source), L, C, ...] -> [L, W, C, ...]: each expert's rows,
        # source-rank-major
        return x_ECD.view(W, L, C, *x_ECD.shape[1:]).transpose(0, 1).reshape(
            L, W * C, *x_ECD.shape[1:])

    def _from_experts(self, y_LBD: torch.Tensor, C: int) -> torch.Tensor:
        W = self.ep_size
        L, _, D = y_LBD.shape
        y_ECD = y_LBD.view(L, W, C, D).transpose(0, 1).reshape(W * L * C, D)
        if W > 1:
            y_ECD = comm.all_to_all(y_ECD, [L * C] * W, [L * C] * W, self.group)
        return y_ECD

    def _etp_gather(self, x_LBD: torch.Tensor) -> torch.Tensor:
        """Every ETP rank's x_LBD, all-gathered -> [L, P*B, ...], each expert's rows
        ETP-rank-major. Backward sums the P ranks' partial grads (a reduce-scatter)."""
        P = self.etp_size
        if P == 1:
            return x_LBD
        L, B = x_LBD.shape[:2]
        rest = x_LBD.shape[2:]
        x_PLBD = comm.all_gather(x_LBD.reshape(L * B, *rest), self.etp_group,
                                 [L * B] * P).view(P, L, B, *rest)
        return x_PLBD.transpose(0, 1).reshape(L, P * B, *rest)

    def _etp_reduce(self, y_LBD: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_etp_gather`: [L, P*B, D] partial outputs -> their sum over
        the ETP group, this rank's B rows of each expert (a reduce-scatter)."""
        P = self.etp_size
        if P == 1:
            return y_LBD
        L, PB, D = y_LBD.shape
        y_PLBD = y_LBD.view(L, P, PB // P, D).transpose(0, 1).reshape(P * L * (PB // P), D)
        return comm.reduce_scatter(y_PLBD, self.etp_group).view(L, PB // P, D)
