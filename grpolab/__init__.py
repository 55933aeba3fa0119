"""grpolab: GRPO-family RL post-training for language models, readable and fast."""

__version__ = "0.1.0"
