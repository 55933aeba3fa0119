"""The GPU rollout path: a slotted KV cache, the decode step captured as a CUDA graph per batch bucket,
sampling on the device with the keyed uniforms, and no host synchronisation per token.

On a GPU the eager decode (decode_loop.py) is bound by kernel launches and Python: a small model's step is a
few hundred kernels of microseconds each, every one waiting for the CPU. Here everything a step does
(sample the next token from the logits, record it, stop rows, run the model on it) reads and writes
preallocated tensors at fixed addresses, so it is captured once as a CUDA graph and replayed: one
launch per token. The host looks every `CHECK_EVERY` steps: when every row is done the loop ends, and
when the live rows fit a smaller bucket (a multiple of `rows_per_matmul` rows) they move to its front
and its graph takes over, so finished rows stop costing. Decoding a few steps past the last stop costs
those steps only: a finished row's outputs are masked by its recorded end.

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
from .generation import Generation
from .keys import position_salts, salted_uniforms
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
    rows: int            # slots, a multiple of rows_per_matmul
    T: int               # cache columns
    L: int               # max_new_tokens
    temperature: float
    top_k: int
    top_p: float
    stops: tuple[int, ...]
    keyed: bool
    rows_per_matmul: int
    graphs: bool


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
        self.slot_row = torch.arange(R, device=dev)     # the output row each slot decodes
        self.budget = torch.full((R,), s.L, dtype=torch.long, device=dev)
        self.done = torch.ones(R, dtype=torch.bool, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.salts = position_salts(torch.arange(s.L, device=dev))   # each position's part of the uniforms
        self.stops = torch.tensor(s.stops, dtype=torch.long, device=dev)
        if applies(self.logits, s.temperature, s.top_k, s.top_p, s.keyed):   # fused kernels for a large vocabulary
            self.sample = lambda x, u: keyed_sample(x, s.temperature, u)
        else:
            self.sample = lambda x, u: sample_next(x, s.temperature, s.top_k, s.top_p, None, u)
        # by output row
        self.out_ids = torch.zeros(R, s.L, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(R, s.L, dtype=torch.float32, device=dev)
        self.end = torch.full((R,), s.L, dtype=torch.long, device=dev)
        self.stopped = torch.zeros(R, dtype=torch.bool, device=dev)
        self.buckets = list(range(R, 0, -s.rows_per_matmul))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None                                  # the graphs' memory pool, shared: they never overlap
        self.prefills: dict[tuple[int, int], _Prefill] = {}   # by (padded length, samples per prompt)
        self.last: dict[str, float] = {}   # the last run's seconds: prefill, decode (bench/gpu.py prints them)
        if s.graphs:
            self._capture()

    def _step(self, b: int) -> None:
        """One token for slots [0, b): sample from the logits, record, stop, run the model on it."""
        s = self.shape
        t = self.t.expand(b)
        u = salted_uniforms(self.keys[:b], self.salts.index_select(0, self.t)) if s.keyed else None
        tok, lp = self.sample(self.logits[:b], u)
        rows, done = self.slot_row[:b], self.done[:b]
        live = ~done
        at = rows * s.L + t
        self.out_ids.view(-1).index_copy_(0, at, tok)
        self.out_lp.view(-1).index_copy_(0, at, lp)
        stop_now = (tok[:, None] == self.stops).any(-1) & live
        finished = stop_now | (live & (t + 1 >= self.budget[:b]))
        self.end.index_copy_(0, rows, torch.where(finished, t + 1, self.end.index_select(0, rows)))
        self.stopped.index_copy_(0, rows, self.stopped.index_select(0, rows) | stop_now)
        done |= finished
        self.tok[:b] = tok
        self.logits[:b] = decode(self.W, self.cache, self.tok[:b], s.rows_per_matmul)
        self.cache.lens[:b] += (~done).long()   # the rows that go on keep the token just written
        self.t += 1

    def _capture(self) -> None:
        """A graph per bucket, after a warm-up step of each (Triton compiles, cuBLAS picks its kernels)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in self.buckets:
                self.t.zero_()
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        for b in self.buckets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._step(b)
            self.pool = g.pool()
            self.graphs[b] = g

    def _prefill(self, prompt: list[int], first: int, G: int) -> torch.Tensor:
        """Prefill `prompt` into slots [first, first + G): the logits after it (V,). On CUDA each padded
        length's prefill is captured once (after a warm-up with this very prompt, which writes what the
        replay writes again) and replayed: one launch instead of a forward's hundreds."""
        s, dev = self.shape, self.W.device
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
        pre.slots.copy_(torch.arange(first, first + G, device=dev))
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

    def _compact(self, b: int, nb: int) -> None:
        """The live slots of [0, b) move to the front of a bucket of nb slots (done ones fill the rest)."""
        order = torch.argsort(self.done[:b].to(torch.int8), stable=True)[:nb]
        self.cache.compact(order)
        for x in (self.tok, self.logits, self.keys, self.slot_row, self.budget, self.done):
            x[:nb] = x.index_select(0, order)

    def run(self, prompts: list[list[int]], G: int, keys: torch.Tensor | None, budgets: torch.Tensor | None,
            pad_id: int, on_tokens=None) -> Generation:
        s, W = self.shape, self.W
        B, R, dev = len(prompts) * G, s.rows, self.W.device
        W.refresh()
        self.done.fill_(True)
        self.done[:B] = False
        self.t.zero_()
        self.end.fill_(s.L)
        self.stopped.zero_()
        self.out_ids.fill_(pad_id)
        self.out_lp.zero_()
        self.slot_row.copy_(torch.arange(R, device=dev))
        self.keys.zero_()
        if keys is not None:
            self.keys[:B] = keys.to(dev)
        self.budget.fill_(s.L)
        if budgets is not None:
            self.budget[:B] = budgets.to(dev).clamp(max=s.L)
        self.tok.zero_()
        self.cache.lens.zero_()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):   # each prompt alone, its keys and values copied to its G slots
            self.logits[i * G:(i + 1) * G] = self._prefill(p, i * G, G)
        self.cache.lens[:B] = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(G)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)   # once per rollout: the split of its time
        t1 = time.perf_counter()
        b, steps, counted = R, 0, 0
        for t in range(s.L):
            self._replay(b)
            steps = t + 1
            if steps % CHECK_EVERY and steps != s.L:
                continue
            live, sampled = torch.stack([(~self.done[:b]).sum(), self.end[:B].clamp(max=steps).sum()]).tolist()
            if on_tokens is not None:
                on_tokens(sampled - counted)
                counted = sampled
            if live == 0:
                break
            nb = -(-live // s.rows_per_matmul) * s.rows_per_matmul
            if nb < b:
                self._compact(b, nb)
                b = nb
        self.last = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "steps": steps}
        end = self.end[:B]
        valid = torch.arange(steps, device=dev)[None, :] < end[:, None]
        ids, lp = self.out_ids[:B, :steps], self.out_lp[:B, :steps]
        if bool((lp.isnan() & valid).any()):
            raise NonFiniteLogits("the model's next-token probabilities are NaN/inf")
        p_ids, p_mask = pad_sequences(prompts, pad_id, "left")
        return Generation(prompt_ids=p_ids.to(dev).repeat_interleave(G, dim=0),
                          prompt_mask=p_mask.to(dev).repeat_interleave(G, dim=0),
                          completion_ids=ids.masked_fill(~valid, pad_id), completion_mask=valid.clone(),
                          sampler_logprobs=lp.masked_fill(~valid, 0.0), truncated=~self.stopped[:B].clone())


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
             rows_per_matmul: int = ROWS_PER_MATMUL, on_tokens=None) -> Generation:
    """`engine.generate`'s sampling by the slotted decode (`graphs`: CUDA graphs, default on CUDA).
    `budgets` (B,): each row's own token cap (at most max_new_tokens)."""
    dev = next(model.parameters()).device
    graphs = dev.type == "cuda" if graphs is None else graphs
    B = len(prompts) * num_generations
    longest = max(map(len, prompts)) + max_new_tokens
    T = -(-(longest + 1) // T_ROUND) * T_ROUND
    if isinstance(model, GPT):
        T = min(T, model.config.block_size)
    shape = Shape(-(-B // rows_per_matmul) * rows_per_matmul, T, max_new_tokens, float(temperature), int(top_k),
                  float(top_p), tuple(int(i) for i in stop_ids), keys is not None and temperature > 0,
                  rows_per_matmul, graphs)
    with torch.inference_mode(), _nondeterministic_kernels_allowed():
        kept = _DECODERS.setdefault(model, {})
        dec = kept.pop(shape, None)
        if dec is None:
            while len(kept) >= KEEP:
                kept.pop(next(iter(kept)))   # its memory (cache, graphs) goes before the new one's is taken
            dec = SlotDecoder(model, shape)
        kept[shape] = dec   # the most recent last
        return dec.run(prompts, num_generations, keys, budgets, pad_id, on_tokens)
