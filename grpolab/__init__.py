"""grpolab: GRPO-family RL post-training for language models, readable and fast.

`from grpolab import GRPOTrainer, GRPOConfig` gives the Python API (grpolab/api/, docs/python-api.md). Its names
are looked up on first use (PEP 562), so that `import grpolab` (and the `grpolab` command) loads no torch: the
settings below must be in place before torch's math libraries start.
"""

import importlib

from .determinism import set_reproducible_env

# Before torch's math libraries make their first call: their reproducibility settings are read then.
set_reproducible_env()

__version__ = "0.1.0"

API = ("DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig",
       "SFTTrainer", "TrainerState")
__all__ = [*API, "__version__"]


def __getattr__(name: str):
    if name in API:
        return getattr(importlib.import_module(".api", __name__), name)
    raise AttributeError(f"module 'grpolab' has no attribute {name!r}")
