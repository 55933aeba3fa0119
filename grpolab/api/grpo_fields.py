"""TRL's GRPOConfig fields as grpolab keys: the ones grpolab implements (`GRPO`, `grpo_settings`) and the ones it
does not (`GRPO_UNSUPPORTED`, each refused with one line unless left at TRL's default). Plain data, no torch."""

from __future__ import annotations

from typing import Any

from ..config.validate import need
from .trl_fields import TRAINING, TRAINING_UNSUPPORTED, optimizer_settings, total_steps, training_settings

# TRL's defaults for the GRPOConfig fields grpolab implements (TRL 1.x)
GRPO: dict[str, Any] = {
    **TRAINING,
    "learning_rate": 1e-6,
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
}

# TRL's vllm_importance_sampling_mode -> grpolab's (algorithm.rollout_correction, rollout_correction_level)
IS_MODES = {"token_truncate": ("tis", "token"), "token_mask": ("mis", "token"),
            "sequence_truncate": ("tis", "sequence"), "sequence_mask": ("mis", "sequence")}

# TRL's loss_type -> grpolab's algorithm.loss_agg_mode (the same normalisation of the per-token losses)
LOSS_TYPES = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
              "dr_grpo": "seq-mean-token-sum-norm"}


COLOCATE = "vLLM runs in the trainer's process (vllm_mode='colocate')"

GRPO_UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    **TRAINING_UNSUPPORTED,
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
    "num_generations_eval": (None, 4, "the eval samples eval.k completions per problem"),
    "cast_lm_head_to_fp32": (False, True, "not implemented"),
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
}




def grpo_settings(fields: dict[str, Any], train_rows: int, eval_rows: int) -> dict[str, Any]:
    """grpolab's dotted keys for TRL GRPOConfig `fields` (TRL's defaults where not given) and a train set of
    `train_rows` prompts (0: a path, not counted); `eval_rows` held-out rows (0: none)."""
    f = {**GRPO, **{k: v for k, v in fields.items() if k in GRPO}}
    bs, ga, g = f["per_device_train_batch_size"], f["gradient_accumulation_steps"], f["num_generations"]
    need(bs >= 1 and ga >= 1 and g >= 2, "GRPOConfig: per_device_train_batch_size and gradient_accumulation_steps "
         "must be >= 1, num_generations >= 2")
    need(bs * ga % g == 0, f"GRPOConfig: per_device_train_batch_size x gradient_accumulation_steps ({bs} x {ga}) "
         f"counts completions and must be divisible by num_generations ({g})")
    prompts = bs * ga // g
    steps = total_steps(f, train_rows, prompts, "GRPOConfig")
    need(f["loss_type"] in LOSS_TYPES, f"GRPOConfig.loss_type={f['loss_type']!r}: not supported by grpolab (use one "
         f"of {', '.join(LOSS_TYPES)})")
    scale = {True: "group", False: "none"}.get(f["scale_rewards"], f["scale_rewards"])
    need(scale in ("group", "batch", "none"), f"GRPOConfig.scale_rewards={f['scale_rewards']!r}: use group, batch "
         f"or none")
    level = f["importance_sampling_level"]
    need(level in ("token", "sequence"), f"GRPOConfig.importance_sampling_level={level!r}: use token or sequence")
    if f["use_vllm"]:
        need(f["vllm_mode"] == "colocate", f"GRPOConfig.vllm_mode={f['vllm_mode']!r}: not supported by grpolab "
             f"(vLLM runs in the trainer's process: vllm_mode='colocate')")

    out = training_settings(f, "GRPOConfig", steps, eval_rows)
    out.update(optimizer_settings(f, "optim", steps))
    out.update({
        "train.max_steps": steps,
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
        "eval.num_problems": int(eval_rows),
    })
    if f["reward_weights"] is not None:
        out["reward.weights"] = [float(w) for w in f["reward_weights"]]
    if f["log_completions"]:
        out["log.samples_every"] = int(f["logging_steps"])
    if f["use_vllm"]:
        out["rollout.source"] = "vllm"
        out["vllm.gpu_memory_utilization"] = float(f["vllm_gpu_memory_utilization"])
        if f["vllm_max_model_length"]:
            out["vllm.max_model_len"] = int(f["vllm_max_model_length"])
        if f["vllm_importance_sampling_correction"]:
            need(f["vllm_importance_sampling_mode"] in IS_MODES, f"GRPOConfig.vllm_importance_sampling_mode="
                 f"{f['vllm_importance_sampling_mode']!r}: use one of {', '.join(IS_MODES)}")
            kind, level = IS_MODES[f["vllm_importance_sampling_mode"]]
            out["algorithm.rollout_correction"] = kind
            out["algorithm.rollout_correction_level"] = level
            out["algorithm.rollout_correction_threshold"] = float(f["vllm_importance_sampling_clip_max"])
    return out
