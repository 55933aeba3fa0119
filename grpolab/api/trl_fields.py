"""The TrainingArguments fields every TRL config shares, as grpolab keys: those grpolab implements
(`TRAINING`, `training_settings`) and those it does not (`TRAINING_UNSUPPORTED`, each refused with one line unless
left at TRL's default). Plain data, no torch."""

from __future__ import annotations

import math
from typing import Any

from ..config.validate import need
from ..errors import ConfigError

# TRL's defaults (TRL 1.x configs over transformers 5's TrainingArguments) for the shared fields grpolab implements
TRAINING: dict[str, Any] = {
    "output_dir": "trainer_output",
    "seed": 42,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "warmup_ratio": 0.0,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_steps": -1,
    "num_train_epochs": 3.0,
    "logging_steps": 10,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": None,
    "eval_strategy": "no",
    "eval_steps": None,
    "report_to": "none",
    "bf16": None,
    "fp16": False,
    "use_cpu": False,
    "gradient_checkpointing": False,
    "optim": "adamw_torch",
    "trust_remote_code": False,
}

SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
REPORTERS = ("none", "tensorboard", "wandb")

# name: (TRL's default, a value the tests set, why grpolab refuses other values). Given at its default, a field
# is accepted; any other value is one ConfigError naming it.
TRAINING_UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    "model_init_kwargs": (None, {"torch_dtype": "bfloat16"}, "pass a loaded model, or bf16=True"),
    "disable_dropout": (False, True, "not implemented"),
    "adam_epsilon": (1e-8, 1e-6, "AdamW's epsilon is fixed at 1e-8"),
    "lr_scheduler_kwargs": (None, {"num_cycles": 2}, "the schedules take no arguments"),
    "data_seed": (None, 7, "the data order follows seed"),
    "push_to_hub": (False, True, "no model hub upload; save_model() writes a directory huggingface_hub can upload"),
    "hub_model_id": (None, "me/model", "no model hub upload (see push_to_hub)"),
    "deepspeed": (None, "ds.json", "grpolab shards with torch's FSDP2 (train.strategy=fsdp, under torchrun)"),
    "fsdp": ("", "full_shard", "grpolab shards with torch's FSDP2 (train.strategy=fsdp, under torchrun)"),
    "torch_compile": (False, True, "not implemented"),
    "label_smoothing_factor": (0.0, 0.1, "not implemented"),
    "dataloader_num_workers": (0, 4, "rows are read in the trainer's process"),
    "gradient_checkpointing_kwargs": (None, {"use_reentrant": False}, "grpolab checkpoints each block its own way"),
    "tf32": (None, True, "not implemented"),
    "eval_on_start": (False, True, "not implemented"),
    "logging_first_step": (False, True, "every step is in metrics.jsonl"),
    "per_device_eval_batch_size": (8, 16, "the eval's batch is a grpolab key (eval.batch_size)"),
    "remove_unused_columns": (False, True, "every column is kept"),
    "router_aux_loss_coef": (0.001, 0.01, "mixture-of-experts auxiliary losses are not implemented"),
    "pad_to_multiple_of": (None, 8, "not implemented"),
    "activation_offloading": (False, True, "not implemented"),
    "run_name": (None, "my-run", "not implemented; the wandb run takes its name from wandb"),
}


def check_fields(fields: dict[str, Any], owner: str, supported: dict[str, Any],
                 unsupported: dict[str, tuple[Any, Any, str]]) -> None:
    """ConfigError for a field grpolab does not implement, set to something other than TRL's default, or for
    a name neither TRL nor grpolab knows (dotted names are grpolab's own keys)."""
    for name, value in fields.items():
        if name in supported or "." in name:
            continue
        if name in unsupported:
            default, _, why = unsupported[name]
            if value != default:
                raise ConfigError(f"{owner}.{name}={value!r}: not supported by grpolab ({why})")
            continue
        raise ConfigError(f"{owner}: unknown field {name!r}; TRL's fields are listed in docs/python-api.md, and "
                          f"grpolab's own keys go in dotted form, e.g. **{{'train.threads': 1}}")


def total_steps(f: dict[str, Any], rows: int, batch: int, owner: str) -> int:
    """max_steps when > 0, else num_train_epochs passes over `rows` in batches of `batch` (rounded up)."""
    if f["max_steps"] and f["max_steps"] > 0:
        return int(f["max_steps"])
    need(rows > 0, f"{owner}: with a dataset given as a path, set max_steps (the epochs need the row count)")
    steps = math.ceil(float(f["num_train_epochs"]) * math.ceil(rows / batch))
    need(steps >= 1, f"{owner}: max_steps or num_train_epochs must give at least one step")
    return steps


def training_settings(f: dict[str, Any], owner: str, steps: int, eval_rows: int) -> dict[str, Any]:
    """train.*, log.* and model.* keys of the shared fields `f` (TRL's defaults filled in), for a run of `steps`."""
    need(f["lr_scheduler_type"] in SCHEDULES, f"{owner}.lr_scheduler_type={f['lr_scheduler_type']!r}: not supported "
         f"by grpolab (use one of {', '.join(SCHEDULES)})")
    need(f["optim"] in ("adamw_torch", "adamw_torch_fused"), f"{owner}.optim={f['optim']!r}: not supported by "
         f"grpolab (its optimizer is torch's AdamW: adamw_torch)")
    need(f["logging_steps"] >= 1, f"{owner}.logging_steps: give a number of steps (>= 1); ratios are not supported "
                                  f"by grpolab")
    need(f["save_strategy"] in ("steps", "no"), f"{owner}.save_strategy={f['save_strategy']!r}: not supported by "
         f"grpolab (steps or no; the last step is always saved)")
    need(f["eval_strategy"] in ("steps", "no"), f"{owner}.eval_strategy={f['eval_strategy']!r}: not supported by "
         f"grpolab (steps or no; with an eval_dataset the last step is always evaluated)")
    reporters = [f["report_to"]] if isinstance(f["report_to"], str) else list(f["report_to"] or ["none"])
    for r in reporters:
        need(r in REPORTERS, f"{owner}.report_to={r!r}: not supported by grpolab (use {', '.join(REPORTERS)})")
    need(not (f["bf16"] and f["fp16"]), f"{owner}: bf16 and fp16 are both set; choose one")
    out: dict[str, Any] = {
        "train.output_dir": str(f["output_dir"]),
        "train.seed": int(f["seed"]),
        "train.log_every": int(f["logging_steps"]),
        "train.save_every": int(f["save_steps"]) if f["save_strategy"] == "steps" else 0,
        "train.keep_checkpoints": int(f["save_total_limit"] or 0),
        "train.eval_every": int(f["eval_steps"] or f["logging_steps"]) if eval_rows and
        f["eval_strategy"] == "steps" else 0,
        "log.tensorboard": "tensorboard" in reporters,
        "model.gradient_checkpointing": bool(f["gradient_checkpointing"]),
        "model.trust_remote_code": bool(f["trust_remote_code"]),
    }
    if "wandb" in reporters:
        out["log.wandb_project"] = "huggingface"   # transformers' default project
    if f["bf16"] or f["fp16"]:
        out["model.dtype"] = "bfloat16" if f["bf16"] else "float16"
    if f["use_cpu"]:
        out["model.device"] = "cpu"
    return out


def optimizer_settings(f: dict[str, Any], section: str, steps: int) -> dict[str, Any]:
    """`section`'s AdamW and schedule keys (optim for GRPO, sft/dpo/rm for the offline trainers)."""
    # transformers 5 reads a warmup_steps below 1 as a ratio, as warmup_ratio was
    ratio = f["warmup_steps"] if 0 < f["warmup_steps"] < 1 else f["warmup_ratio"]
    warmup = math.ceil(float(ratio) * steps) if ratio else int(f["warmup_steps"])
    return {f"{section}.lr": float(f["learning_rate"]), f"{section}.weight_decay": float(f["weight_decay"]),
            f"{section}.beta1": float(f["adam_beta1"]), f"{section}.beta2": float(f["adam_beta2"]),
            f"{section}.max_grad_norm": float(f["max_grad_norm"]),
            f"{section}.lr_schedule": SCHEDULES[f["lr_scheduler_type"]], f"{section}.warmup_steps": int(warmup),
            f"{section}.micro_batch_size": int(f["per_device_train_batch_size"])}
