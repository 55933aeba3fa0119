"""Batched sampling with a preallocated KV cache.

Each prompt is prefilled once; its cache is then copied to its G samples and all
P*G rows decode together, one token per forward pass, until every row has emitted a
stop token or max_new_tokens is reached. Rows that have stopped leave the batch (in
groups: a quarter of the batch at a time), so later steps compute only the rows still going.
"""

from __future__ import annotations

import dataclasses

import torch

from .core import PREFILL_CHUNK, check_finite, prefill
from .generation import Generation
from .keys import token_uniforms
from .sampling import sample_next
from .tool_decode import decode_with_tools


def generate(model, prompts: list[list[int]], *, num_generations: int = 1, max_new_tokens: int = 64,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids: tuple[int, ...] = (), pad_id: int = 0,
             generator: torch.Generator | None = None, keys: torch.Tensor | None = None,
             tools=None, logits_hook=None, prefill_chunk: int = PREFILL_CHUNK) -> Generation:
    """Sample `num_generations` completions for each tokenized prompt.

    Rows come out grouped: rows [i*G, (i+1)*G) belong to prompt i. The model is any
    callable `model(ids, key_valid=..., cache=...) -> logits` with `new_cache(batch, max_len)`.
    Randomness: `keys` (num_prompts * G,) int64 from `keys.completion_keys` make each row's draws
    depend on its key alone (the same completions however the rows are batched); otherwise the
    rows share `generator`'s stream.
    `tools` (a `tool_decode.ToolUse`): rows may call tools mid-completion (see tool_decode).
    `logits_hook(logits, t, rows) -> logits`: called before each token is sampled, with the logits (R, V)
    of the R rows still decoding, the token index t and `rows` (R,), those rows' indices among the
    B outputs (a logits processor; bench/rollout.py forces each row's stop length with it).
    `prefill_chunk`: prompt positions per prefill forward (0: the whole prompt in one); the same values.
    """
    if logits_hook is not None and tools is not None:
        raise ValueError("logits_hook is not supported together with tools")
    if keys is not None and keys.numel() != len(prompts) * num_generations:
        raise ValueError(f"keys: {keys.numel()} for {len(prompts)} prompts x {num_generations} generations")
    with torch.inference_mode():
        if tools is not None:
            out = decode_with_tools(model, prompts, num_generations, max_new_tokens, temperature, top_k, top_p,
                                    stop_ids, pad_id, generator, keys, tools, prefill_chunk)
        else:
            out = _decode(model, prompts, num_generations, max_new_tokens, temperature, top_k, top_p,
                          stop_ids, pad_id, generator, keys, logits_hook, prefill_chunk)
    # inference-mode tensors cannot enter autograd; the trainer differentiates through these ids
    return dataclasses.replace(out, **{k: t.clone() for k, t in out.tensors().items()})


def _decode(model, prompts, num_generations, max_new_tokens, temperature, top_k, top_p, stop_ids, pad_id,
            generator, keys, logits_hook=None, prefill_chunk: int = PREFILL_CHUNK) -> Generation:
    device = next(model.parameters()).device
    G = num_generations
    keys = keys.to(device) if keys is not None else None
    pre = prefill(model, prompts, G, max_new_tokens, pad_id, prefill_chunk)
    p_ids, p_mask, cache, logits = pre.prompt_ids, pre.prompt_mask, pre.cache, pre.logits
    B = logits.size(0)

    # filled with padding: rows that leave the batch early keep it after their stop token
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    live = None   # indices (into the B rows) of the rows still in the batch; None: all of them
    done = torch.zeros(B, dtype=torch.bool, device=device)   # over the rows in the batch
    steps = 0
    # The loop only samples and records; which tokens count (up to each row's first stop) is
    # worked out once afterwards, so a step costs the forward pass and little else.
    for t in range(max_new_tokens):
        steps = t + 1
        u = token_uniforms(keys, t) if keys is not None else None
        if logits_hook is not None:
            logits = logits_hook(logits, t, live if live is not None else torch.arange(B, device=device))
        tok, lp = sample_next(logits, temperature, top_k, top_p, generator, u)
        if live is None:
            out[:, t] = tok
            logps[:, t] = lp
        else:
            out[live, t] = tok
            logps[live, t] = lp
        if len(stop_ids):
            done |= torch.isin(tok, stops)
            finished = int(done.sum())
            if finished == done.numel():
                break
            # Rows that have stopped leave the batch once they are a quarter of it, so a rollout costs
            # the tokens actually generated rather than rows x the longest (dropping rows copies the
            # KV cache, hence not one row at a time).
            if t < max_new_tokens - 1 and finished * 4 >= done.numel():
                keep = (~done).nonzero().squeeze(1)
                cache, tok, done = cache.select(keep), tok[keep], done[keep]
                keys = keys[keep] if keys is not None else None
                live = keep if live is None else live[keep]
        if t == max_new_tokens - 1:
            break
        logits = model(tok[:, None], cache=cache)[:, -1]
    out, logps = out[:, :steps], logps[:, :steps]
    check_finite(logps, torch.ones_like(logps, dtype=torch.bool))
    is_stop = torch.isin(out, stops)
    # a token counts when no stop token came before it (the stop token itself counts)
    mask = (is_stop.cumsum(-1) - is_stop.long()) == 0
    return Generation(
        prompt_ids=p_ids.repeat_interleave(G, dim=0),
        prompt_mask=p_mask.repeat_interleave(G, dim=0),
        completion_ids=out.masked_fill(~mask, pad_id), completion_mask=mask,
        sampler_logprobs=logps.masked_fill(~mask, 0.0), truncated=~is_stop.any(-1),
    )
