"""Continuous batching: every request's rows decode together, one token per forward pass.

A request (`Job`) is one prompt and its n choices. Between two steps the batcher lets finished
and cancelled rows leave and admits waiting jobs while the batch has room (`max_batch` rows):
the new prompts are prefilled together (for the lean decoder packed, without padding, continuing
cached prefixes: models/lean_prefill.py, prefix_cache.py), copied to their n rows and joined to the
batch (see kv_cache.py), so a request never waits for another to finish. While rows decode, a step
prefills at most `prefill_chunk` prompt tokens: a longer prompt is prefilled a chunk per step and joins
after its last one, so the running rows are not held up by its whole prefill. Each step samples one token per row
with that row's own settings and randomness, then runs one forward pass over the rows still going.

Randomness is keyed per choice (rollout/keys.py): a choice's t-th token uses a uniform hashed
from (its key, t), so a seeded request gets the same text whatever else is in the batch.

The batcher runs in one thread (`run`); `submit` and `Job.cancel` may be called from any other.
`on_update(job, choice)` is called from the batcher's thread after every token of a choice of a
`live` job (streamed), else when a choice finishes.
"""

from __future__ import annotations

import math
import queue
import secrets
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..models.lean_prefill import packed_prefill
from ..rollout import kv_cache
from ..rollout import logits_processors as lp
from ..rollout.decode_loop import PREFILL_CHUNK
from ..rollout.keys import completion_keys, token_uniforms
from ..rollout.sampling import sample_next
from ..rollout.structured import Constraint, Grammars
from ..utils.padding import pad_sequences
from .prefix_cache import BLOCK, PrefixCache
from .prompt_logprobs import PromptLogprob, prompt_logprobs

# a frame is rebuilt tighter once this many leading columns are padding for every row
SLACK = 32
# a frame grows by at most this many columns at a time (not a whole context's worth per row up front)
GROW = 256
MAX_LOGPROBS = 20
# a temperature below this samples greedily (as vLLM's): logits / 1e-300 overflow float32 to inf, and
# the softmax of infinities is NaN, which drew the vocabulary's last token instead of the best one
GREEDY_BELOW = 1e-5
# a prefill that keeps every position's logits (jobs asking for prompt log-probs) admits jobs while
# jobs × prompt width × vocabulary stays under this many logits (1 GiB in float32); the first always goes
PROMPT_LOGITS = 2**28


class BadSampling(ValueError):
    """A sampling setting out of range; `param` names it (the server's 400, generate's config error)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, checked here for every caller (the server and `grpolab generate`)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                # 0 or -1 (vLLM's "off"): no top-k
    n: int = 1
    stop: tuple[str, ...] = ()    # a string or a list is taken too
    seed: int | None = None
    logprobs: int | None = None   # with log-probs: how many top alternatives per token (0: the chosen only)
    # logits processors (rollout/logits_processors.py), vLLM's semantics; the defaults leave the logits alone
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]); a dict is taken too
    stop_token_ids: tuple[int, ...] = ()   # end a choice at any of these (besides the tokenizer's stop tokens)
    min_tokens: int = 0                    # stop tokens are banned until this many tokens are generated
    presence_penalty: float = 0.0          # [-2, 2]: subtracted once from every token already generated
    frequency_penalty: float = 0.0         # [-2, 2]: subtracted per occurrence in the output so far
    repetition_penalty: float = 1.0        # > 0: tokens of the prompt or the output, divided (>0) / multiplied (<0)
    constraint: Constraint | None = None   # structured output (rollout/structured.py)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        penalty = "must be a finite number in [-2, 2]"
        checks = (
            ("max_tokens", self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            # inf and nan are refused too (JSON's 1e999 parses as inf): a comparison alone lets inf through
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"),
            ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= -1, f"top_k must be >= 0 (0 or -1: no top-k), got {self.top_k}"),
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"),
            ("stop", all(stop), "stop strings must not be empty"),
            ("logit_bias", all(t >= 0 and math.isfinite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias maps token ids (>= 0) to biases in [-100, 100]"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids (>= 0)"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            ("presence_penalty", math.isfinite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty {penalty}, got {self.presence_penalty}"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty {penalty}, got {self.frequency_penalty}"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty}"))
        for param, ok, message in checks:
            if not ok:
                raise BadSampling(param, message)
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether any logits processor applies (rows without one are sampled from the model's logits as they are)."""
        return bool(self.logit_bias or self.min_tokens or self.penalized or self.constraint)

    @property
    def group(self) -> tuple:
        """Rows that share these sample together in one call."""
        return (self.temperature, self.top_k, self.top_p)


@dataclass
class Choice:
    index: int
    key: int
    tokens: list[int] = field(default_factory=list)      # sampled ids, a final stop token included
    logprobs: list[float] = field(default_factory=list)  # of each token, under the model (T = 1)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None                     # "stop" | "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Job:
    """One prompt's request: `n` choices, sampled with `params`. With `prompt_logprobs` (k top
    alternatives, 0: none), the prefill also scores the prompt's own tokens into `prompt_scores`."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, on_update: Callable | None = None,
                 draw: int = 0, live: bool = False, prompt_logprobs: int | None = None) -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.on_update = on_update
        self.live = live   # text after every token (streaming); else only once a choice ends
        self.prompt_logprobs = prompt_logprobs
        self.prompt_scores: list[PromptLogprob | None] | None = None
        self.prefilled_at: float | None = None   # time.monotonic() when its prefill ended (time to first token)
        if params.seed is not None:   # choice j of a seeded job: key of (seed, draw, j)
            keys = completion_keys(params.seed, torch.full((params.n,), draw, dtype=torch.long),
                                   torch.arange(params.n)).tolist()
        else:
            keys = [secrets.randbits(32) for _ in range(params.n)]
        self.choices = [Choice(index=j, key=k) for j, k in enumerate(keys)]
        self.matchers: list | None = None   # structured output: one grammar matcher per choice (the batcher's)
        # packed prefill: the keys and values of the prompt's first tokens, known before its next prefill (a
        # cached prefix, then each chunk's); `started` once looked up in the prefix cache
        self.kv: torch.Tensor | None = None
        self.started = False
        self.cancelled = False
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.cancelled or self.error is not None or all(c.done for c in self.choices)

    def cancel(self) -> None:
        """Stop sampling this job's choices (its rows leave at the next step)."""
        self.cancelled = True


class Batcher:
    def __init__(self, model, tok, *, max_batch: int = 64, context: int, decoder=None,
                 prefix_cache: PrefixCache | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.model, self.tok = model, tok
        self.max_batch, self.context = max_batch, context
        self.prefill_chunk = prefill_chunk   # 0: no limit (chunking applies to the packed prefill only)
        self.decoder = decoder
        self.prefix_cache = prefix_cache   # only with a decoder (its packed prefill fills and reads it)
        self.stop_ids = set(tok.stop_ids)
        self.grammars = Grammars(tok)   # structured output's compiled constraints, for this tokenizer
        self.device = next(model.parameters()).device
        self.pending: queue.Queue[Job] = queue.Queue()
        self._head: Job | None = None   # a job taken from the queue that did not fit yet
        self.rows: list[tuple[Job, Choice]] = []
        self.cache = None
        self.logits: torch.Tensor | None = None
        self.steps = 0
        self._admitting: list[Job] = []   # taken from the queue, not yet in the batch
        self._stop = threading.Event()
        self._waiting_rows = 0   # rows of submitted jobs not yet admitted (the server bounds it)
        self._lock = threading.Lock()

    # ---- the thread's side -------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            self._waiting_rows += job.params.n
        self.pending.put(job)

    @property
    def waiting_rows(self) -> int:
        """Rows submitted and not yet admitted to the batch (cancelled ones count until the batcher drops them)."""
        return self._waiting_rows

    def _left_queue(self, job: Job) -> None:
        with self._lock:
            self._waiting_rows -= job.params.n

    @property
    def running(self) -> int:
        """Rows still decoding (finished rows waiting to be dropped do not count)."""
        return sum(not c.done for _, c in list(self.rows))

    @property
    def waiting(self) -> int:
        return self.pending.qsize() + (self._head is not None)

    def idle(self) -> bool:
        return not self.rows and self._head is None and self.pending.empty()

    def run(self) -> None:
        """Decode until `stop()`; then finish what is in flight (a server drains before it exits)."""
        while not (self._stop.is_set() and self.idle()):
            if self.idle():
                try:
                    self._head = self.pending.get(timeout=0.1)
                except queue.Empty:
                    continue
            try:
                self.step()
            except Exception as e:   # one bad step fails the requests in it, not the server
                traceback.print_exc()
                self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        """Fail every job in the batch or being admitted (their requests get the error); start afresh."""
        jobs = list({id(job): job for job, _ in self.rows}.values()) + self._admitting
        self.rows, self.cache, self.logits, self._admitting = [], None, None, []
        for job in jobs:
            job.error = message
            if job.on_update is not None:
                job.on_update(job, job.choices[0])

    def stop(self) -> None:
        self._stop.set()

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """Admit what fits, sample a token for every row, forward the rows still going."""
        if self._head is not None or not self.pending.empty():   # make room: drop every finished row
            self._keep([i for i, (job, c) in enumerate(self.rows) if not (job.done or c.done)])
        else:
            self._keep([i for i, (job, _) in enumerate(self.rows) if not job.cancelled])
        self._admit()
        if not self.rows:
            return
        tokens = self._sample()
        self.steps += 1
        going = []
        for i, ((job, choice), t) in enumerate(zip(self.rows, tokens.tolist())):
            if not choice.done:
                self._record(job, choice, t)
            if not choice.done:
                going.append(i)
        # Finished rows leave at once from the lean cache (only the rows that fill their places move). The
        # built-in and HF caches copy every row that stays, so there finished rows stay (decoding tokens
        # nobody reads) until a quarter of the batch has finished, or one of them would run past the context.
        dead = len(self.rows) - len(going)
        order = None   # the batch's rows as indices into `tokens`, when some left
        if (not going or kv_cache.leave_now(self.cache, dead, len(self.rows))
                or (dead and int(self.cache.count.max()) >= self.context - 1)):
            order = self._keep(going)
        if self.rows:
            cols = kv_cache.width(self.cache)
            if cols is not None and kv_cache.write_pos(self.cache) >= cols:   # full: grow the frame
                live = max(self._remaining(j, c) for j, c in self.rows if not c.done)
                self.cache = kv_cache.place(self.cache, cols, cols + min(live, GROW))
            self.logits = self._forward((tokens if order is None else tokens[order])[:, None])

    def _forward(self, ids: torch.Tensor, key_valid: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        return self.model(ids, key_valid=key_valid, cache=cache if cache is not None else self.cache,
                          logits_to_keep=1)[:, -1].float()

    def _keep(self, idx: list[int]) -> torch.Tensor | None:
        """Keep the rows `idx`; returns the order they are in now (indices into the old rows; kv_cache.keep
        may move rows), or None when every row stays or none does."""
        if len(idx) == len(self.rows):
            return None
        if not idx:
            self.rows, self.cache, self.logits = [], None, None
            return None
        self.cache, order = kv_cache.keep(self.cache, torch.tensor(idx, device=self.device))
        self.rows = [self.rows[i] for i in order.tolist()]
        self.logits = self.logits[order]
        return order

    def _remaining(self, job: Job, choice: Choice) -> int:
        return job.params.max_tokens - len(choice.tokens)

    def _take(self) -> tuple[list[Job], tuple[Job, int] | None]:
        """The waiting jobs to admit now, first in first out, while they fit the batch's free rows and the
        step's prefill budget; and the job, if any, whose prompt is prefilled only up to a position this step."""
        new: list[Job] = []
        free = self.max_batch - len(self.rows)
        budget = self.prefill_chunk if self.decoder is not None and self.prefill_chunk and self.rows else None
        while True:
            job = self._head
            if job is None:
                try:
                    job = self.pending.get_nowait()
                except queue.Empty:
                    return new, None
            if job.done:   # cancelled while waiting
                self._head, job.kv = None, None
                self._left_queue(job)
                continue
            if (job.params.n > free and (self.rows or new)) or (new and not self._same_prefill(new, job)):
                self._head = job   # waits for rows to leave, or for the next prefill (first in, first out)
                return new, None
            if budget is not None and job.prompt_logprobs is None:
                start = self._start(job)
                need = len(job.prompt_ids) - start
                if need > budget:   # a chunk ending on a block boundary (where the prefix cache can use it)
                    self._head = job
                    end = (start + budget) // BLOCK * BLOCK
                    return new, (job, end) if end > start else None
                budget -= need
            self._head = None
            self._left_queue(job)
            new.append(job)
            free -= job.params.n

    def _start(self, job: Job) -> int:
        """How many of `job`'s prompt tokens have keys and values already (its cached prefix, looked up once,
        and the chunks prefilled so far)."""
        if not job.started:
            job.started = True
            if self.prefix_cache is not None:
                job.kv = self.prefix_cache.lookup(job.prompt_ids)
        return 0 if job.kv is None else job.kv.size(2)

    def _admit(self) -> None:
        new, part = self._take()
        if part is not None and not new:
            self._admitting = [part[0]]
            self._prefill_packed([], None, part)
            self._admitting = []
            return
        if not new:
            return
        self._admitting = new + ([part[0]] if part is not None else [])
        width = max(len(j.prompt_ids) for j in new)
        rows = [(j, c) for j in new for c in j.choices]
        room = min(GROW, max(self._remaining(j, c) for j, c in self.rows + rows if not c.done))
        ids, valid = pad_sequences([j.prompt_ids for j in new], self.tok.pad_id, "left")
        # an empty batch: the new rows' cache is the frame (room to decode); else a prompt-sized one, placed
        cache = kv_cache.new_cache(self.model, len(new), width + (0 if self.rows else room), self.decoder)
        if new[0].prompt_logprobs is None and self.decoder is not None:
            logits = self._prefill_packed(new, cache, part)
        elif new[0].prompt_logprobs is None:
            logits = self._forward(ids.to(self.device), valid.to(self.device), cache)
        else:   # every position's logits: each prompt's scores, then its last position's for sampling
            full = self.model(ids.to(self.device), key_valid=valid.to(self.device), cache=cache, logits_to_keep=0)
            for b, job in enumerate(new):
                job.prompt_scores = prompt_logprobs(full[b, width - len(job.prompt_ids):], job.prompt_ids,
                                                    job.prompt_logprobs)
            logits = full[:, -1].to(torch.float32, copy=True)   # a copy: a view would keep `full` alive
            del full
        now = time.monotonic()
        for job in new:
            job.prefilled_at = now
        if any(j.params.n > 1 for j in new):   # each prompt prefilled once, copied to its n rows
            copies = torch.tensor([i for i, j in enumerate(new) for _ in range(j.params.n)], device=self.device)
            cache, logits = cache.select(copies), logits[copies]
        if not self.rows:
            self.cache, self.rows, self.logits, self._admitting = cache, rows, logits, []
            return
        pos, cols = kv_cache.write_pos(self.cache), kv_cache.width(self.cache)
        used = int(self.cache.count.max())   # real tokens of the longest row (finished ones still here too)
        fits = width <= pos and pos - used < SLACK
        if not fits:   # the frame moved: as far right as the longest row needs (it grows when full)
            pos = max(used, width)
            if cols is not None and not pos + room <= cols <= 2 * (pos + room):   # else the frame is kept
                cols = pos + room
            self.cache = kv_cache.place(self.cache, pos, cols, len(rows), self.max_batch)
        self.cache = kv_cache.join(self.cache, cache, self.max_batch)
        self.rows += rows
        self.logits = torch.cat([self.logits, logits])
        self._admitting = []

    def _prefill_packed(self, new: list[Job], cache, part: tuple[Job, int] | None = None) -> torch.Tensor:
        """Prefill `new`'s prompts without padding (models/lean_prefill.py), continuing what each has already
        (`_start`), into `cache` (`LeanCache.fill`: each prompt ending at the longest's last column); their last
        logits. `part` (job, end): a job also prefilled this step, up to `end`, its keys and values kept on it."""
        jobs = new + ([part[0]] if part is not None else [])
        starts = [self._start(j) for j in jobs]
        ends = [len(j.prompt_ids) for j in new] + ([part[1]] if part is not None else [])
        kvs, logits = packed_prefill(self.decoder, [j.prompt_ids[s:e] for j, s, e in zip(jobs, starts, ends)],
                                     [j.kv for j in jobs])
        if part is not None:
            part[0].kv = kvs[-1]
        for job, kv in zip(new, kvs):
            job.kv = None
            if self.prefix_cache is not None:
                self.prefix_cache.store(job.prompt_ids, kv)
        if new:
            cache.fill(kvs[:len(new)])
        return logits[:len(new)].float()

    def _same_prefill(self, new: list[Job], job: Job) -> bool:
        """Whether `job` joins the prefill of `new`: a prefill keeps either every position's logits (jobs that
        ask for prompt log-probs, within PROMPT_LOGITS) or only the last ones, so the jobs that do not ask
        never run through the other computation, and their tokens do not depend on who else was admitted."""
        if (job.prompt_logprobs is None) != (new[0].prompt_logprobs is None):
            return False
        width = max(len(job.prompt_ids), *(len(j.prompt_ids) for j in new))
        return job.prompt_logprobs is None or (len(new) + 1) * width * self.tok.vocab_size <= PROMPT_LOGITS

    def _processed(self) -> torch.Tensor:
        """The logits to sample from: the model's, with each row's logits processors applied to the rows
        that ask for any (vLLM's order: grammar mask, bias, min_tokens' ban, penalties). Every processor
        is row-wise, so a row's result does not depend on the other rows; rows without one are untouched."""
        want = [i for i, (job, c) in enumerate(self.rows) if job.params.processed and not c.done]
        if not want:
            return self.logits
        V = self.logits.size(-1)
        at = torch.tensor(want, device=self.device)
        rows = [self.rows[i] for i in want]
        x = self.logits[at]
        grammar = [n for n, (job, _) in enumerate(rows) if job.params.constraint is not None]
        allowed = None
        if grammar:
            for job, _ in rows:
                if job.params.constraint is not None and job.matchers is None:
                    job.matchers = [self.grammars.matcher(job.params.constraint) for _ in job.choices]
            allowed = torch.ones(len(rows), V, dtype=torch.bool, device=self.device)
            allowed[grammar] = self.grammars.masks([rows[n][0].matchers[rows[n][1].index] for n in grammar],
                                                   V).to(self.device)
            x = lp.allow_only(x, allowed)
        if any(job.params.logit_bias for job, _ in rows):
            bias = torch.zeros(len(rows), V, device=self.device)
            for n, (job, _) in enumerate(rows):
                for t, b in job.params.logit_bias:
                    if t < V:
                        bias[n, t] = b
            x = lp.add_bias(x, bias)
        early = [n for n, (job, c) in enumerate(rows) if len(c.tokens) < job.params.min_tokens]
        if early:
            banned = torch.zeros(len(rows), V, dtype=torch.bool, device=self.device)
            for n in early:
                job = rows[n][0]
                banned[n, [t for t in self.stop_ids.union(job.params.stop_token_ids) if t < V]] = True
            if allowed is not None:   # a grammar that allows only stop tokens wins (vLLM's rule, too)
                banned &= (allowed & ~banned).any(-1, keepdim=True)
            x = lp.ban(x, banned)
        if any(job.params.penalized for job, _ in rows):
            counts = lp.token_counts([c.tokens for _, c in rows], V, self.device)
            prompt_seen = lp.token_counts([job.prompt_ids if job.params.repetition_penalty != 1 else []
                                           for job, _ in rows], V, self.device) > 0
            per_row = [(job.params.presence_penalty, job.params.frequency_penalty, job.params.repetition_penalty)
                       for job, _ in rows]
            presence, frequency, repetition = torch.tensor(per_row, device=self.device).T
            x = lp.penalize(x, prompt_seen, counts, presence, frequency, repetition)
        logits = self.logits.clone()
        logits[at] = x
        return logits

    def _sample(self) -> torch.Tensor:
        """One token per row: each group of rows with the same settings in one call, with keyed uniforms."""
        keys = torch.tensor([c.key for _, c in self.rows], dtype=torch.long)
        ts = torch.tensor([len(c.tokens) for _, c in self.rows], dtype=torch.long)
        u = token_uniforms(keys, ts)
        logits = self._processed()
        groups: dict[tuple, list[int]] = {}
        for i, (job, _) in enumerate(self.rows):
            groups.setdefault(job.params.group, []).append(i)
        if len(groups) == 1:
            (temperature, top_k, top_p), = groups
            tokens, _ = sample_next(logits, temperature, top_k, top_p, None, u)
        else:
            tokens = torch.empty(len(self.rows), dtype=torch.long, device=self.device)
            for (temperature, top_k, top_p), idx in groups.items():
                at = torch.tensor(idx, device=self.device)
                tokens[at] = sample_next(logits[at], temperature, top_k, top_p, None, u[idx])[0]
        want = [i for i, (job, c) in enumerate(self.rows) if job.params.logprobs is not None and not c.done]
        if want:
            at = torch.tensor(want, device=self.device)
            logp = self.logits[at].log_softmax(-1)
            chosen = logp.gather(-1, tokens[at][:, None]).squeeze(-1).tolist()
            k = max(self.rows[i][0].params.logprobs for i in want)
            top = logp.topk(k, dim=-1) if k else None
            for n, i in enumerate(want):
                job, choice = self.rows[i]
                choice.logprobs.append(chosen[n])
                kk = job.params.logprobs
                choice.top.append(list(zip(top.indices[n, :kk].tolist(), top.values[n, :kk].tolist())) if kk else [])
        return tokens

    def _record(self, job: Job, choice: Choice, token: int) -> None:
        """Append a token; end the choice at a stop token, a stop string or max_tokens."""
        choice.tokens.append(token)
        stopped = token in self.stop_ids or token in job.params.stop_token_ids
        matcher = job.matchers[choice.index] if job.matchers is not None else None
        if matcher is not None and not stopped and not matcher.consume_token(token):
            # cannot happen while the mask holds; if it does, this request fails alone (a 500), not the batch
            job.error = f"structured output: the grammar refused token {token}: {matcher.get_error()}"
            job.cancel()
            if job.on_update is not None:
                job.on_update(job, choice)
            return
        finish = "stop" if stopped else "length" if len(choice.tokens) >= job.params.max_tokens else None
        # the text is decoded only when something reads it: a stream, stop strings, or the end
        if job.live or job.params.stop or finish:
            text = self.tok.decode(choice.tokens[:-1] if finish == "stop" else choice.tokens)
            # search from where the old text could end a stop string (an unfinished character may still change)
            cut = _first_stop(text, job.params.stop, len(choice.text.rstrip("\ufffd")))
            if cut is not None:
                text, finish = text[:cut], "stop"
            choice.text = text
        choice.finish_reason = finish   # last: another thread reads the text once this is set
        if job.on_update is not None and (job.live or choice.done):
            job.on_update(job, choice)


def _first_stop(text: str, stops: tuple[str, ...], before: int) -> int | None:
    """Where the first stop string starts in `text` (searching from where `before` chars of old
    text could still end one), or None."""
    found = [i for s in stops if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing chars of a running choice's text not to stream yet: an incomplete character
    (U+FFFD from a partial UTF-8 sequence), trailing spaces (a tokenizer's clean-up may drop a space
    before the next token, as in " ," -> ","), or the start of a possible stop string."""
    hold = len(text) - len(text.rstrip("\ufffd \t"))
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold
