"""Model pieces, built for one process: norm, rope, attention, dense MLP, transformer, stages,
recompute and offload marks. moeplug.build makes a model of them; moeplug.parallelize applies the
parallel layout to it from outside."""

from moeplug.moe import MoELayer
from moeplug.modules.transformer import ModelOutput, MoETransformer

__all__ = ["MoELayer", "MoETransformer", "ModelOutput"]
