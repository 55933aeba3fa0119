"""Batched sampling with a preallocated KV cache.

Each prompt is prefilled once; its cache is then copied to its G samples and all
P*G rows decode together, one token per forward pass, until every row has emitted a
stop token or max_new_tokens is reached. Rows that have stopped leave the batch (in
groups: a quarter of the batch at a time), so later steps compute only the rows still going.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..utils.padding import pad_sequences
from .keys import token_uniforms
from .sampling import sample_next
from ..errors import NonFiniteLogits


# prompts are prefilled this many positions at a time: the prefill's attention scores and activations
# then stay (rows x PREFILL_CHUNK x ...) however long the prompts are
PREFILL_CHUNK = 512



@dataclass
class Generation:
    prompt_ids: torch.Tensor        # (B, P) left-padded with pad_id, B = num_prompts * G
    prompt_mask: torch.Tensor       # (B, P) bool, True at real prompt tokens
    completion_ids: torch.Tensor    # (B, C) right-padded with pad_id
    completion_mask: torch.Tensor   # (B, C) bool, True up to and including the stop token
    sampler_logprobs: torch.Tensor  # (B, C) log-prob of each sampled token (0 where masked)
    truncated: torch.Tensor         # (B,) bool, True when no stop token within max_new_tokens
    tool_mask: torch.Tensor | None = None  # (B, C) bool, True at tokens tools wrote (context: no loss, no KL)
    tool_calls: list | None = None  # (B,) with tools: each row's calls, [{name, arguments, output, error}]

    def __post_init__(self) -> None:
        if self.tool_mask is None:
            self.tool_mask = torch.zeros_like(self.completion_mask)

    @property
    def context_mask(self) -> torch.Tensor:
        """(B, C) bool: every real completion token, the tools' included (what the model attends to)."""
        return self.completion_mask | self.tool_mask

    def id_lists(self) -> list[list[int]]:
        """Each completion's token ids, stop token included, no padding; with tools, the tools' tokens
        too, in place (what rewards and decoded texts see)."""
        return [ids[m].tolist() for ids, m in zip(self.completion_ids.cpu(), self.context_mask.cpu())]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tool_calls"}


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
            from .tool_decode import decode_with_tools
            out = decode_with_tools(model, prompts, num_generations, max_new_tokens, temperature, top_k, top_p,
                                    stop_ids, pad_id, generator, keys, tools)
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
    p_ids, p_mask = pad_sequences(prompts, pad_id, "left")
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    P = p_ids.size(1)
    cache = model.new_cache(len(prompts), P + max_new_tokens)
    step = prefill_chunk if prefill_chunk > 0 else P
    for i in range(0, P, step):   # in chunks: long prompts never build (rows x P x P) attention scores
        logits = model(p_ids[:, i:i + step], key_valid=p_mask[:, i:i + step], cache=cache, logits_to_keep=1)[:, -1]
    if G > 1:   # the lean HF path may keep one copy of each prompt's keys and values for its G rows
        cache = cache.share_prompt(G) if hasattr(cache, "share_prompt") else cache.repeat_interleave(G)
    logits = logits.repeat_interleave(G, dim=0)
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
    if bool(logps.isnan().any()):   # checked once per rollout, not per token: a per-step check would sync
        raise NonFiniteLogits("the model's next-token probabilities are NaN/inf")
    is_stop = torch.isin(out, stops)
    # a token counts when no stop token came before it (the stop token itself counts)
    mask = (is_stop.cumsum(-1) - is_stop.long()) == 0
    return Generation(
        prompt_ids=p_ids.repeat_interleave(G, dim=0),
        prompt_mask=p_mask.repeat_interleave(G, dim=0),
        completion_ids=out.masked_fill(~mask, pad_id), completion_mask=mask,
        sampler_logprobs=logps.masked_fill(~mask, 0.0), truncated=~is_stop.any(-1),
    )
