"""TRL's SFTConfig, DPOConfig and RewardConfig fields as grpolab keys (the sft, dpo and rm sections): those
grpolab implements, with TRL's defaults, and those it refuses unless left at TRL's default. Plain data, no torch."""

from __future__ import annotations

from typing import Any

from ..config.names import DPO_LOSSES
from ..config.validate import need
from .trl_fields import TRAINING, TRAINING_UNSUPPORTED, optimizer_settings, total_steps, training_settings

NOT_CUT = "rows are not cut to a length"

SFT: dict[str, Any] = {
    **TRAINING,
    "learning_rate": 2e-5,
    "max_length": 1024,
    "packing": False,
    "completion_only_loss": None,
    "assistant_only_loss": False,
    "loss_type": None,
}
SFT_UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    **TRAINING_UNSUPPORTED,
    "dataset_text_field": ("text", "content", "a text row's column is `text`"),
    "dataset_kwargs": (None, {"skip_prepare_dataset": True}, "the rows are always prepared"),
    "dataset_num_proc": (None, 4, "rows are read in the trainer's process"),
    "eos_token": (None, "<|end|>", "the tokenizer's end-of-turn token is used"),
    "chat_template_path": (None, "template.jinja", "the model's own chat template is used"),
    "truncation_mode": ("keep_start", "keep_end", "a long row keeps its start (sft.on_long=truncate)"),
    "packing_strategy": ("bfd", "wrapped", "sft.packing packs whole rows"),
    "padding_free": (False, True, "not implemented; sft.packing keeps rows apart with a block mask"),
    "eval_packing": (None, True, "not implemented"),
    "shuffle_dataset": (False, True, "rows are always drawn in a seeded shuffled order"),
    "pad_token": (None, "<pad>", "set the tokenizer's pad token"),
}

DPO: dict[str, Any] = {
    **TRAINING,
    "learning_rate": 1e-6,
    "beta": 0.1,
    "loss_type": ["sigmoid"],
    "label_smoothing": 0.0,
}
DPO_UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    **TRAINING_UNSUPPORTED,
    "disable_dropout": (True, False, "the model's dropout is as its config sets it"),
    "max_length": (1024, 512, NOT_CUT),
    "truncation_mode": ("keep_start", "keep_end", NOT_CUT),
    "dataset_num_proc": (None, 4, "rows are read in the trainer's process"),
    "padding_free": (False, True, "not implemented"),
    "precompute_ref_log_probs": (False, True, "not implemented"),
    "precompute_ref_batch_size": (None, 8, "not implemented"),
    "loss_weights": (None, [0.8, 0.2], "one loss_type at a time"),
    "ld_alpha": (None, 0.5, "not implemented"),
    "f_divergence_type": ("reverse_kl", "js_divergence", "not implemented"),
    "f_alpha_divergence_coef": (0.5, 0.3, "not implemented"),
    "use_weighting": (False, True, "not implemented"),
    "discopop_tau": (0.05, 0.1, "loss_type discopop is not implemented"),
    "sync_ref_model": (False, True, "not implemented for DPO"),
    "ref_model_mixup_alpha": (0.6, 0.9, "not implemented for DPO"),
    "ref_model_sync_steps": (512, 64, "not implemented for DPO"),
    "pad_token": (None, "<pad>", "set the tokenizer's pad token"),
}

REWARD: dict[str, Any] = {
    **TRAINING,
    "learning_rate": 1e-4,
    "center_rewards_coefficient": None,
}
REWARD_UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    **TRAINING_UNSUPPORTED,
    "disable_dropout": (True, False, "the model's dropout is as its config sets it"),
    "max_length": (1024, 512, NOT_CUT),
    "dataset_num_proc": (None, 4, "rows are read in the trainer's process"),
    "eos_token": (None, "<|end|>", "the tokenizer's end-of-turn token is used"),
    "chat_template_path": (None, "template.jinja", "the model's own chat template is used"),
    "pad_token": (None, "<pad>", "set the tokenizer's pad token"),
}


def _stage(f: dict[str, Any], section: str, owner: str, rows: int, eval_rows: int) -> dict[str, Any]:
    """The keys every offline trainer shares: steps and batch (counted in rows), optimizer, run."""
    bs, ga = f["per_device_train_batch_size"], f["gradient_accumulation_steps"]
    need(bs >= 1 and ga >= 1, f"{owner}: per_device_train_batch_size and gradient_accumulation_steps must be >= 1")
    steps = total_steps(f, rows, bs * ga, owner)
    out = training_settings(f, owner, steps, eval_rows)
    out.update(optimizer_settings(f, section, steps))
    out.update({f"{section}.steps": steps, f"{section}.epochs": 0, f"{section}.batch_size": bs * ga})
    return out


def _fields(defaults: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in fields.items() if k in defaults}}


def sft_settings(fields: dict[str, Any], rows: int, eval_rows: int) -> dict[str, Any]:
    f = _fields(SFT, fields)
    need(f["completion_only_loss"] in (None, True), "SFTConfig.completion_only_loss=False: not supported by grpolab "
         "(the prompt of a prompt/completion row carries no loss)")
    need(f["loss_type"] in (None, "nll", "chunked_nll"), f"SFTConfig.loss_type={f['loss_type']!r}: not supported by "
         f"grpolab (nll)")
    out = _stage(f, "sft", "SFTConfig", rows, eval_rows)
    out.update({"sft.max_length": int(f["max_length"] or 0), "sft.packing": bool(f["packing"])})
    return out


def dpo_settings(fields: dict[str, Any], rows: int, eval_rows: int) -> dict[str, Any]:
    f = _fields(DPO, fields)
    loss = f["loss_type"]
    losses = [loss] if isinstance(loss, str) else list(loss)
    need(len(losses) == 1 and losses[0] in DPO_LOSSES, f"DPOConfig.loss_type={loss!r}: not supported by grpolab "
         f"(one of {', '.join(DPO_LOSSES)})")
    out = _stage(f, "dpo", "DPOConfig", rows, eval_rows)
    out.update({"dpo.beta": float(f["beta"]), "dpo.loss_type": losses[0],
                "dpo.label_smoothing": float(f["label_smoothing"])})
    return out


def reward_settings(fields: dict[str, Any], rows: int, eval_rows: int) -> dict[str, Any]:
    f = _fields(REWARD, fields)
    out = _stage(f, "rm", "RewardConfig", rows, eval_rows)
    out["rm.center_rewards_coefficient"] = float(f["center_rewards_coefficient"] or 0.0)
    out["rm.eval_size"] = 0   # TRL holds nothing out of the training rows (an eval_dataset is rm.test_pairs)
    return out
