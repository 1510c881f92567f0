"""Typed configuration: dataclasses (schema.py) and YAML/override loading (loader.py)."""

from moe_train.config.loader import config_from_dict, load_config, parse_overrides
from moe_train.config.moe import MoEConfig, RouterConfig
from moe_train.config.gated import GatedConfig
from moe_train.config.qwen import QwenConfig
from moe_train.config.thor import ThorConfig
from moe_train.config.schema import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ExperimentConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "DataConfig", "EvalConfig", "ExperimentConfig", "GatedConfig",
    "LoggingConfig",
    "ModelConfig", "MoEConfig", "OptimConfig", "QwenConfig", "RouterConfig", "ThorConfig", "TrainConfig",
    "config_from_dict", "load_config",
    "parse_overrides",
]
