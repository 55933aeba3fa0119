"""grpolab: GRPO-family RL post-training for language models, readable and fast."""

from .determinism import set_reproducible_env

# Before torch's math libraries make their first call: their reproducibility settings are read then.
set_reproducible_env()

__version__ = "0.1.0"
