"""Models: the built-in tiny GPT (with its character tokenizer); Hugging Face models later."""

from __future__ import annotations

from .gpt import GPT, GPTConfig
from .tokenizer import CharTokenizer


def build_builtin(model_cfg, tokenizer: CharTokenizer) -> GPT:
    """A freshly initialised built-in GPT sized by the `model` config section."""
    return GPT(GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=model_cfg.n_layer, n_head=model_cfg.n_head,
                         n_embd=model_cfg.n_embd, block_size=model_cfg.block_size))


__all__ = ["GPT", "GPTConfig", "CharTokenizer", "build_builtin"]
