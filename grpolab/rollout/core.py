"""The decoding core both rollout loops share (engine._decode, tool_decode.decode_with_tools): the
prompts prefilled in chunks into a KV cache sized for the completions, then fanned out to G rows per
prompt, keeping one copy of a group's prompt where the cache can."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NonFiniteLogits
from ..utils.padding import pad_sequences

# prompts are prefilled this many positions at a time: the prefill's attention scores and activations
# then stay (rows x PREFILL_CHUNK x ...) however long the prompts are
PREFILL_CHUNK = 512


@dataclass
class Prefilled:
    prompt_ids: torch.Tensor    # (num_prompts, P) left-padded
    prompt_mask: torch.Tensor   # (num_prompts, P) bool
    cache: object               # the model's KV cache, G rows per prompt
    logits: torch.Tensor        # (num_prompts * G, V): the next-token logits after each prompt


def prefill(model, prompts: list[list[int]], num_generations: int, completion_len: int, pad_id: int,
            prefill_chunk: int = PREFILL_CHUNK) -> Prefilled:
    """Prefill each prompt once (`prefill_chunk` positions per forward; 0: all in one), then copy its
    cache and logits to its G rows. The cache has room for `completion_len` more positions."""
    device = next(model.parameters()).device
    p_ids, p_mask = pad_sequences(prompts, pad_id, "left")
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    P = p_ids.size(1)
    cache = model.new_cache(len(prompts), P + completion_len)
    step = prefill_chunk if prefill_chunk > 0 else P
    for i in range(0, P, step):   # in chunks: long prompts never build (rows x P x P) attention scores
        logits = model(p_ids[:, i:i + step], key_valid=p_mask[:, i:i + step], cache=cache, logits_to_keep=1)[:, -1]
    G = num_generations
    if G > 1:   # the lean HF path may keep one copy of each prompt's keys and values for its G rows
        cache = cache.share_prompt(G) if hasattr(cache, "share_prompt") else cache.repeat_interleave(G)
    return Prefilled(p_ids, p_mask, cache, logits.repeat_interleave(G, dim=0))


def check_finite(logps: torch.Tensor, counted: torch.Tensor) -> None:
    """NonFiniteLogits when a counted token's log-prob is NaN (checked once per rollout: a per-step
    check would synchronise every step)."""
    if bool((logps.isnan() & counted).any()):
        raise NonFiniteLogits("the model's next-token probabilities are NaN/inf")
