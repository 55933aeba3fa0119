"""Reward models: spec 'rm:<local dir or hub id>' scores prompt+completion with a sequence classifier.

score = logits[:, 0] of AutoModelForSequenceClassification on the joined text. Chat-message
prompts are rendered with the RM tokenizer's chat template (completion as the assistant
turn) when it has one; otherwise texts are concatenated.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch

from ..utils.padding import pad_sequences
from .calling import completion_texts
from .errors import RewardError

PREFIX = "rm:"


def _source_key(source: str) -> str:
    """Absolute path for a local directory (so one model loads once whatever cwd named it), else the hub id."""
    p = Path(source).expanduser()
    return str(p.resolve()) if p.is_dir() else source


@functools.lru_cache(maxsize=None)
def load_reward_model(source: str, device: str | None = None):
    """(model in eval mode on `device`, tokenizer with a pad token), loaded once per (source, device)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    spec = PREFIX + source
    if source.startswith((".", "/", "~")) and not Path(source).expanduser().is_dir():
        raise RewardError(f"reward {spec!r}: directory {source!r} not found; give a local model directory "
                          f"(relative to {Path.cwd()}) or a hub id")
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForSequenceClassification.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - one readable line instead of a loader traceback
        msg = (str(e).strip().splitlines() or [""])[0]
        raise RewardError(f"reward {spec!r}: cannot load a sequence-classification model and tokenizer from "
                          f"{source!r} ({type(e).__name__}: {msg}); give a directory with config.json, weights and "
                          f"tokenizer files, or a hub id already in the local cache") from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise RewardError(f"reward {spec!r}: the tokenizer has neither a pad nor an eos token; "
                              f"set pad_token in its tokenizer_config.json")
        tok.pad_token = tok.eos_token
    # last-token pooling (Llama, Qwen, ...) finds each row's last non-pad token via config.pad_token_id,
    # so it must be the id the tokenizer pads with, or padded rows pool the wrong position
    model.config.pad_token_id = tok.pad_token_id
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tok


def _max_length(tok) -> int | None:
    # tokenizers without a limit report a huge sentinel (int(1e30)); don't truncate then
    n = getattr(tok, "model_max_length", None)
    return n if isinstance(n, int) and n < 1_000_000 else None


def rm_input(tok, prompt, completion: str) -> tuple[str, bool]:
    """(text to score, whether the tokenizer should add its special tokens) for one sample."""
    if isinstance(prompt, list):
        if getattr(tok, "chat_template", None):
            messages = list(prompt) + [{"role": "assistant", "content": completion}]
            # the template already writes BOS/EOS and role markers
            return tok.apply_chat_template(messages, tokenize=False), False
        prompt = "\n".join(str(m["content"]) for m in prompt) + "\n"
    return ("" if prompt is None else str(prompt)) + completion, True


def score_texts(model, tok, inputs: list[tuple[str, bool]], batch_size: int = 16) -> list[float]:
    """logits[:, 0] for each (text, add_special_tokens), in batches padded with the tokenizer's pad token."""
    max_len = _max_length(tok)
    scores: list[float] = []
    for i in range(0, len(inputs), batch_size):
        ids = [tok(text, add_special_tokens=special, truncation=max_len is not None, max_length=max_len)["input_ids"]
               for text, special in inputs[i:i + batch_size]]
        # padded to the longest row on the tokenizer's padding side; HF takes a 0/1 long attention mask
        input_ids, mask = pad_sequences(ids, tok.pad_token_id, "left" if tok.padding_side == "left" else "right")
        attention_mask = mask.long()
        with torch.no_grad():
            logits = model(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device)).logits
        scores.extend(logits[:, 0].float().cpu().tolist())
    return scores


@functools.lru_cache(maxsize=None)
def _reward_fn(key: str, batch_size: int, device: str | None) -> Callable[..., list[float]]:
    model, tok = load_reward_model(key, device)

    def rm_reward(prompts, completions, **_) -> list[float]:
        completions = completion_texts(completions)
        prompts = prompts if prompts is not None else [None] * len(completions)
        return score_texts(model, tok, [rm_input(tok, p, c) for p, c in zip(prompts, completions)], batch_size)

    rm_reward.__name__ = "rm_" + Path(key.rstrip("/\\")).name
    rm_reward.model, rm_reward.tokenizer = model, tok
    return rm_reward


def reward_model(source: str, batch_size: int = 16, device: str | None = None) -> Callable[..., list[float]]:
    """Reward function scoring prompt+completion with the model at `source` (cached per process)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return _reward_fn(_source_key(source), batch_size, device)
