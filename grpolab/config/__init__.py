"""Run configuration: schema.py (the sections, every key with its type, default and help),
load.py (YAML and overrides -> Config), validate.py (the checks of every value).

Only the schema is re-exported here: validate.py imports the reward and algorithm registries, and
the rewards import RewardConfig from here, so re-exporting load or validate would make importing
this package import the rewards, which import this package. Import load_config, parse_override,
read_yaml, check_output_dir from grpolab.config.load and validate from grpolab.config.validate.
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
