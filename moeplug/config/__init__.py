"""Validated configuration: one frozen-at-construction dataclass per section, one module each.

Every check runs in ``__post_init__`` and raises :class:`ConfigError` whose message names the
class, the field, the bad value and the fix, so a bad config fails before any model, data or
process group exists. ``RootConfig`` cross-checks fields that span sections; which modes
combine is :mod:`moeplug.config.modes`'s.

Loading: :func:`load_config` merges, in order, the dataclass defaults, a YAML file, and dotted
overrides (``model.moe.num_experts=8``); unknown keys are errors (with the closest valid name).
A loaded config reports every problem at once (``ConfigError.errors``): each section's checks
keep going after a failure, and the cross-section checks still run over such sections.

    _checks     ConfigError, Problems and the shared field rules
    model       model: (MoEConfig, MLAConfig, RecomputeConfig, ModelConfig)
    plugins     plugins:      data   data:      train  train:
    parallel    parallel: and validate_model     runtime  runtime:
    pipeline_layout  Megatron's pipeline layouts: what every virtual stage holds
    root        RootConfig (cross-section checks), model_differences
    modes       which modes combine: a module of rules per mode, check_modes runs them
    loader      config_from_dict, load_config, apply_overrides
"""

from moeplug.config._checks import SEED_LIMIT, ConfigError, Problems
from moeplug.config.data import DataConfig
from moeplug.config.loader import (apply_overrides, config_from_dict, load_config,
                                   load_config_dict, merge_config_dicts)
from moeplug.config.model import (ACTIVATIONS, ATTENTION_TYPES, GATED_ACTIVATIONS,
                                  OFFLOAD_MODULES, RECOMPUTE_MODULES, MLAConfig, ModelConfig,
                                  MoEConfig, RecomputeConfig, expert_op_levers)
from moeplug.config.parallel import DIM_NAMES, ParallelConfig, validate_model
from moeplug.config.plugins import PluginsConfig
from moeplug.config.root import (EXECUTION_ONLY, MODEL_DEFINING, TRAINING_ONLY, RootConfig,
                                 model_differences)
from moeplug.config.runtime import SYNC_FREE_PRECISIONS, RuntimeSection
from moeplug.config.train import TrainConfig

__all__ = [
    "ACTIVATIONS", "ATTENTION_TYPES", "DIM_NAMES", "EXECUTION_ONLY", "GATED_ACTIVATIONS",
    "MODEL_DEFINING", "OFFLOAD_MODULES", "RECOMPUTE_MODULES", "SEED_LIMIT",
    "SYNC_FREE_PRECISIONS", "TRAINING_ONLY", "ConfigError", "DataConfig", "MLAConfig", "ModelConfig",
    "MoEConfig", "ParallelConfig", "PluginsConfig", "Problems", "RecomputeConfig", "RootConfig",
    "RuntimeSection", "TrainConfig", "apply_overrides", "config_from_dict", "expert_op_levers",
    "load_config", "load_config_dict", "merge_config_dicts", "model_differences", "validate_model",
]
