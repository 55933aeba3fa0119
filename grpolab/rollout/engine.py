"""Batched sampling with a preallocated KV cache: the rollout engine's entry point.

Each prompt is prefilled once; its cache is then copied to its G samples and all
P*G rows decode together, one token per forward pass, until every row has emitted a
stop token or max_new_tokens is reached (decode_loop.py). Rows that have stopped leave the batch (in
groups: a quarter of the batch at a time), so later steps compute only the rows still going.
"""

from __future__ import annotations

import dataclasses

import torch

from . import slot_decode
from .decode_loop import PREFILL_CHUNK, Penalties, decode
from .generation import Generation


def generate(model, prompts: list[list[int]], *, num_generations: int = 1, max_new_tokens: int = 64,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids: tuple[int, ...] = (), pad_id: int = 0,
             generator: torch.Generator | None = None, keys: torch.Tensor | None = None,
             tools=None, logits_hook=None, prefill_chunk: int = PREFILL_CHUNK, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, min_tokens: int = 0,
             budgets: torch.Tensor | None = None, on_tokens=None, slots: bool | None = None,
             max_slots: int | None = None) -> Generation:
    """Sample `num_generations` completions for each tokenized prompt.

    Rows come out grouped: rows [i*G, (i+1)*G) belong to prompt i. The model is any
    callable `model(ids, key_valid=..., cache=...) -> logits` with `new_cache(batch, max_len)`.
    Randomness: `keys` (num_prompts * G,) int64 from `keys.completion_keys` make each row's draws
    depend on its key alone (the same completions however the rows are batched); otherwise the
    rows share `generator`'s stream.
    `tools` (a `tool_decode.ToolUse`, or an environment bound to the prompts' rows, `env_decode.BoundEnv`): rows
    may call tools mid-completion (see tool_decode), or each row is an episode the environment replies in.
    `logits_hook(logits, t, rows) -> logits`: called before each token is sampled, with the logits (R, V)
    of the R rows still decoding, the token index t and `rows` (R,), those rows' indices among the
    B outputs (a logits processor; bench/rollout.py forces each row's stop length with it).
    `prefill_chunk`: prompt positions per prefill forward (0: the whole prompt in one; on the lean path each
    prompt's own positions per piece, the prompts packed without padding); the same tokens.
    `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `min_tokens`: vLLM's SamplingParams
    fields (decode_loop.Penalties), applied before `logits_hook`; at their defaults nothing is processed.
    `budgets` (num_prompts * G,): each row's own token cap, at most max_new_tokens (vLLM's per-request
    max_tokens). `on_tokens(n)`: told how many tokens were sampled, as they are (a progress count).
    `slots`: sample through the slotted decode (slot_decode.py: CUDA graphs on a GPU); None: wherever it
    applies, i.e. on CUDA (unless the model's `cuda_graph` attribute is False, rollout.cuda_graph), for the
    built-in GPT and Llama-family HF models, keyed or greedy sampling, no logits_hook (tools, environments and
    penalties included).
    `max_slots`: the slotted decode holds at most this many rows at once and admits the rest as rows finish
    (the same completions; None: all at once).
    """
    if logits_hook is not None and tools is not None:
        raise ValueError("logits_hook is not supported together with tools")
    if keys is not None and keys.numel() != len(prompts) * num_generations:
        raise ValueError(f"keys: {keys.numel()} for {len(prompts)} prompts x {num_generations} generations")
    pen = Penalties(repetition_penalty, presence_penalty, frequency_penalty, min_tokens)
    device = next(model.parameters()).device
    session = None if tools is None else tools.session(len(prompts) * num_generations, max_new_tokens, device)
    if slots is None:
        L = session.length if session is not None else max_new_tokens
        slots = (device.type == "cuda" and getattr(model, "cuda_graph", True) and logits_hook is None
                 and (keys is not None or temperature <= 0) and slot_decode.why_not(model, prompts, L) is None)
    if slots:
        out = slot_decode.generate(model, prompts, num_generations=num_generations, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids,
                                   pad_id=pad_id, keys=keys, budgets=budgets, on_tokens=on_tokens,
                                   max_slots=max_slots, penalties=pen, session=session)
    else:
        with torch.inference_mode():
            out = decode(model, prompts, num_generations, max_new_tokens, temperature, top_k, top_p, stop_ids,
                         pad_id, generator, keys, logits_hook=logits_hook, prefill_chunk=prefill_chunk, tools=session,
                         penalties=pen, budgets=budgets, on_tokens=on_tokens)
    # inference-mode tensors cannot enter autograd; the trainer differentiates through these ids
    return dataclasses.replace(out, **{k: t.clone() for k, t in out.tensors().items()})


def sample(model, prompts: list[list[int]], *, engine=None, tools=None, logits_hook=None, on_tokens=None,
           **kw) -> Generation:
    """`generate` on `model`, or, given an `engine` (rollout/vllm_engine.VLLMEngine holding `model`'s
    weights), the same call on that engine; `tools`, `logits_hook` and `on_tokens` are the built-in
    engine's alone."""
    if engine is None:
        return generate(model, prompts, tools=tools, logits_hook=logits_hook, on_tokens=on_tokens, **kw)
    return engine.generate(prompts, **kw)
