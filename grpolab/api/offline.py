"""SFTTrainer, DPOTrainer and RewardTrainer in TRL's shape, over `grpolab sft`, `grpolab dpo` and `grpolab rm`."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..jobs.dpo import run_dpo
from ..jobs.rm import run_rm
from ..jobs.sft import run_sft
from .offline_fields import (
    DPO,
    DPO_UNSUPPORTED,
    REWARD,
    REWARD_UNSUPPORTED,
    SFT,
    SFT_UNSUPPORTED,
    dpo_settings,
    reward_settings,
    sft_settings,
)
from .trainer import Trainer, TRLConfig


class SFTConfig(TRLConfig):
    """TRL's SFTConfig fields and grpolab's own keys in dotted form (docs/python-api.md)."""
    FIELDS = SFT
    UNSUPPORTED = SFT_UNSUPPORTED


class DPOConfig(TRLConfig):
    """TRL's DPOConfig fields and grpolab's own keys in dotted form (docs/python-api.md)."""
    FIELDS = DPO
    UNSUPPORTED = DPO_UNSUPPORTED


class RewardConfig(TRLConfig):
    """TRL's RewardConfig fields and grpolab's own keys in dotted form (docs/python-api.md)."""
    FIELDS = REWARD
    UNSUPPORTED = REWARD_UNSUPPORTED


def _files(train: str) -> dict[str, Any]:
    # the task's rows are the training file's (they hold no reference answers: no accuracy eval is run)
    return {"data.task": "files", "data.train_path": train, "data.train_size": 0}


class SFTTrainer(Trainer):
    """Supervised fine-tuning: rows of `messages` (every assistant turn is learned), `prompt` + `completion` (the
    completion is learned) or `text`."""
    config_class = SFTConfig
    suffix = "SFT"
    job = staticmethod(run_sft)

    def settings(self, train: str, evals: str | None, n_train: int, n_eval: int) -> dict[str, Any]:
        keys = sft_settings(self.trl.fields, n_train, n_eval) if self.trl is not None else {}
        keys.update({**_files(train), "sft.train_path": train})
        if evals:
            keys["sft.test_path"] = evals
        return keys

    def _max_steps(self) -> int:
        return self.config.sft.steps


class DPOTrainer(Trainer):
    """Direct preference optimisation on rows of `prompt`, `chosen`, `rejected` (text or conversations). The
    reference is the starting model (with LoRA: the model with its adapters off)."""
    config_class = DPOConfig
    suffix = "DPO"
    job = staticmethod(run_dpo)

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list | None = None) -> None:
        if ref_model is not None:
            raise ConfigError("DPOTrainer: ref_model is not supported by grpolab; the reference is the starting "
                              "model (with peft_config: the model with its adapters off)")
        if eval_dataset is not None:
            raise ConfigError("DPOTrainer: eval_dataset is not supported by grpolab's DPO yet")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks)

    def settings(self, train: str, evals: str | None, n_train: int, n_eval: int) -> dict[str, Any]:
        keys = dpo_settings(self.trl.fields, n_train, n_eval) if self.trl is not None else {}
        keys.update({**_files(train), "dpo.pairs": train})
        return keys

    def _max_steps(self) -> int:
        return self.config.dpo.steps


class RewardTrainer(Trainer):
    """A reward model (a score head on the model) from preference rows (`prompt`, `chosen`, `rejected`; an
    optional `margin`)."""
    config_class = RewardConfig
    suffix = "Reward"
    job = staticmethod(run_rm)

    def settings(self, train: str, evals: str | None, n_train: int, n_eval: int) -> dict[str, Any]:
        keys = reward_settings(self.trl.fields, n_train, n_eval) if self.trl is not None else {}
        keys.update({**_files(train), "rm.pairs": train})
        if evals:
            keys["rm.test_pairs"] = evals
        elif self.trl is not None:
            keys["rm.eval_size"] = 0   # TRL holds nothing out of the training rows
        return keys

    def _max_steps(self) -> int:
        return self.config.rm.steps
