"""TRL's GRPOConfig fields as grpolab config keys: the ones grpolab implements (`grpo_settings`), and the ones it
does not (`UNSUPPORTED`, each refused with one line unless left at TRL's default). Plain data, no torch."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

# TRL's defaults (trl 0.2x GRPOConfig and transformers' TrainingArguments) for the fields grpolab implements
SUPPORTED: dict[str, Any] = {
    "output_dir": "trainer_output",
    "seed": 42,
    "learning_rate": 1e-6,
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
    "num_generations": 8,
    "max_prompt_length": 512,
    "max_completion_length": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "num_iterations": 1,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "importance_sampling_level": "token",
    "mask_truncated_completions": False,
    "reward_weights": None,
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "log_completions": False,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "entropy_coef": 0.0,
    "trust_remote_code": False,
}

# TRL's vllm_importance_sampling_mode -> grpolab's (algorithm.rollout_correction, rollout_correction_level)
IS_MODES = {"token_truncate": ("tis", "token"), "token_mask": ("mis", "token"),
            "sequence_truncate": ("tis", "sequence"), "sequence_mask": ("mis", "sequence")}

# TRL's loss_type -> grpolab's algorithm.loss_agg_mode (the same normalisation of the per-token losses)
LOSS_TYPES = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
              "dr_grpo": "seq-mean-token-sum-norm"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
REPORTERS = ("none", "tensorboard", "wandb")


COLOCATE = "vLLM runs in the trainer's process (vllm_mode='colocate')"

# name: (TRL's default, a value the tests set, why grpolab refuses other values). Given at its default, a field
# is accepted (it asks for what grpolab does anyway); any other value is one ConfigError naming it.
UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    "delta": (None, 2.0, "two-sided clipping is not implemented; algorithm.clip_ratio_c is the dual clip"),
    "top_entropy_quantile": (1.0, 0.2, "the loss on the highest-entropy tokens only is not implemented"),
    "min_p": (None, 0.05, "min-p sampling is not implemented; rollout.top_k and rollout.top_p are"),
    "generation_kwargs": (None, {"do_sample": True}, "give the sampling settings as fields (temperature, top_p, "
                                                     "top_k, repetition_penalty)"),
    "generation_batch_size": (None, 64, "grpolab samples one batch per optimizer step (per_device_train_batch_size x "
                                        "gradient_accumulation_steps completions)"),
    "steps_per_generation": (None, 4, "grpolab samples one batch per optimizer step; several passes over it are "
                                      "num_iterations"),
    "shuffle_dataset": (True, False, "prompts are always drawn in a seeded shuffled order"),
    "disable_dropout": (False, True, "not implemented"),
    "model_init_kwargs": (None, {"torch_dtype": "bfloat16"}, "pass a loaded model, or bf16=True"),
    "use_liger_loss": (False, True, "grpolab's own chunked log-probs keep the logits small (optim.logprob_chunk)"),
    "use_transformers_paged": (False, True, "grpolab samples with its own engine"),
    "cache_implementation": (None, "static", "grpolab samples with its own engine"),
    "vllm_server_base_url": (None, "http://localhost:8000", COLOCATE),
    "vllm_server_host": ("0.0.0.0", "10.0.0.1", COLOCATE),
    "vllm_server_port": (8000, 8001, COLOCATE),
    "vllm_tensor_parallel_size": (1, 2, "one vLLM engine per trainer process"),
    "vllm_enable_sleep_mode": (False, True, "not implemented"),
    "vllm_guided_decoding_regex": (None, r"\d+", "guided decoding in training rollouts is not implemented"),
    "num_completions_to_print": (None, 2, "the completions go to samples.jsonl (log.samples_per_step)"),
    "wandb_log_unique_prompts": (False, True, "not implemented"),
    "adam_epsilon": (1e-8, 1e-6, "AdamW's epsilon is fixed at 1e-8"),
    "lr_scheduler_kwargs": (None, {"num_cycles": 2}, "the schedules take no arguments"),
    "warmup_ratio_per_epoch": (None, 0.1, "not a grpolab setting"),
    "data_seed": (None, 7, "the data order follows seed"),
    "push_to_hub": (False, True, "no model hub is reachable from grpolab's trainers; save_model() writes a "
                                 "directory that push_to_hub of transformers/peft can upload"),
    "hub_model_id": (None, "me/model", "no model hub upload (see push_to_hub)"),
    "deepspeed": (None, "ds.json", "grpolab shards with torch's FSDP2 (train.strategy=fsdp, under torchrun)"),
    "fsdp": ("", "full_shard", "grpolab shards with torch's FSDP2 (train.strategy=fsdp, under torchrun)"),
    "torch_compile": (False, True, "not implemented"),
    "max_grad_value": (None, 1.0, "not implemented"),
    "label_smoothing_factor": (0.0, 0.1, "not a GRPO setting"),
    "dataloader_num_workers": (0, 4, "rows are read in the trainer's process"),
    "gradient_checkpointing_kwargs": (None, {"use_reentrant": False}, "grpolab checkpoints each block its own way"),
    "tf32": (None, True, "not implemented"),
    "eval_on_start": (False, True, "not implemented"),
    "logging_first_step": (False, True, "every step is in metrics.jsonl"),
    "per_device_eval_batch_size": (8, 16, "eval.batch_size sets the completions decoded together"),
    "num_generations_eval": (None, 4, "the eval samples eval.k completions per problem"),
    "remove_unused_columns": (False, True, "every column reaches the reward functions"),
    "cast_lm_head_to_fp32": (False, True, "not implemented"),
    "router_aux_loss_coef": (0.001, 0.01, "mixture-of-experts auxiliary losses are not implemented"),
    "pad_to_multiple_of": (None, 8, "not implemented"),
    "chat_template_kwargs": (None, {"enable_thinking": False}, "not implemented"),
    "vllm_model_impl": ("vllm", "transformers", "not implemented"),
    "vllm_structured_outputs_regex": (None, r"\d+", "structured outputs in training rollouts are not implemented"),
    "vllm_server_timeout": (240.0, 60.0, COLOCATE),
    "vllm_group_port": (51216, 51217, COLOCATE),
    "vllm_importance_sampling_clip_min": (None, 0.5, "the correction has an upper bound only"),
    "vllm_importance_sampling_cap": (None, 2.0, "deprecated in TRL; use vllm_importance_sampling_clip_max"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum", "GDPO's aggregation is not "
                                                                                "implemented"),
    "sapo_temperature_neg": (1.05, 1.2, "loss_type sapo is not implemented"),
    "sapo_temperature_pos": (1.0, 1.2, "loss_type sapo is not implemented"),
    "vespo_k_pos": (2.0, 3.0, "loss_type vespo is not implemented"),
    "vespo_lambda_pos": (3.0, 2.0, "loss_type vespo is not implemented"),
    "vespo_k_neg": (3.0, 2.0, "loss_type vespo is not implemented"),
    "vespo_lambda_neg": (2.0, 3.0, "loss_type vespo is not implemented"),
    "use_adaptive_entropy": (False, True, "adaptive entropy control is not implemented; entropy_coef is fixed"),
    "entropy_coef_min": (0.0, 0.1, "adaptive entropy control is not implemented"),
    "entropy_coef_max": (1.0, 0.5, "adaptive entropy control is not implemented"),
    "entropy_coef_delta": (0.005, 0.01, "adaptive entropy control is not implemented"),
    "entropy_target": (0.2, 0.3, "adaptive entropy control is not implemented"),
    "max_tool_calling_iterations": (None, 3, "tools are set with rollout.tools and rollout.max_tool_calls"),
    "off_policy_mask_threshold": (None, 0.5, "not implemented"),
    "use_bias_correction_kl": (False, True, "not implemented"),
    "log_multimodal": (True, False, "grpolab trains text models"),
    "log_unique_prompts": (False, True, "not implemented"),
    "log_completions_hub_repo": (None, "me/completions", "no model hub upload"),
    "use_transformers_continuous_batching": (False, True, "grpolab samples with its own engine"),
    "transformers_continuous_batching_config": (None, {"block_size": 32}, "grpolab samples with its own engine"),
    "run_name": (None, "my-run", "not implemented; the wandb run takes its name from wandb"),
}


def check_fields(fields: dict[str, Any], owner: str) -> None:
    """ConfigError for a field grpolab does not implement, set to something other than TRL's default, or for
    a name neither TRL nor grpolab knows."""
    for name, value in fields.items():
        if name in SUPPORTED or "." in name:
            continue
        if name in UNSUPPORTED:
            default, _, why = UNSUPPORTED[name]
            if value != default:
                raise ConfigError(f"{owner}.{name}={value!r}: not supported by grpolab ({why})")
            continue
        raise ConfigError(f"{owner}: unknown field {name!r}; TRL's fields are listed in docs/python-api.md, and "
                          f"grpolab's own keys go in dotted form, e.g. **{{'rollout.top_k': 20}}")


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def grpo_settings(fields: dict[str, Any], train_rows: int, eval_rows: int) -> dict[str, Any]:
    """grpolab's dotted keys for TRL GRPOConfig `fields` (TRL's defaults where not given) and a train set of
    `train_rows` prompts; `eval_rows` held-out rows (0: none)."""
    f = {**SUPPORTED, **{k: v for k, v in fields.items() if k in SUPPORTED}}
    bs, ga, g = f["per_device_train_batch_size"], f["gradient_accumulation_steps"], f["num_generations"]
    _need(bs >= 1 and ga >= 1 and g >= 2, "GRPOConfig: per_device_train_batch_size and gradient_accumulation_steps "
          "must be >= 1, num_generations >= 2")
    _need(bs * ga % g == 0, f"GRPOConfig: per_device_train_batch_size x gradient_accumulation_steps ({bs} x {ga}) "
          f"counts completions and must be divisible by num_generations ({g})")
    prompts = bs * ga // g
    if f["max_steps"] and f["max_steps"] > 0:
        steps = int(f["max_steps"])
    else:
        steps = math.ceil(float(f["num_train_epochs"]) * math.ceil(train_rows / prompts))
    _need(steps >= 1, "GRPOConfig: max_steps or num_train_epochs must give at least one step")
    # transformers 5 reads a warmup_steps below 1 as a ratio, as warmup_ratio was
    ratio = f["warmup_steps"] if 0 < f["warmup_steps"] < 1 else f["warmup_ratio"]
    warmup = math.ceil(float(ratio) * steps) if ratio else int(f["warmup_steps"])
    _need(f["lr_scheduler_type"] in SCHEDULES, f"GRPOConfig.lr_scheduler_type={f['lr_scheduler_type']!r}: "
          f"not supported by grpolab (use one of {', '.join(SCHEDULES)})")
    _need(f["optim"] in ("adamw_torch", "adamw_torch_fused"), f"GRPOConfig.optim={f['optim']!r}: not supported by "
          f"grpolab (its optimizer is torch's AdamW: adamw_torch)")
    _need(f["loss_type"] in LOSS_TYPES, f"GRPOConfig.loss_type={f['loss_type']!r}: not supported by grpolab (use one "
          f"of {', '.join(LOSS_TYPES)})")
    scale = {True: "group", False: "none"}.get(f["scale_rewards"], f["scale_rewards"])
    _need(scale in ("group", "batch", "none"), f"GRPOConfig.scale_rewards={f['scale_rewards']!r}: use group, batch "
          f"or none")
    level = f["importance_sampling_level"]
    _need(level in ("token", "sequence"), f"GRPOConfig.importance_sampling_level={level!r}: use token or sequence")
    _need(f["logging_steps"] >= 1, "GRPOConfig.logging_steps: give a number of steps (>= 1); ratios are not "
                                   "supported by grpolab")
    _need(f["save_strategy"] in ("steps", "no"), f"GRPOConfig.save_strategy={f['save_strategy']!r}: not supported "
          f"by grpolab (steps or no; the last step is always saved)")
    _need(f["eval_strategy"] in ("steps", "no"), f"GRPOConfig.eval_strategy={f['eval_strategy']!r}: not supported "
          f"by grpolab (steps or no; with an eval_dataset the last step is always evaluated)")
    reporters = [f["report_to"]] if isinstance(f["report_to"], str) else list(f["report_to"] or ["none"])
    for r in reporters:
        _need(r in REPORTERS, f"GRPOConfig.report_to={r!r}: not supported by grpolab (use {', '.join(REPORTERS)})")
    _need(not (f["bf16"] and f["fp16"]), "GRPOConfig: bf16 and fp16 are both set; choose one")
    if f["use_vllm"]:
        _need(f["vllm_mode"] == "colocate", f"GRPOConfig.vllm_mode={f['vllm_mode']!r}: not supported by grpolab "
              f"(vLLM runs in the trainer's process: vllm_mode='colocate')")

    out: dict[str, Any] = {
        "train.output_dir": str(f["output_dir"]),
        "train.seed": int(f["seed"]),
        "train.max_steps": steps,
        "train.log_every": int(f["logging_steps"]),
        "train.save_every": int(f["save_steps"]) if f["save_strategy"] == "steps" else 0,
        "train.keep_checkpoints": int(f["save_total_limit"] or 0),
        "optim.lr": float(f["learning_rate"]),
        "optim.weight_decay": float(f["weight_decay"]),
        "optim.beta1": float(f["adam_beta1"]),
        "optim.beta2": float(f["adam_beta2"]),
        "optim.max_grad_norm": float(f["max_grad_norm"]),
        "optim.lr_schedule": SCHEDULES[f["lr_scheduler_type"]],
        "optim.warmup_steps": int(warmup),
        "optim.micro_batch_size": int(bs),
        "rollout.prompts_per_step": prompts,
        "rollout.num_generations": int(g),
        "rollout.max_new_tokens": int(f["max_completion_length"]),
        "rollout.temperature": float(f["temperature"]),
        "rollout.top_p": float(f["top_p"]),
        "rollout.top_k": int(f["top_k"] or 0),
        "rollout.repetition_penalty": float(f["repetition_penalty"]),
        "data.max_prompt_length": int(f["max_prompt_length"] or 0),
        "algorithm.beta": float(f["beta"]),
        "algorithm.epsilon": float(f["epsilon"]),
        "algorithm.epsilon_high": None if f["epsilon_high"] is None else float(f["epsilon_high"]),
        "algorithm.num_iterations": int(f["num_iterations"]),
        "algorithm.loss_agg_mode": LOSS_TYPES[f["loss_type"]],
        "algorithm.scale_rewards": scale,
        # TRL divides by torch's std, which is the unbiased (n - 1) one
        "algorithm.unbiased_std": True,
        "algorithm.policy_loss": "gspo" if level == "sequence" else "clip",
        "algorithm.mask_truncated_completions": bool(f["mask_truncated_completions"]),
        "algorithm.ref_sync_steps": int(f["ref_model_sync_steps"]) if f["sync_ref_model"] else 0,
        "algorithm.ref_sync_alpha": float(f["ref_model_mixup_alpha"]),
        "algorithm.entropy_coef": float(f["entropy_coef"]),
        "model.gradient_checkpointing": bool(f["gradient_checkpointing"]),
        "model.trust_remote_code": bool(f["trust_remote_code"]),
        "log.tensorboard": "tensorboard" in reporters,
        "eval.num_problems": int(eval_rows),
        "train.eval_every": int(f["eval_steps"] or f["logging_steps"]) if eval_rows and
        f["eval_strategy"] == "steps" else 0,
    }
    if f["reward_weights"] is not None:
        out["reward.weights"] = [float(w) for w in f["reward_weights"]]
    if f["bf16"] or f["fp16"]:
        out["model.dtype"] = "bfloat16" if f["bf16"] else "float16"
    if f["use_cpu"]:
        out["model.device"] = "cpu"
    if "wandb" in reporters:
        out["log.wandb_project"] = "huggingface"   # transformers' default project
    if f["log_completions"]:
        out["log.samples_every"] = int(f["logging_steps"])
    if f["use_vllm"]:
        out["rollout.engine"] = "vllm"
        out["vllm.gpu_memory_utilization"] = float(f["vllm_gpu_memory_utilization"])
        if f["vllm_max_model_length"]:
            out["vllm.max_model_len"] = int(f["vllm_max_model_length"])
        if f["vllm_importance_sampling_correction"]:
            _need(f["vllm_importance_sampling_mode"] in IS_MODES, f"GRPOConfig.vllm_importance_sampling_mode="
                  f"{f['vllm_importance_sampling_mode']!r}: use one of {', '.join(IS_MODES)}")
            kind, level = IS_MODES[f["vllm_importance_sampling_mode"]]
            out["algorithm.rollout_correction"] = kind
            out["algorithm.rollout_correction_level"] = level
            out["algorithm.rollout_correction_threshold"] = float(f["vllm_importance_sampling_clip_max"])
    return out
