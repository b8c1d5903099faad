"""The run's configuration: the schema (`schema.py`: typed, frozen sections, unknown keys
forbidden; its compression and export sections in `compression.py`) and its loading (`loading.py`: YAML, `--set` overrides, one line per problem).
`tftrain.config` is where users import both from.

May import: `tftrain.core` and the TensorFlow-free config modules of `tftrain.optim`
(`configs`, `schedules`). No TensorFlow: `--schema` and config errors come without it.
"""
from tftrain.config.loading import (apply_overrides, dump_config, json_schema, load_config,
                                    parse_yaml, read_yaml, validate)
from tftrain.config.compression import (CompressionConfig, DistillationConfig, ExportConfig,
                                        PruningConfig, QuantizationConfig, StudentConfig)
from tftrain.config.schema import (CheckpointConfig, Config, DataConfig, DistributeConfig,
                                   EarlyStoppingConfig, EMAConfig, FreezeConfig, MlflowConfig,
                                   ModelConfig, PlacementConfig, PrecisionConfig, RunConfig,
                                   ServiceConfig, TrackingConfig, TrainConfig)
from tftrain.core.config_types import ConfigError, Duration, Strict
from tftrain.optim.configs import OptimizerConfig
from tftrain.optim.schedules import ScheduleConfig

__all__ = ["CheckpointConfig", "CompressionConfig", "Config", "ConfigError", "DataConfig",
           "DistillationConfig", "DistributeConfig", "Duration", "EarlyStoppingConfig",
           "EMAConfig", "ExportConfig", "FreezeConfig", "MlflowConfig", "ModelConfig",
           "OptimizerConfig", "PlacementConfig", "PrecisionConfig", "PruningConfig",
           "QuantizationConfig", "RunConfig", "ScheduleConfig", "ServiceConfig", "Strict",
           "StudentConfig", "TrackingConfig", "TrainConfig", "apply_overrides", "dump_config",
           "json_schema", "load_config", "parse_yaml", "read_yaml", "validate"]
