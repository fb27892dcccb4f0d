"""The MoE wing: the layer (route -> dispatch -> experts -> combine -> shared -> sum), its
schedules (chunked overlap, capture), the shared experts, and runtime.sync_free's budgeted
dispatcher with its exchange and its arena form."""

from moeplug.moe.layer import MoELayer, MoEOutput

__all__ = ["MoELayer", "MoEOutput"]
