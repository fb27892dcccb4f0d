"""Model pieces: norm, rope, attention, dense MLP, MoE layer, transformer, builder."""

from moeplug.modules.build import build_model
from moeplug.moe import MoELayer
from moeplug.modules.transformer import ModelOutput, MoETransformer

__all__ = ["build_model", "MoELayer", "MoETransformer", "ModelOutput"]
