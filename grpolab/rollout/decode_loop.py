"""The decoding core of every rollout, with or without tools.

`prefill`: the prompts prefilled in chunks into a KV cache sized for the completions, then fanned out
to G rows per prompt, keeping one copy of a group's prompt where the cache can. `decode`: all rows
decode together, one position per forward pass, until each has sampled a stop token or filled its
budget. Without tools, rows that have finished leave the batch (kv_cache.keep: at once from the lean
cache, which moves only the rows that fill their places; a quarter of it at a time from the others, which
copy every row that stays), so a rollout costs the tokens actually generated. With tools
(`tool_decode.ToolSession`), a row that ends a call is fed the result's tokens through the same
forward passes the other rows decode with (see tool_decode). `Penalties`: vLLM's min_tokens and
repetition/presence/frequency penalties, applied with the server's functions (logits_processors.py)
before each token is sampled, only when one is set."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NonFiniteLogits
from ..models.lean_decode import LeanCache
from ..models.lean_prefill import prefill_in_pieces
from ..utils.padding import pad_sequences
from . import kv_cache
from .generation import Generation
from .keys import token_uniforms
from .logits_processors import ban, penalize, token_counts
from .sampling import sample_next

# prompts are prefilled this many positions at a time: the prefill's attention scores and activations
# then stay (rows x PREFILL_CHUNK x ...) however long the prompts are; the server's batcher prefills at most
# this many new prompt tokens per step while rows decode, so a long prompt delays the running streams by one
# chunk per token, not by its whole prefill (vLLM's chunked prefill)
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
    cache and logits to its G rows. The cache has room for `completion_len` more positions. On the lean
    path the prompts are packed (models/lean_prefill.py), each cut into pieces of `prefill_chunk` of its
    own positions; elsewhere they are left-padded to the longest and the batch goes a chunk at a time."""
    device = next(model.parameters()).device
    p_ids, p_mask = pad_sequences(prompts, pad_id, "left")
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    P = p_ids.size(1)
    cache = model.new_cache(len(prompts), P + completion_len)
    if isinstance(cache, LeanCache) and all(prompts):   # packed: no forward over the padding
        kvs, logits = prefill_in_pieces(cache.decoder, prompts, prefill_chunk)
        cache.fill(kvs)
    else:
        step = prefill_chunk if prefill_chunk > 0 else P
        for i in range(0, P, step):   # in chunks: long prompts never build (rows x P x P) attention scores
            logits = model(p_ids[:, i:i + step], key_valid=p_mask[:, i:i + step], cache=cache,
                           logits_to_keep=1)[:, -1]
    G = num_generations
    if G > 1:   # the lean HF path may keep one copy of each prompt's keys and values for its G rows
        cache = cache.share_prompt(G) if hasattr(cache, "share_prompt") else cache.repeat_interleave(G)
    return Prefilled(p_ids, p_mask, cache, logits.repeat_interleave(G, dim=0))


@dataclass(frozen=True)
class Penalties:
    """The rollout's logits processors beyond temperature/top-k/top-p, as vLLM's SamplingParams fields of
    the same names (rollout.* keys; docs/reference/configuration.md)."""
    repetition_penalty: float = 1.0   # tokens of the prompt, of the tools' outputs or sampled: l / r (l > 0), l * r
    presence_penalty: float = 0.0     # l - p * (count > 0), count over the tokens the policy sampled
    frequency_penalty: float = 0.0    # l - f * count
    min_tokens: int = 0               # the stop tokens banned until this many tokens are sampled

    @property
    def active(self) -> bool:
        return self.penalized or self.min_tokens > 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class RowProcessors:
    """One rollout's `Penalties` with the per-row state they read: `counts` (B, V), how often each row
    sampled each token; `seen` (B, V), the tokens of its prompt and of the tools' outputs fed to it (the
    repetition penalty's other tokens; presence and frequency count only what the policy sampled, as
    OpenAI's and vLLM's count only the generated tokens). Every step is row-wise."""

    def __init__(self, pen: Penalties, prompts: list[list[int]], num_generations: int, vocab: int,
                 stops: torch.Tensor, device) -> None:
        self.pen = pen
        rows = len(prompts) * num_generations
        self.stops = stops[stops < vocab]
        self.counts = torch.zeros(rows, vocab, device=device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        if pen.repetition_penalty != 1:   # (the server's rule too: the prompt matters only to this one)
            self.seen = (token_counts(prompts, vocab, device) > 0).repeat_interleave(num_generations, dim=0)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, n_sampled: torch.Tensor) -> torch.Tensor:
        """The logits (R, V) of the batch's `rows` (R,) processed in vLLM's order (min_tokens' ban, then
        the penalties), in float32 as vLLM's sampler; `n_sampled` (R,): tokens each row has sampled."""
        logits = logits.float()
        early = n_sampled < self.pen.min_tokens
        if self.stops.numel() and bool(early.any()):
            banned = torch.zeros_like(logits, dtype=torch.bool)
            banned[:, self.stops] = early[:, None]
            logits = ban(logits, banned)
        if self.pen.penalized:
            full = torch.full((rows.numel(),), 1.0, device=logits.device)
            p = self.pen
            every = rows.numel() == self.counts.size(0)   # all B rows still decode: no (R, V) copies
            seen, counts = (self.seen, self.counts) if every else (self.seen[rows], self.counts[rows])
            logits = penalize(logits, seen, counts, full * p.presence_penalty,
                                 full * p.frequency_penalty, full * p.repetition_penalty)
        return logits

    def record(self, rows: torch.Tensor, tok: torch.Tensor, sampled: torch.Tensor, fed: torch.Tensor | None) -> None:
        """Count the tokens the `sampled` rows drew; a tool's token fed to a row joins what it has `seen`."""
        self.counts[rows[sampled], tok[sampled]] += 1
        if fed is not None and self.pen.repetition_penalty != 1:
            self.seen[rows[fed], tok[fed]] = True


def check_finite(logps: torch.Tensor, counted: torch.Tensor) -> None:
    """NonFiniteLogits when a counted token's log-prob is NaN (checked once per rollout: a per-step
    check would synchronise every step)."""
    if bool((logps.isnan() & counted).any()):
        raise NonFiniteLogits("the model's next-token probabilities are NaN/inf")


def decode(model, prompts: list[list[int]], num_generations: int, max_new_tokens: int, temperature: float,
           top_k: int, top_p: float, stop_ids: tuple[int, ...], pad_id: int, generator: torch.Generator | None,
           keys: torch.Tensor | None, *, logits_hook=None, prefill_chunk: int = PREFILL_CHUNK,
           tools=None, penalties: Penalties | None = None, budgets: torch.Tensor | None = None,
           on_tokens=None) -> Generation:
    """Prefill, then sample up to `max_new_tokens` tokens per row (see `engine.generate` for the
    arguments). `tools` (a `tool_decode.ToolSession` or `env_decode.EpisodeSession`): its rows may have tool
    results or an environment's replies fed to them; those positions count toward `tools.length` (the positions
    model and tools fill together), not toward `max_new_tokens`, and get the log-prob 0 and the tool mask."""
    device = next(model.parameters()).device
    keys = keys.to(device) if keys is not None else None
    budgets = budgets.to(device) if budgets is not None else None
    L = tools.length if tools is not None else max_new_tokens   # completion positions: sampled + fed
    pre = prefill(model, prompts, num_generations, L, pad_id, prefill_chunk)
    cache, logits = pre.cache, pre.logits
    B = logits.size(0)
    # filled with padding: rows that leave the batch early keep it after their last token
    out = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((B, L), dtype=torch.float32, device=device)
    fed = torch.zeros((B, L), dtype=torch.bool, device=device)        # positions a tool wrote
    end = torch.full((B,), L, dtype=torch.long, device=device)       # each row's length
    stopped = torch.zeros(B, dtype=torch.bool, device=device)         # sampled a real stop token
    n_sampled = torch.zeros(B, dtype=torch.long, device=device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    proc = None   # nothing processed unless a penalty is set: the default decode is exactly as without them
    if penalties is not None and penalties.active:
        proc = RowProcessors(penalties, prompts, num_generations, logits.size(-1), stops, device)
    rows = torch.arange(B, device=device)   # the rows still in the batch (indices into the B outputs)
    done = torch.zeros(B, dtype=torch.bool, device=device)   # over the rows in the batch
    steps = 0
    for t in range(L):
        steps = t + 1
        u = token_uniforms(keys, t) if keys is not None else None
        if proc is not None:
            logits = proc.apply(logits, rows, n_sampled[rows])
        if logits_hook is not None:
            logits = logits_hook(logits, t, rows)
        if on_tokens is not None:
            on_tokens(rows.numel())
        tok, lp = sample_next(logits, temperature, top_k, top_p, generator, u)
        is_fed = tools.feed(t, tok, lp) if tools is not None else None   # overrides tok, lp in place
        out[rows, t], logps[rows, t] = tok, lp
        live = ~done if is_fed is None else ~done & ~is_fed    # rows that sampled this position
        if is_fed is not None:
            fed[:, t] = is_fed
        n_sampled[rows] += live.long()
        if proc is not None:
            proc.record(rows, tok, live, None if is_fed is None else is_fed & ~done)
        no_room = (n_sampled[rows] >= max_new_tokens) | (t == L - 1)   # nothing more can follow this token
        if budgets is not None:
            no_room |= n_sampled[rows] >= budgets[rows]
        is_call = tools.calls(t, out, tok, live & ~no_room) if tools is not None else None
        stop_now = torch.isin(tok, stops) & live
        finished = stop_now | (live & no_room)
        if is_call is not None:
            stop_now, finished = stop_now & ~is_call, finished & ~is_call
        end[rows] = torch.where(finished, t + 1, end[rows])
        stopped[rows] |= stop_now
        done |= finished
        n_done = int(done.sum())
        if n_done == done.numel() or t == L - 1:
            break
        if tools is None and kv_cache.leave_now(cache, n_done, done.numel()):   # (with tools every row stays)
            cache, order = kv_cache.keep(cache, (~done).nonzero().squeeze(1))
            tok, done, rows = tok[order], done[order], rows[order]
            keys = keys[order] if keys is not None else None
        logits = model(tok[:, None], cache=cache)[:, -1]
    out, logps, fed = out[:, :steps], logps[:, :steps], fed[:, :steps]
    valid = torch.arange(steps, device=device)[None, :] < end[:, None]
    sampled = valid & ~fed
    check_finite(logps, sampled)
    G = num_generations
    extra = tools.finish(out, end.clamp(max=steps)) if tools is not None else {}
    return Generation(
        prompt_ids=pre.prompt_ids.repeat_interleave(G, dim=0), prompt_mask=pre.prompt_mask.repeat_interleave(G, dim=0),
        completion_ids=out.masked_fill(~valid, pad_id), completion_mask=sampled,
        sampler_logprobs=logps.masked_fill(~sampled, 0.0), truncated=~stopped,
        tool_mask=valid & fed if tools is not None else None, **extra)
