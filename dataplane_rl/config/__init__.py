"""The run config: one pydantic model per component (models.py), loaded from YAML with dotted overrides (load.py)."""

from dataplane_rl.config.load import (ALL_KEYS, DEFAULT_CONFIG, apply_overrides, config_reference, default_config_path,
                                      dump_config, load_config, parse_override, validate_tree)
from dataplane_rl.config.models import (AsyncGRPOConfig, CheckpointingConfig, ClusterConfig, Config, DataPlaneConfig,
                                        DynamicBatchingConfig, GenerationConfig, GRPOConfig, LoggerConfig,
                                        MooncakeConfig, PolicyConfig, SchedulerConfig, SequencePackingConfig,
                                        ShmConfig, TaskConfig, VLLMConfig, bound_schema, vllm_logprobs_mode)

__all__ = ["ALL_KEYS", "DEFAULT_CONFIG", "apply_overrides", "config_reference", "default_config_path", "dump_config",
           "load_config", "parse_override", "validate_tree", "AsyncGRPOConfig", "CheckpointingConfig", "ClusterConfig",
           "Config", "DataPlaneConfig", "DynamicBatchingConfig", "GenerationConfig", "GRPOConfig", "LoggerConfig",
           "MooncakeConfig", "PolicyConfig", "SchedulerConfig", "SequencePackingConfig", "ShmConfig", "TaskConfig",
           "VLLMConfig", "bound_schema", "vllm_logprobs_mode"]
