"""Low-precision formats, emulated exactly with torch's float8 dtypes (and an E2M1 grid for FP4):
``fp8`` (tensorwise, delayed, blockwise), ``mx`` (MXFP8, OCP MX v1.0), ``nvfp4``; ``recipes``
turns them into per-GEMM quantization rules and ``linear`` applies them to a model's GEMMs."""

from moeplug.quant import fp8, mx, nvfp4
from moeplug.quant.linear import (active_recipe, block_scope, quant_expert_mlp, quant_linear,
                                  recipe_plan, recipe_scope, row_alignment)
from moeplug.quant.recipes import MXFP8, NVFP4, Blockwise, Delayed, Recipe, Tensorwise

__all__ = ["fp8", "mx", "nvfp4", "active_recipe", "block_scope", "recipe_plan",
           "quant_expert_mlp", "quant_linear", "recipe_scope",
           "row_alignment", "Recipe",
           "Tensorwise", "Delayed", "Blockwise", "MXFP8", "NVFP4"]
