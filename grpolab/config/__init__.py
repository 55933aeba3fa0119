"""Run configuration: schema.py (the sections, every key with its type, default and help),
load.py (YAML and overrides -> Config), validate.py (the checks of every value), names.py (each
registry's one declaration: the names validate checks against, and where each lives), presets.py (the
algorithm presets), reward_spec.py (a custom reward spec's call). Plain data at the bottom of the layers:
nothing here imports torch.

Only the schema is re-exported here. Import load_config, parse_override, read_yaml, check_output_dir
from grpolab.config.load and validate from grpolab.config.validate.
"""

from .schema import (
                     MIN_TEMPERATURE,
                     AlgorithmConfig,
                     CodeExecConfig,
                     Config,
                     CriticConfig,
                     DataConfig,
                     DistillConfig,
                     DPOConfig,
                     EvalConfig,
                     JudgeConfig,
                     LogConfig,
                     ModelConfig,
                     OptimConfig,
                     RewardConfig,
                     RMConfig,
                     RolloutConfig,
                     SampleConfig,
                     SFTConfig,
                     TrainConfig,
)

__all__ = ["MIN_TEMPERATURE", "AlgorithmConfig", "CodeExecConfig", "Config", "CriticConfig", "DataConfig",
           "DistillConfig", "DPOConfig", "EvalConfig", "JudgeConfig", "LogConfig", "ModelConfig", "OptimConfig",
           "RewardConfig", "RMConfig", "RolloutConfig", "SampleConfig", "SFTConfig", "TrainConfig"]
