"""SFTTrainer, DPOTrainer and RewardTrainer in TRL's shape, over `grpolab sft`, `grpolab dpo` and `grpolab rm`."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError
from ..jobs.dpo import run_dpo
from ..jobs.rm import run_rm
from ..jobs.sft import run_sft
from .field_types import DPO_KINDS, REWARD_KINDS, SFT_KINDS
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
    KINDS = SFT_KINDS
    SETTINGS = staticmethod(sft_settings)


class DPOConfig(TRLConfig):
    """TRL's DPOConfig fields and grpolab's own keys in dotted form (docs/python-api.md)."""
    FIELDS = DPO
    UNSUPPORTED = DPO_UNSUPPORTED
    KINDS = DPO_KINDS
    SETTINGS = staticmethod(dpo_settings)


class RewardConfig(TRLConfig):
    """TRL's RewardConfig fields and grpolab's own keys in dotted form (docs/python-api.md)."""
    FIELDS = REWARD
    UNSUPPORTED = REWARD_UNSUPPORTED
    KINDS = REWARD_KINDS
    SETTINGS = staticmethod(reward_settings)


class _OfflineTrainer(Trainer):
    """An offline trainer's keys: its TRL fields (`to_keys`), the training rows as the task's rows (they hold no
    reference answers: no accuracy eval is run) and as `train_key`, the held-out rows as `eval_key`."""
    to_keys: Callable[..., dict[str, Any]]
    train_key: str
    eval_key: str | None = None

    def settings(self, train: str, evals: str | None, n_train: int, n_eval: int) -> dict[str, Any]:
        keys = type(self).to_keys(self.trl.fields, n_train, n_eval) if self.trl is not None else {}
        keys.update({"data.task": "files", "data.train_path": train, "data.train_size": 0, self.train_key: train})
        if evals:
            keys[self.eval_key] = evals
        return keys


class SFTTrainer(_OfflineTrainer):
    """Supervised fine-tuning: rows of `messages` (every assistant turn is learned), `prompt` + `completion` (the
    completion is learned) or `text`."""
    config_class = SFTConfig
    suffix = "SFT"
    job = staticmethod(run_sft)
    to_keys = staticmethod(sft_settings)
    train_key, eval_key = "sft.train_path", "sft.test_path"


class DPOTrainer(_OfflineTrainer):
    """Direct preference optimisation on rows of `prompt`, `chosen`, `rejected` (text or conversations). The
    reference is the starting model (with LoRA: the model with its adapters off)."""
    config_class = DPOConfig
    suffix = "DPO"
    job = staticmethod(run_dpo)
    to_keys = staticmethod(dpo_settings)
    train_key = "dpo.pairs"

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list | None = None) -> None:
        if ref_model is not None:
            raise ConfigError("DPOTrainer: ref_model is not supported by grpolab; the reference is the starting "
                              "model (with peft_config: the model with its adapters off)")
        if eval_dataset is not None:
            raise ConfigError("DPOTrainer: eval_dataset is not supported by grpolab's DPO yet")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks)


class RewardTrainer(_OfflineTrainer):
    """A reward model (a score head on the model) from preference rows (`prompt`, `chosen`, `rejected`; an
    optional `margin`)."""
    config_class = RewardConfig
    suffix = "Reward"
    job = staticmethod(run_rm)
    to_keys = staticmethod(reward_settings)
    train_key, eval_key = "rm.pairs", "rm.test_pairs"
