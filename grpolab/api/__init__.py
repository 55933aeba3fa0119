"""grpolab from Python: TRL-shaped trainers and their configs over the same jobs as the command line."""

from .grpo import GRPOConfig, GRPOTrainer
from .offline import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from .trainer import TrainerState

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig",
           "SFTTrainer", "TrainerState"]
