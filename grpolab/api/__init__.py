"""grpolab from Python: TRL-shaped trainers and their configs over the same jobs as the command line."""

from .grpo import GRPOConfig, GRPOTrainer, TrainerState

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainerState"]
