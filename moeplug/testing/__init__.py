"""Public contract tests for moeplug plugins.

Every built-in passes them, and a third-party author runs the same checks on theirs::

    from moeplug.plugin_host import PluginHost
    from moeplug.testing import check_router

    def test_my_router_meets_the_contract():
        check_router(PluginHost.load(), "my_router")

Each ``check_*`` takes either a loaded :class:`~moeplug.plugin_host.PluginHost` plus a component
name, or a bare factory (called as documented at the bottom of :mod:`moeplug.interfaces`), and
raises :class:`ContractError` (an AssertionError) naming the component and the broken rule.
"""

from moeplug.testing._common import ContractError, tiny_model_config
from moeplug.testing.capabilities import check_declared
from moeplug.testing.dispatcher import check_dispatcher
from moeplug.testing.dispatcher_parallel import check_dispatcher_ep
from moeplug.testing.experts import check_experts
from moeplug.testing.precision import check_precision
from moeplug.testing.reader import check_reader
from moeplug.testing.reference import reference_expert_mlp
from moeplug.testing.router import check_router

CHECKS = {"router": check_router, "dispatcher": check_dispatcher, "experts": check_experts,
          "precision": check_precision, "dataset": check_reader}


def check_component(host, kind: str, name: str, **kwargs) -> None:
    """Run the contract check for ``kind`` on component ``name`` of ``host``."""
    CHECKS[kind](host, name, **kwargs)


__all__ = ["ContractError", "tiny_model_config", "check_declared", "check_router", "check_dispatcher",
           "check_dispatcher_ep", "check_experts",
           "check_precision", "check_reader", "check_component", "reference_expert_mlp", "CHECKS"]
