"""A completions choice as the legacy completions API returns it, with `echo` (the prompt returned before
the completion, its tokens scored too) and vLLM's `prompt_logprobs` field.

Legacy `logprobs` (OpenAI's and vLLM's shape): parallel lists over the returned tokens (with echo: the
prompt's, then the completion's) of `tokens` (each token's own text), `token_logprobs`, `top_logprobs`
(the token itself, then the `logprobs` most likely tokens there, as {text: log-prob}) and `text_offset`
(where each token's text starts in the returned `text`). The first prompt token's log-prob and top
entry are null: nothing precedes it. `prompt_logprobs` (vLLM's): one entry per prompt token, null for
the first, else {token id: {"logprob", "rank", "decoded_token"}} for the prompt token, then its top k.
"""

from __future__ import annotations

from dataclasses import dataclass

from .batcher import Choice, Job

# JSON has no infinity: a log-prob of -inf is sent as this (vLLM's and OpenAI's convention)
LOWEST = -9999.0
# a token's text depends on at most this many tokens before it (a split UTF-8 character, a merged space)
WINDOW = 8


@dataclass(frozen=True)
class Echo:
    """What a completions request asked for besides its completions: `texts`, each prompt's text to put
    before its completions (None: no echo); `generate` False when max_tokens is 0 (the prompt alone comes
    back); `prompt_logprobs`, the top-k of vLLM's prompt_logprobs field (None: not asked); `scores`, how
    many alternatives the prefill keeps per prompt token for both (None: the prompt is not scored)."""
    texts: list[str] | None = None
    generate: bool = True
    prompt_logprobs: int | None = None
    scores: int | None = None


def decode_many(tok, seqs: list[list[int]], skip_special: bool) -> list[str]:
    """The text of each id list (a Hugging Face tokenizer decodes them in one call)."""
    if hasattr(tok, "tok"):
        return tok.tok.batch_decode(seqs, skip_special_tokens=skip_special)
    return [tok.decode(s, skip_special) for s in seqs]


def prefix_lengths(tok, ids: list[int], skip_special: bool = True) -> list[int]:
    """len(decode(ids[:i])) for i = 0 .. len(ids): the first WINDOW exactly, each later one as the one before
    it plus how much the text of the WINDOW tokens before token i grows when token i is added (decoding is
    local). The total is checked against the decode of all of `ids`; where they differ, every prefix is
    decoded (quadratic, but exact)."""
    n = len(ids)
    starts = [max(0, i - WINDOW) for i in range(n)]
    texts = decode_many(tok, [ids[s:i] for i, s in enumerate(starts)] + [ids[s:i + 1] for i, s in enumerate(starts)]
                        + [ids], skip_special)
    out = [0]
    for i in range(n):
        out.append(out[-1] + len(texts[n + i]) - len(texts[i]))
    if out[-1] != len(texts[-1]):
        out = [len(t) for t in decode_many(tok, [ids[:i] for i in range(n + 1)], skip_special)]
    return out


def legacy_logprobs(tok, ids: list[int], logprobs: list[float | None], tops: list[list[tuple[int, float]] | None],
                    offsets: list[int]) -> dict:
    """The legacy shape of tokens `ids`, their log-probs (None: unscored), their top alternatives and their
    text offsets. A top entry holds the token first, then the alternatives (a later one of the same text
    overwrites it, as vLLM's does, so max(top) is the best token's log-prob)."""
    memo: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in memo:
            memo[t] = tok.decode([t], skip_special=False)
        return memo[t]

    top_out: list[dict | None] = []
    for t, lp, top in zip(ids, logprobs, tops):
        if lp is None:
            top_out.append(None)
            continue
        entry = {text(t): max(lp, LOWEST)}
        for alt, v in top:
            entry[text(alt)] = max(v, LOWEST)
        top_out.append(entry)
    return {"tokens": [text(t) for t in ids],
            "token_logprobs": [None if v is None else max(v, LOWEST) for v in logprobs],
            "top_logprobs": top_out, "text_offset": offsets}


def prompt_offsets(tok, ids: list[int], text: str) -> list[int]:
    """Where each prompt token starts in the prompt's `text`: decoded with special tokens, less the text of
    any the tokenizer added that `text` lacks (a BOS)."""
    lengths = prefix_lengths(tok, ids, skip_special=False)
    shift = lengths[-1] - len(text) if lengths[-1] > len(text) else 0
    return [max(0, x - shift) for x in lengths[:-1]]


def vllm_prompt_logprobs(tok, job: Job, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs field: per prompt token, null (the first) or {id: {logprob, rank, decoded_token}}
    of the token, then the k most likely there (ranked 1..k)."""
    memo: dict[int, str] = {}

    def entry(t: int, lp: float, rank: int) -> dict:
        if t not in memo:
            memo[t] = tok.decode([t], skip_special=False)
        return {"logprob": max(lp, LOWEST), "rank": rank, "decoded_token": memo[t]}

    out: list[dict | None] = []
    for t, s in zip(job.prompt_ids, job.prompt_scores):
        if s is None:
            out.append(None)
            continue
        d = {str(t): entry(t, s.logprob, s.rank)}
        for r, (alt, v) in enumerate(s.top[:k], 1):
            d.setdefault(str(alt), entry(alt, v, r))
        out.append(d)
    return out


def prompt_part(tok, job: Job, text: str, k: int) -> dict:
    """The legacy log-probs of a job's prompt tokens (k alternatives each), offsets into its `text`."""
    return legacy_logprobs(tok, job.prompt_ids, [None if s is None else s.logprob for s in job.prompt_scores],
                           [None if s is None else s.top[:k] for s in job.prompt_scores],
                           prompt_offsets(tok, job.prompt_ids, text))


def joined(a: dict, b: dict) -> dict:
    """Two legacy log-probs objects as one (b's tokens after a's)."""
    return {key: a[key] + b[key] for key in a}


def echo_chunk(tok, job: Job, echo: Echo, k: int, first: bool, piece: str | None, logprobs: dict | None,
               top: int | None) -> tuple[str | None, dict | None]:
    """A streamed chunk's text and log-probs with echo: the completion's offsets moved past the prompt's
    text, the prompt and its scores before the choice's first piece; with max_tokens 0 the prompt alone."""
    text = echo.texts[k]
    if not echo.generate:
        piece, logprobs = None, None
    elif logprobs is not None:
        logprobs = {**logprobs, "text_offset": [len(text) + o for o in logprobs["text_offset"]]}
    if not first:
        return piece, logprobs
    if top is not None:
        pre = prompt_part(tok, job, text, top)
        logprobs = pre if logprobs is None else joined(pre, logprobs)
    return text + (piece or ""), logprobs


def completion_choice(tok, job: Job, c: Choice, prompt_text: str | None, generate: bool, logprobs: int | None,
                      prompt_k: int | None) -> dict:
    """`text`, `logprobs` (legacy shape, when `logprobs` is not None) and, when `prompt_k` is not None,
    `prompt_logprobs` of one choice; with `prompt_text` (echo) the prompt comes first in both, and with
    `generate` False the prompt alone (max_tokens 0)."""
    completion = c.text if generate else ""
    out: dict = {"text": completion if prompt_text is None else prompt_text + completion, "logprobs": None}
    if logprobs is not None:
        base = 0 if prompt_text is None else len(prompt_text)
        ids = c.tokens[:len(c.logprobs)] if generate else []
        lp = legacy_logprobs(tok, ids, c.logprobs if generate else [], c.top if generate else [],
                             [base + x for x in prefix_lengths(tok, ids)[:-1]])
        out["logprobs"] = lp if prompt_text is None else joined(prompt_part(tok, job, prompt_text, logprobs), lp)
    if prompt_k is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(tok, job, prompt_k)
    return out
