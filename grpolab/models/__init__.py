"""Models: the built-in tiny GPT (with its character tokenizer); Hugging Face models later."""

from __future__ import annotations

from .gpt import GPT, GPTConfig
from .tokenizer import CharTokenizer


def build_builtin(model_cfg, tokenizer: CharTokenizer) -> GPT:
    """A freshly initialised built-in GPT sized by the `model` config section."""
    return GPT(GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=model_cfg.n_layer, n_head=model_cfg.n_head,
                         n_embd=model_cfg.n_embd, block_size=model_cfg.block_size))


def set_gradient_checkpointing(model, on: bool) -> None:
    """Activation checkpointing on or off: HF's own switch (non-reentrant), or per block for the GPT.
    It acts only in training mode with autograd on; sampling and no-grad passes are unchanged."""
    if not hasattr(model, "causal_lm"):   # the built-in GPT
        model.gradient_checkpointing = on
        return
    base = model.causal_lm()
    # transformers >= 5.x names it activation checkpointing; older releases only have gradient_checkpointing_*
    if on:
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        (getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable)()


__all__ = ["GPT", "GPTConfig", "CharTokenizer", "build_builtin", "set_gradient_checkpointing"]
