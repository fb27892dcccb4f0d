"""runtime.sync_free's budgeted dispatcher: static shapes from a token budget, no host sync
(dispatcher: the pair; slots: stages 1, 2, 6 as pure functions; arena: their eager CPU form;
exchange: stages 3 and 5)."""

from __future__ import annotations

from typing import Any

from moeplug.interfaces import Dispatcher, Experts
from moeplug.moe.budgeted.dispatcher import BudgetedDispatcher
from moeplug.moe.budgeted.slots import budget_rows


def budgeted_dispatcher(dispatcher: Dispatcher, experts: Experts, state: Any, *,
                        group: Any = None, etp_group: Any = None,
                        weighted_input: bool = False) -> BudgetedDispatcher | None:
    """The budgeted pair wrapping the layer's ``dispatcher`` when the runtime runs sync-free
    (``state``: its SyncFreeState; None: off, and so is this), chosen at build time as ETP's
    wrapper is; ``group`` / ``etp_group``: the EP and ETP groups the experts are split over."""
    if state is None:
        return None
    missing = type(experts).missing_capability(sync_free=True, capture=bool(state.capture))
    if missing is not None:
        raise ValueError(f"MoELayer: {missing}")
    return BudgetedDispatcher(dispatcher, state, group=group, etp_group=etp_group,
                              packed=experts.packed_rows, weighted_input=weighted_input)


__all__ = ["BudgetedDispatcher", "budgeted_dispatcher", "budget_rows"]
