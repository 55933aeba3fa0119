"""peft's LoraConfig fields as grpolab's model.lora_* keys: the ones grpolab maps (`LORA_MAPPED`), the ones it
refuses unless left at peft's default (`LORA_UNSUPPORTED`, one line each, as for TRL's fields), and the ones that
change nothing grpolab trains (`LORA_INERT`). A field of a newer peft in none of them is refused when it is set.
Plain data, no torch or peft."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.validate import short
from ..errors import ConfigError

LORA_MAPPED = {"r": "model.lora_rank", "lora_alpha": "model.lora_alpha", "lora_dropout": "model.lora_dropout",
               "target_modules": "model.lora_target_modules"}

NOT_ADAPTERS = "grpolab trains plain LoRA adapters on the target modules"

# name: (peft's default, a value the tests set, why grpolab refuses other values)
LORA_UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    "use_dora": (False, True, "DoRA is not implemented"),
    "use_rslora": (False, True, "rank-stabilised scaling is not implemented; the scale is lora_alpha / r"),
    "bias": ("none", "all", "biases are not trained"),
    "lora_bias": (False, True, "the adapters have no bias"),
    "exclude_modules": (None, ["q_proj"], "give target_modules the layers to adapt instead"),
    "modules_to_save": (None, ["lm_head"], "only the adapters are trained"),
    "init_lora_weights": (True, "gaussian", "B starts at zero, A as peft's default"),
    "layers_to_transform": (None, [0], "every block is adapted"),
    "rank_pattern": ({}, {"q_proj": 2}, "one rank for every adapter"),
    "alpha_pattern": ({}, {"q_proj": 2}, "one alpha for every adapter"),
    "fan_in_fan_out": (False, True, "the adapted layers are torch Linear layers"),
    "inference_mode": (False, True, "an inference-mode adapter has nothing to train"),
    "trainable_token_indices": (None, [0, 1], "embeddings are not trained"),
    "ensure_weight_tying": (False, True, "no tied layer is adapted"),
    "target_parameters": (None, ["weight"], "give target_modules the layers to adapt"),
    "layer_replication": (None, [[0, 1]], "the model's layers are used as they are"),
    "megatron_config": (None, {"tensor_model_parallel_size": 2}, "Megatron layers are not supported"),
    "use_qalora": (False, True, "quantised models are not supported"),
    "loftq_config": ({}, {"loftq_bits": 4}, NOT_ADAPTERS),
    "eva_config": (None, {"rho": 2.0}, NOT_ADAPTERS),
    "corda_config": (None, {"corda_method": "kpm"}, NOT_ADAPTERS),
    "lora_ga_config": (None, {"batch_size": 2}, NOT_ADAPTERS),
    "velora_config": (None, {"rank": 2}, NOT_ADAPTERS),
    "alora_invocation_tokens": (None, [1, 2], NOT_ADAPTERS),
    "monteclora_config": (None, {"n": 2}, NOT_ADAPTERS),
    "use_bdlora": (None, {"blocks": 2}, NOT_ADAPTERS),
    "arrow_config": (None, {"top_k": 2}, NOT_ADAPTERS),
    "kasa_config": (None, {"k": 2}, NOT_ADAPTERS),
}

# fields that change nothing grpolab trains: the adapter's description (task, base model, versions), how peft runs
# it, and settings read only together with a refused field (megatron_config, use_qalora, layers_to_transform)
LORA_INERT = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
              "runtime_config", "megatron_core", "qalora_group_size", "layers_pattern")


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _same(value: Any, default: Any) -> bool:
    """peft's default, or an empty value where the default is None or empty."""
    return value == default or (default in (None, {}, []) and not value)


def _check_unmapped(peft_config: Any) -> None:
    for name, (default, _, why) in LORA_UNSUPPORTED.items():
        value = getattr(peft_config, name, default)
        if not _same(value, default):
            raise ConfigError(f"peft_config.{name}={short(value)}: not supported by grpolab ({why}; LoRA with "
                              f"{name}={default!r})")
    known = set(LORA_MAPPED) | set(LORA_UNSUPPORTED) | set(LORA_INERT)
    for field in dataclasses.fields(peft_config) if dataclasses.is_dataclass(peft_config) else ():
        value = getattr(peft_config, field.name, None)
        if field.name not in known and not _same(value, _default(field)):
            raise ConfigError(f"peft_config.{field.name}={short(value)}: not supported by grpolab (a LoraConfig "
                              f"field it does not know; leave it at peft's default)")


def lora_settings(peft_config: Any) -> dict[str, Any]:
    """model.lora_* keys for a peft LoraConfig (None: no keys)."""
    if peft_config is None:
        return {}
    if not all(hasattr(peft_config, k) for k in LORA_MAPPED):
        raise ConfigError(f"peft_config: a peft LoraConfig is expected, not {type(peft_config).__name__}")
    _check_unmapped(peft_config)
    targets = peft_config.target_modules
    if targets is None:   # peft then picks layers per architecture, which grpolab does not copy
        raise ConfigError("peft_config.target_modules is None: name the layers (e.g. ['q_proj', 'v_proj']) or give "
                          "'all-linear'")
    if targets == "all-linear":
        targets = None   # grpolab's default: every linear layer of the blocks
    elif isinstance(targets, str):
        raise ConfigError(f"peft_config.target_modules={targets!r}: give a list of layer names or 'all-linear'")
    else:
        targets = sorted(targets)
    return {"model.lora_rank": int(peft_config.r), "model.lora_alpha": float(peft_config.lora_alpha),
            "model.lora_dropout": float(peft_config.lora_dropout), "model.lora_target_modules": targets}
