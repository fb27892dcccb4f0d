"""Step 3 of moeplug.parallelize: expert parallelism (EP) and expert tensor parallelism (ETP).

EP and ETP are decided when the MoE layers' plugins are made, not after: the dispatcher plugin
*is* the EP exchange (its factory takes the EP group and it says how many experts stay local),
and the experts backend is built with F / ETP (moeplug.parallel.expert_tp). So the builder asks
:func:`expert_layout` what to make them for; :func:`apply_ep` then gives the built MoE layers
the groups their routers count over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from moeplug.config import ModelConfig
from moeplug.interfaces import Dispatcher
from moeplug.moe import MoELayer
from moeplug.parallel.context_parallel import moe_token_group
from moeplug.parallel.expert_tp import etp_dispatcher, etp_experts_config


@dataclass(frozen=True)
class ExpertLayout:
    """What one rank's MoE plugins are made for. ``ep_group``: the dispatcher plugin's group
    (None: one process); ``groups``: the ParallelGroups (its ``etp`` group, if any)."""

    ep_group: Any = None
    groups: Any = None

    @property
    def etp_group(self) -> Any:
        return None if self.groups is None else self.groups.etp

    def dispatcher(self, dispatcher: Dispatcher) -> Dispatcher:
        """ETP: ``dispatcher`` all-gathering rows over ``groups.etp`` around the experts."""
        return etp_dispatcher(dispatcher, self.groups)

    def experts_config(self, model: ModelConfig) -> ModelConfig:
        """The ModelConfig the experts backend is built with (ffn_hidden_size / ETP)."""
        return etp_experts_config(model, self.groups)


def expert_layout(groups: Any, ep_group: Any = None) -> ExpertLayout:
    """``ep_group`` defaults to ``groups.ep``."""
    if groups is not None and ep_group is None:
        ep_group = groups.ep
    return ExpertLayout(ep_group, groups)


def apply_ep(model: nn.Module, groups: Any) -> None:
    """Each MoE layer's ``token_group`` (TP x CP: the ranks routing other chunks of the same
    sequences, over which routers sum aux-loss counts and the layer averages the aux loss) and
    ``batch_group`` (TP x DP x CP: the ranks training the step's other micro-batches)."""
    if groups is None:
        return
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.token_group = moe_token_group(groups)
            module.batch_group = groups.tp_dp_cp
