"""The GPU rollout path: a slotted KV cache, the decode step captured as a CUDA graph per batch bucket,
sampling on the device with the keyed uniforms, and no host synchronisation per token.

On a GPU the eager decode (decode_loop.py) is bound by kernel launches and Python: a small model's step is a
few hundred kernels of microseconds each, every one waiting for the CPU. Here everything a step does
(sample the next token from the logits, record it, stop rows, run the model on it) reads and writes
preallocated tensors at fixed addresses, so it is captured once as a CUDA graph and replayed: one
launch per token. The host looks every `CHECK_EVERY` steps: it retires the rows that are done (their tokens
copied out of their slots) and admits waiting rows into the freed slots (a prompt prefilled once into its
group's slots), so a rollout of N rows runs on S < N slots (`max_slots`: vLLM's continuous batching) with the
same completions. Each slot keeps its own position. Once no row waits, the live rows move to the front of a
smaller bucket (a multiple of `rows_per_matmul` rows) when they fit one, and its graph takes over, so finished
rows stop costing. A slot that is done keeps stepping until the next look: it writes past its row's end only.

A row's completion does not depend on the batch around it (the keyed uniforms, plus the kernels of
models/slot_forward.py: the same shapes whoever shares the batch). Each prompt is prefilled alone, padded
to a multiple of `PREFILL_ROUND` tokens, by a graph captured once per padded length.
On a CPU the same code runs eagerly (no graphs): the tests hold it to decode_loop.py's engine there.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..errors import NonFiniteLogits
from ..models.decode_weights import DecodeWeights, decode_weights, unsupported
from ..models.gpt import GPT
from ..models.slot_cache import SlotCache
from ..models.slot_forward import decode, prefill
from ..utils.padding import pad_sequences
from .decode_loop import Penalties
from .generation import Generation
from .keys import position_salts, salted_uniforms
from .logits_processors import token_counts
from .sampling import sample_next
from .sampling_kernels import applies, keyed_sample

# decode rows per matrix product: a batch is padded to a multiple of it. 128 against 64 on an H200, 128 rows,
# fixed lengths: 60.5k against 50.2k tok/s at SmolLM2's shape, 30.3k against 23.6k at the 1.5B shape (each
# weight matrix read once per step instead of twice; bench/results/gpu_h200_run3_profile.jsonl)
ROWS_PER_MATMUL = 128
CHECK_EVERY = 8        # steps between the host's looks at which rows are done
T_ROUND = 128          # cache columns are rounded up to this, so a run's batches share one capture
PREFILL_ROUND = 64     # a prompt is prefilled padded to a multiple of this: one captured prefill per length


@dataclass(frozen=True)
class Shape:
    """What a captured decode depends on besides the weights."""
    rows: int            # slots, a multiple of rows_per_matmul (at least a group's samples)
    T: int               # cache columns
    L: int               # completion positions: max_new_tokens, or with tools or an environment the session's length
    cap: int             # sampled tokens per row (max_new_tokens)
    temperature: float
    top_k: int
    top_p: float
    stops: tuple[int, ...]
    keyed: bool
    rows_per_matmul: int
    graphs: bool
    penalties: Penalties = Penalties()   # vLLM's min_tokens and repetition/presence/frequency penalties
    session: bool = False                # tools or an environment: rows pause at a trigger and are fed replies
    triggers: tuple[int, ...] = ()       # the tokens that end a call or a turn


@dataclass
class _Prefill:
    """The static inputs and output of one prompt's prefill at a padded length, and its graph."""
    ids: torch.Tensor      # (Pp,) the prompt, padded
    last: torch.Tensor     # (1,) the index of its last token
    slots: torch.Tensor    # (G,) the cache rows of its samples
    logits: torch.Tensor   # (V,) the next-token logits after it
    graph: object = None


@contextlib.contextmanager
def _nondeterministic_kernels_allowed():
    """torch's deterministic mode off for the decode: every op here is deterministic as it is (unique
    indices, no atomics), and the mode's sort-based index writes would be captured into every step."""
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(on, warn_only=warn)


class SlotDecoder:
    """One model's decode at one `Shape`: its weights (owned copies, refreshed per rollout), the slot
    cache, the per-slot state and, on CUDA, a graph per bucket."""

    def __init__(self, model, shape: Shape) -> None:
        self.shape = s = shape
        self.W: DecodeWeights = decode_weights(model, s.T)
        W, dev = self.W, self.W.device
        R = s.rows
        self.cache = SlotCache(len(W.layers), R, s.T, W.n_kv, W.head_dim, W.dtype, dev)
        V = W.head.size(0)
        self.logits = torch.zeros(R, V, dtype=W.dtype, device=dev)   # as the head computes them; sampled in float32
        self.tok = torch.zeros(R, dtype=torch.long, device=dev)
        self.keys = torch.zeros(R, dtype=torch.long, device=dev)
        self.budget = torch.full((R,), s.cap, dtype=torch.long, device=dev)   # sampled tokens each slot may add
        self.done = torch.ones(R, dtype=torch.bool, device=dev)
        # the completion position each slot samples next (a done slot stays at its row's end), and the tokens it
        # has sampled (the positions less the fed ones)
        self.pos = torch.zeros(R, dtype=torch.long, device=dev)
        self.n_sampled = torch.zeros(R, dtype=torch.long, device=dev)
        self.salts = position_salts(torch.arange(s.L, device=dev))   # each position's part of the uniforms
        self.stops = torch.tensor(s.stops, dtype=torch.long, device=dev)
        if applies(self.logits, s.temperature, s.top_k, s.top_p, s.keyed):   # fused kernels for a large vocabulary
            self.sample = lambda x, u: keyed_sample(x, s.temperature, u)
        else:
            self.sample = lambda x, u: sample_next(x, s.temperature, s.top_k, s.top_p, None, u)
        # by slot, one spare column: a done slot writes at its end until it is retired
        self.out_ids = torch.zeros(R, s.L + 1, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(R, s.L + 1, dtype=torch.float32, device=dev)
        self.end = torch.full((R,), s.L, dtype=torch.long, device=dev)
        self.stopped = torch.zeros(R, dtype=torch.bool, device=dev)
        self.row_of: list[int] = [-1] * R   # the output row each slot holds (-1: free), on the host
        # with a session: the tokens each slot is fed (a tool's result, an environment's reply) and how far it has
        # got, which positions were fed, and the slots paused at a trigger until the host looks
        self.feed_ids = torch.zeros(R, s.L, dtype=torch.long, device=dev) if s.session else None
        self.feed_at = torch.zeros(R, dtype=torch.long, device=dev)
        self.feed_len = torch.zeros(R, dtype=torch.long, device=dev)
        self.out_fed = torch.zeros(R, s.L + 1, dtype=torch.bool, device=dev) if s.session else None
        self.paused = torch.zeros(R, dtype=torch.bool, device=dev)
        self.triggers = torch.tensor(s.triggers, dtype=torch.long, device=dev)
        # the penalties' state per slot, as decode_loop.RowProcessors keeps it per row: how often the slot's row
        # sampled each token, and the tokens of its prompt (the repetition penalty's); the stop tokens min_tokens bans
        pen = s.penalties
        self.counts = torch.zeros(R, V, device=dev) if pen.penalized else None
        self.seen = torch.zeros(R, V, dtype=torch.bool, device=dev) if pen.penalized else None
        self.banned = torch.zeros(V, dtype=torch.bool, device=dev)
        self.banned[[i for i in s.stops if i < V]] = True
        self.buckets = list(range(R, 0, -s.rows_per_matmul))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None                                  # the graphs' memory pool, shared: they never overlap
        self.prefills: dict[tuple[int, int], _Prefill] = {}   # by (padded length, samples per prompt)
        self.last: dict[str, float] = {}   # the last run's seconds: prefill, decode (bench/gpu.py prints them)
        if s.graphs:
            self._capture()

    def _step(self, b: int) -> None:
        """One token for slots [0, b): sample from the logits (or take the token a slot is fed), record, stop or
        pause, run the model on it."""
        s = self.shape
        pos, done, n = self.pos[:b], self.done[:b], self.n_sampled[:b]
        u = (salted_uniforms(self.keys[:b], self.salts.index_select(0, pos.clamp(max=s.L - 1))) if s.keyed
             else None)
        logits = self._process(self.logits[:b], n) if s.penalties.active else self.logits[:b]
        tok, lp = self.sample(logits, u)
        live = ~done
        slot = torch.arange(b, device=pos.device)
        at = slot * (s.L + 1) + pos
        sampled = live
        if s.session:   # a fed slot takes its next queued token instead of its sample, with log-prob 0
            feeding = live & (self.feed_at[:b] < self.feed_len[:b])
            queued = self.feed_ids[:b].gather(1, self.feed_at[:b].clamp(max=s.L - 1)[:, None]).squeeze(1)
            tok = torch.where(feeding, queued, tok)
            lp = torch.where(feeding, torch.zeros_like(lp), lp)
            self.feed_at[:b] += feeding.long()
            sampled = live & ~feeding
            self.out_fed.view(-1).index_copy_(0, at, feeding)
        if self.counts is not None:   # the tokens the slots sampled, counted (unique indices: capturable)
            V = self.counts.size(1)
            self.counts.view(-1).index_add_(0, slot * V + tok, sampled.float())
            if s.session:   # a fed token joins what the repetition penalty sees
                seen, flat = self.seen.view(-1), slot * V + tok
                fed_seen = feeding & (s.penalties.repetition_penalty != 1)
                seen.index_copy_(0, flat, seen.index_select(0, flat) | fed_seen)
        self.out_ids.view(-1).index_copy_(0, at, tok)
        self.out_lp.view(-1).index_copy_(0, at, lp)
        n += sampled.long()
        no_room = (n >= self.budget[:b]) | (pos + 1 >= s.L)   # nothing more can follow this token
        stop_now = (tok[:, None] == self.stops).any(-1) & sampled
        pause = None
        if s.session:   # a trigger with room left pauses the slot: the host decides whether a call or turn ended
            pause = (tok[:, None] == self.triggers).any(-1) & sampled & ~no_room
            stop_now &= ~pause
        finished = stop_now | (sampled & no_room)
        if s.session:
            finished |= feeding & (pos + 1 >= s.L)
        self.end[:b] = torch.where(finished, pos + 1, self.end[:b])
        self.stopped[:b] |= stop_now
        pos += live.long()
        done |= finished
        self.tok[:b] = tok
        logits = decode(self.W, self.cache, self.tok[:b], s.rows_per_matmul)
        if s.session:   # a paused slot keeps the logits after its trigger and the trigger in its cache
            held = self.paused[:b].clone()
            self.logits[:b] = torch.where(held[:, None], self.logits[:b], logits)
            self.paused[:b] |= pause
            done |= pause
            self.cache.lens[:b] += (~done | pause).long()
        else:
            self.logits[:b] = logits
            self.cache.lens[:b] += (~done).long()   # the rows that go on keep the token just written

    def _process(self, logits: torch.Tensor, n_sampled: torch.Tensor) -> torch.Tensor:
        """decode_loop.RowProcessors.apply on every slot at once, with fixed shapes (a CUDA graph replays it):
        min_tokens' ban, then the penalties over the whole vocabulary, in float32; the same floats."""
        p, b = self.shape.penalties, n_sampled.numel()
        logits = logits.float()
        if p.min_tokens:
            logits = logits.masked_fill((n_sampled < p.min_tokens)[:, None] & self.banned, float("-inf"))
        if p.penalized:
            counts, once = self.counts[:b], (self.counts[:b] > 0)
            r = p.repetition_penalty
            x = torch.where(self.seen[:b] | once, torch.where(logits > 0, logits / r, logits * r), logits)
            logits = x - p.frequency_penalty * counts - p.presence_penalty * once.to(x.dtype)
        return logits

    def _capture(self) -> None:
        """A graph per bucket, after a warm-up step of each (Triton compiles, cuBLAS picks its kernels)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in self.buckets:
                self.pos.zero_()
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        for b in self.buckets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._step(b)
            self.pool = g.pool()
            self.graphs[b] = g

    def _prefill(self, prompt: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Prefill `prompt` into `slots` (G,): the logits after it (V,). On CUDA each padded
        length's prefill is captured once (after a warm-up with this very prompt, which writes what the
        replay writes again) and replayed: one launch instead of a forward's hundreds."""
        s, dev, G = self.shape, self.W.device, slots.numel()
        Pp = min(-(-len(prompt) // PREFILL_ROUND) * PREFILL_ROUND, s.T)
        pre = self.prefills.get((Pp, G))
        new = pre is None
        if new:
            pre = self.prefills[(Pp, G)] = _Prefill(
                torch.zeros(Pp, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                torch.zeros(G, dtype=torch.long, device=dev), torch.zeros_like(self.logits[0]))
        pre.ids.zero_()
        pre.ids[:len(prompt)] = torch.tensor(prompt, device=dev)
        pre.last.fill_(len(prompt) - 1)
        pre.slots.copy_(slots)
        if new and s.graphs:
            pre.graph = self._capture_prefill(pre)
        if pre.graph is None:   # a CPU, or a capture that failed: the same kernels, launched one by one
            pre.logits.copy_(prefill(self.W, pre.ids, pre.last, self.cache, pre.slots))
        else:
            pre.graph.replay()
        return pre.logits

    def _capture_prefill(self, pre: _Prefill):
        """`pre`'s prefill as a graph, after a warm-up; None (with a warning) if it cannot be captured."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefill(self.W, pre.ids, pre.last, self.cache, pre.slots)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool):
                pre.logits.copy_(prefill(self.W, pre.ids, pre.last, self.cache, pre.slots))
        except RuntimeError as e:
            warnings.warn(f"slot decode: the prefill of {pre.ids.numel()} tokens could not be captured as a CUDA "
                          f"graph ({str(e).splitlines()[0][:160]}); it runs eagerly", stacklevel=2)
            return None
        self.pool = g.pool()
        return g

    def _replay(self, b: int) -> None:
        if self.graphs:
            self.graphs[b].replay()
        else:
            self._step(b)

    def _state(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor a compaction moves."""
        return tuple(x for x in (self.tok, self.logits, self.keys, self.budget, self.done, self.pos, self.n_sampled,
                                 self.end, self.stopped, self.out_ids, self.out_lp, self.counts, self.seen,
                                 self.feed_ids, self.feed_at, self.feed_len, self.out_fed, self.paused)
                     if x is not None)

    def _compact(self, held: list[int], nb: int) -> None:
        """The `held` slots (in order) move to the front of a bucket of nb slots."""
        order = torch.tensor(held, dtype=torch.long, device=self.W.device)
        self.cache.compact(order)
        for x in self._state():
            x[:len(held)] = x.index_select(0, order)
        self.done[len(held):nb] = True
        self.row_of = [self.row_of[i] for i in held] + [-1] * (len(self.row_of) - len(held))

    def _resolve(self, b: int, out: dict[str, torch.Tensor], session) -> None:
        """The paused slots of [0, b): the session decides, by row, whether each ended a call or a turn (then its
        reply's tokens are queued in its slot and it resumes), or stops (its trigger a stop token), or goes on."""
        paused = [i for i, x in enumerate(self.paused[:b].tolist()) if x]
        if not paused:
            return
        dev, B = self.W.device, out["ids"].size(0)
        at = torch.tensor(paused, device=dev)
        rows = [self.row_of[i] for i in paused]
        out["ids"].index_copy_(0, torch.tensor(rows, device=dev), self.out_ids.index_select(0, at)[:, :self.shape.L])
        ts = [p - 1 for p in self.pos.index_select(0, at).tolist()]   # the trigger's position
        # the triggers (a paused slot's later steps write only past them, at its frozen position)
        toks = self.out_ids.index_select(0, at).gather(1, torch.tensor(ts, device=dev)[:, None]).squeeze(1)
        stops = set(self.shape.stops)
        for t in sorted(set(ts)):   # rows at one position together, as the eager engine runs them
            mine = [k for k, x in enumerate(ts) if x == t]
            tok = torch.zeros(B, dtype=torch.long, device=dev)
            tok[[rows[k] for k in mine]] = toks[mine]
            cand = torch.zeros(B, dtype=torch.bool, device=dev)
            cand[[rows[k] for k in mine]] = True
            goes_on = session.calls(t, out["ids"], tok, cand).tolist()
            for k in mine:
                i, r = paused[k], rows[k]
                if goes_on[r]:
                    fed = list(session.queues[r])[:self.shape.L]
                    session.queues[r].clear()
                    session.seg_start[r] = t + 1 + len(fed)   # where the next stretch of sampling begins
                    if fed:
                        self.feed_ids[i, :len(fed)] = torch.tensor(fed, device=dev)
                    self.feed_at[i], self.feed_len[i] = 0, len(fed)
                    self.done[i] = False
                elif int(toks[k]) in stops:   # the trigger was a stop token and nothing follows: the row ends
                    self.end[i], self.stopped[i] = t + 1, True
                else:
                    self.done[i] = False
        self.paused[at] = False

    def _retire(self, b: int, out: dict[str, torch.Tensor]) -> int:
        """Copy the done rows of slots [0, b) into `out` (by output row) and free their slots; returns how
        many positions those rows filled."""
        done = self.done[:b].tolist()
        slots = [i for i in range(b) if done[i] and self.row_of[i] >= 0]
        if not slots:
            return 0
        at = torch.tensor(slots, device=self.W.device)
        rows = torch.tensor([self.row_of[i] for i in slots], device=self.W.device)
        L = self.shape.L
        out["ids"].index_copy_(0, rows, self.out_ids.index_select(0, at)[:, :L])
        out["lp"].index_copy_(0, rows, self.out_lp.index_select(0, at)[:, :L])
        out["end"].index_copy_(0, rows, self.end.index_select(0, at))
        out["stopped"].index_copy_(0, rows, self.stopped.index_select(0, at))
        if self.out_fed is not None:
            out["fed"].index_copy_(0, rows, self.out_fed.index_select(0, at)[:, :L])
        for i in slots:
            self.row_of[i] = -1
        return int(self.end.index_select(0, at).sum())

    def _admit(self, prompts: list[list[int]], G: int, waiting: list[int], b: int, keys: torch.Tensor | None,
               budgets: torch.Tensor | None) -> bool:
        """Prefill waiting prompts (their indices, in order) into free slots of [0, b), a whole group at a
        time, while a group fits; admitted prompts leave `waiting`. Whether any was admitted."""
        s, dev = self.shape, self.W.device
        free = [i for i in range(b) if self.row_of[i] < 0]
        admitted = bool(waiting) and len(free) >= G
        while waiting and len(free) >= G:
            p, (slots, free) = waiting.pop(0), (free[:G], free[G:])
            at = torch.tensor(slots, device=dev)
            rows = torch.arange(p * G, (p + 1) * G, device=dev)
            self.logits.index_copy_(0, at, self._prefill(prompts[p], at).expand(G, -1))
            self.keys.index_copy_(0, at, keys.index_select(0, rows) if keys is not None else torch.zeros_like(rows))
            cap = torch.full_like(rows, s.cap)
            self.budget.index_copy_(0, at, budgets.index_select(0, rows).clamp(max=s.cap) if budgets is not None
                                    else cap)
            self.cache.lens.index_fill_(0, at, len(prompts[p]))
            for x, v in ((self.done, False), (self.pos, 0), (self.n_sampled, 0), (self.end, s.L),
                         (self.stopped, False), (self.counts, 0), (self.feed_at, 0), (self.feed_len, 0),
                         (self.paused, False)):
                if x is not None:
                    x.index_fill_(0, at, v)
            if self.seen is not None:   # the prompt's tokens count for the repetition penalty only (the server's rule)
                seen = token_counts([prompts[p]], self.seen.size(1), dev) > 0
                self.seen.index_copy_(0, at, (seen & (s.penalties.repetition_penalty != 1)).expand(G, -1))
            for i, r in zip(slots, range(p * G, (p + 1) * G)):
                self.row_of[i] = r
        return admitted

    def run(self, prompts: list[list[int]], G: int, keys: torch.Tensor | None, budgets: torch.Tensor | None,
            pad_id: int, on_tokens=None, session=None) -> Generation:
        s, W = self.shape, self.W
        B, R, dev = len(prompts) * G, s.rows, self.W.device
        W.refresh()
        self.done.fill_(True)
        self.paused.zero_()
        self.pos.zero_()
        self.tok.zero_()
        self.cache.lens.zero_()
        self.row_of = [-1] * R
        keys = keys.to(dev) if keys is not None else None
        budgets = budgets.to(dev) if budgets is not None else None
        out = {"ids": torch.full((B, s.L), pad_id, dtype=torch.long, device=dev),
               "lp": torch.zeros(B, s.L, dtype=torch.float32, device=dev),
               "end": torch.full((B,), s.L, dtype=torch.long, device=dev),
               "stopped": torch.zeros(B, dtype=torch.bool, device=dev),
               "fed": torch.zeros(B, s.L, dtype=torch.bool, device=dev)}
        waiting = list(range(len(prompts)))
        t0 = time.perf_counter()
        b, steps, counted, retired, prefill_s = R, 0, 0, 0, 0.0
        while True:
            if steps % CHECK_EVERY == 0:   # the host's look: calls and turns, retire, admit, count, shrink
                if session is not None:
                    self._resolve(b, out, session)
                t1 = time.perf_counter()
                retired += self._retire(b, out)
                if waiting and self._admit(prompts, G, waiting, b, keys, budgets) and dev.type == "cuda":
                    torch.cuda.synchronize(dev)   # (the split of the run's time)
                prefill_s += time.perf_counter() - t1
                held = [i for i in range(b) if self.row_of[i] >= 0]
                if on_tokens is not None:   # the retired rows' positions and those the held rows have filled
                    total = retired + int(self.pos.index_select(0, torch.tensor(held, dtype=torch.long,
                                                                                 device=dev)).sum())
                    on_tokens(total - counted)
                    counted = total
                if not held:
                    break
                nb = -(-len(held) // s.rows_per_matmul) * s.rows_per_matmul
                if not waiting and nb < b:
                    self._compact(held, nb)
                    b = nb
            self._replay(b)
            steps += 1
        self.last = {"prefill_s": prefill_s, "decode_s": time.perf_counter() - t0 - prefill_s, "steps": steps}
        end = out["end"]
        width = max(int(end.max()), 1)
        valid = torch.arange(width, device=dev)[None, :] < end[:, None]
        ids, lp = out["ids"][:, :width], out["lp"][:, :width]
        fed = out["fed"][:, :width] & valid
        sampled = valid & ~fed
        if bool((lp.isnan() & sampled).any()):
            raise NonFiniteLogits("the model's next-token probabilities are NaN/inf")
        extra = session.finish(ids, end) if session is not None else {}
        p_ids, p_mask = pad_sequences(prompts, pad_id, "left")
        return Generation(prompt_ids=p_ids.to(dev).repeat_interleave(G, dim=0),
                          prompt_mask=p_mask.to(dev).repeat_interleave(G, dim=0),
                          completion_ids=ids.masked_fill(~valid, pad_id), completion_mask=sampled,
                          sampler_logprobs=lp.masked_fill(~sampled, 0.0), truncated=~out["stopped"],
                          tool_mask=fed if session is not None else None, **extra)


# each model's decoders for the Shapes it last ran (a rollout's shape repeats step after step; an eval's
# alternates with it), the oldest dropped beyond KEEP
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
KEEP = 2


def last_split(model) -> dict[str, float]:
    """The seconds the model's latest slotted decode spent prefilling and decoding, and its steps."""
    kept = _DECODERS.get(model) or {}
    return dict(next(reversed(kept.values())).last) if kept else {}


def why_not(model, prompts: list[list[int]], max_new_tokens: int) -> str | None:
    """Why the slotted decode cannot run this call, or None."""
    longest = max(map(len, prompts)) + max_new_tokens
    if isinstance(model, GPT) and longest > model.config.block_size:
        return f"sequence of {longest} tokens exceeds model.block_size={model.config.block_size}"
    return unsupported(model, longest)


def generate(model, prompts: list[list[int]], *, num_generations: int, max_new_tokens: int, temperature: float,
             top_k: int, top_p: float, stop_ids: tuple[int, ...], pad_id: int, keys: torch.Tensor | None,
             budgets: torch.Tensor | None = None, graphs: bool | None = None,
             rows_per_matmul: int = ROWS_PER_MATMUL, on_tokens=None, max_slots: int | None = None,
             penalties: Penalties = Penalties(), session=None) -> Generation:
    """`engine.generate`'s sampling by the slotted decode (`graphs`: CUDA graphs, default on CUDA).
    `budgets` (B,): each row's own token cap (at most max_new_tokens). `max_slots`: decode at most this many
    rows at once (rounded up to a group and to `rows_per_matmul`), admitting the others as rows finish;
    None: every row at once. The completions are the same either way. `penalties`: applied to every row, as the
    eager engine applies them. `session`: a tool_decode.ToolSession or env_decode.EpisodeSession for these rows
    (the eager engine's `tools`): a row that samples a trigger pauses until the host's next look, which runs the
    calls or steps the episodes and queues the replies, fed to the row as the eager engine feeds them."""
    dev = next(model.parameters()).device
    graphs = dev.type == "cuda" if graphs is None else graphs
    B = len(prompts) * num_generations
    slots = B if max_slots is None else max(min(max_slots, B), num_generations)
    L = session.length if session is not None else max_new_tokens
    longest = max(map(len, prompts)) + L
    T = -(-(longest + 1) // T_ROUND) * T_ROUND
    if isinstance(model, GPT):
        T = min(T, model.config.block_size)
    shape = Shape(rows=-(-slots // rows_per_matmul) * rows_per_matmul, T=T, L=L, cap=min(max_new_tokens, L),
                  temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                  stops=tuple(int(i) for i in stop_ids), keyed=keys is not None and temperature > 0,
                  rows_per_matmul=rows_per_matmul, graphs=graphs, penalties=penalties, session=session is not None,
                  triggers=() if session is None else tuple(int(i) for i in session.triggers.tolist()))
    with torch.inference_mode(), _nondeterministic_kernels_allowed():
        kept = _DECODERS.setdefault(model, {})
        dec = kept.pop(shape, None)
        if dec is None:
            while len(kept) >= KEEP:
                kept.pop(next(iter(kept)))   # its memory (cache, graphs) goes before the new one's is taken
            dec = SlotDecoder(model, shape)
        kept[shape] = dec   # the most recent last
        return dec.run(prompts, num_generations, keys, budgets, pad_id, on_tokens, session)
