"""LoRA through peft (model.lora_rank > 0): low-rank adapters on the blocks' linear layers; only
they are trained, and the policy with its adapters switched off is the frozen reference.

- Hugging Face policies: `peft.get_peft_model`, so a checkpoint is peft's own adapter layout
  (adapter_config.json + adapter_model.safetensors, naming the base model), which
  `PeftModel.from_pretrained` and `grpolab export --merge` read.
- The built-in GPT: adapters injected in place (`peft.inject_adapter_in_model`); its checkpoint
  holds base and adapter weights together, and the LoRA settings in model_config.json (a peft
  adapter for a model no other tool knows would be of no use alone).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from torch import nn

from ..errors import ConfigError
from .blocks import blocks


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("model.lora_rank needs peft: pip install 'grpolab[hf]'") from None
    return peft


def block_linear_names(model: nn.Module) -> list[str]:
    """The default targets: the names of every nn.Linear inside the transformer blocks (not the
    embeddings or the head), e.g. q_proj, k_proj, ..., down_proj or qkv, proj, fc, fc_out."""
    names = {name.rsplit(".", 1)[-1] for b in blocks(model) for name, m in b.named_modules()
             if isinstance(m, nn.Linear)}
    return sorted(names)


def check_targets(targets: list[str], model: nn.Module) -> None:
    """Each of model.lora_target_modules names a linear layer of `model` (its last name part, or a dotted
    tail such as self_attn.q_proj, as peft matches them); ConfigError listing the layers there are. peft
    drops a name that matches nothing without a word while another one matches, and otherwise fails with
    a long error."""
    linear = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for t in targets:
        if not any(name == t or name.endswith("." + t) for name in linear):
            names = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ConfigError(f"model.lora_target_modules: {t!r} matches no linear layer of the model; its linear "
                              f"layers are {', '.join(names) or 'none'}")


def lora_config(m, model: nn.Module) -> dict:
    """peft LoraConfig arguments from the `model` config section."""
    if m.lora_target_modules:
        check_targets(list(m.lora_target_modules), model)
    return {"r": m.lora_rank, "lora_alpha": m.lora_alpha, "lora_dropout": m.lora_dropout,
            "target_modules": list(m.lora_target_modules or block_linear_names(model))}


def add_lora(model: nn.Module, settings: dict) -> nn.Module:
    """Adapters on `model` (in place for the GPT; HFPolicy.hf becomes a PeftModel); everything else
    frozen. Returns the same policy object."""
    peft = _peft()
    if hasattr(model, "hf"):
        model.hf = peft.get_peft_model(model.hf, peft.LoraConfig(task_type="CAUSAL_LM", **settings))
        cfg = model.hf.peft_config["default"]
        base = cfg.base_model_name_or_path
        if base and Path(base).exists():   # a local base: its absolute path, so a resume from elsewhere finds it
            cfg.base_model_name_or_path = str(Path(base).resolve())
    else:
        model.requires_grad_(False)
        peft.inject_adapter_in_model(peft.LoraConfig(**settings), model)
        model.lora = dict(settings)   # written to model_config.json with the weights
    return model


def has_lora(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Within: every LoRA layer computes its base layer alone (the reference policy)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
