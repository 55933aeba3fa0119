"""The transformer blocks of a model: what FSDP shards one by one and what LoRA targets by position."""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the built-in GPT's `blocks`, or the layers a Hugging Face model
    declares unsplittable (`_no_split_modules`, e.g. LlamaDecoderLayer)."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    hf = getattr(model, "hf", model)
    names = set(getattr(hf, "_no_split_modules", None) or ())
    found = [m for m in hf.modules() if type(m).__name__ in names]
    if not found:
        raise ConfigError(f"train.strategy: fsdp cannot find the transformer blocks of {type(hf).__name__} "
                         f"(it declares no _no_split_modules); use train.strategy=ddp")
    return found
