"""The request side of a rollout: which prompts come next, the engine calls that sample them, and the
batch their completions make. Every rollout source (rollout/source.py) draws through one of these, so
the prompts' order, the completions' keys and the batch's layout do not depend on which source it is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.schema import RolloutConfig
from ..data.stream import RowStream
from .batch import RolloutBatch
from .generation import Generation
from .keys import completion_keys


@dataclass
class Request:
    """One batch's prompts, for every rank: row indices, their draw numbers (the completions' keys), and
    the prompts' passes before them (the epoch transformers' TrainerState reports)."""
    rows: list[int]
    draws: torch.Tensor
    epoch: float


def rank_share(n: int, rank: int, size: int) -> slice:
    """The prompts of `n` that one of `size` ranks trains on: whole groups, in order."""
    k = n // size
    return slice(rank * k, (rank + 1) * k)


class PromptFeed:
    def __init__(self, rows: list[dict], tokenizer, rollout: RolloutConfig, seed: int, greedy: bool) -> None:
        self.rows, self.tok, self.r, self.seed = rows, tokenizer, rollout, seed
        self.greedy = greedy   # ReMax: each prompt's greedy completion is sampled too (its baseline)
        self.G = rollout.num_generations
        self.stream = RowStream(len(rows), seed, keyed=True)   # the prompts' order

    @property
    def epoch(self) -> float:
        s = self.stream
        return s.epoch + s.index / max(1, s.n)

    def draw(self) -> Request:
        """The next rollout.prompts_per_step prompts (the same on every rank)."""
        epoch, first = self.epoch, self.stream.drawn
        rows = self.stream.next(self.r.prompts_per_step)
        return Request(list(rows), torch.arange(first, first + len(rows)), epoch)

    def calls(self, req: Request) -> list[dict]:
        """The engine calls a request needs (`rollout.engine.sample`'s arguments, the prompts under
        'prompts'): the rollout, and with a greedy-baseline estimator each prompt's greedy completion."""
        r, G = self.r, self.G
        prompts = [self.tok.render_prompt(self.rows[i]["prompt"]) for i in req.rows]
        # each completion's randomness is keyed by (seed, prompt draw, sample): the same completions
        # however the step is split over ranks or workers, and after a resume
        keys = completion_keys(self.seed, req.draws.repeat_interleave(G), torch.arange(G).repeat(len(req.rows)))
        # the penalties shape the rollout's completions, ReMax's greedy baseline too (as verl's rollout config does)
        penalties = dict(repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
                         frequency_penalty=r.frequency_penalty, min_tokens=r.min_tokens)
        calls = [dict(prompts=prompts, num_generations=G, max_new_tokens=r.max_new_tokens,
                      temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                      stop_ids=() if r.ignore_eos else self.tok.stop_ids, pad_id=self.tok.pad_id, keys=keys,
                      **penalties)]
        if self.greedy:
            calls.append(dict(prompts=prompts, num_generations=1, max_new_tokens=r.max_new_tokens, temperature=0.0,
                              stop_ids=self.tok.stop_ids, pad_id=self.tok.pad_id, **penalties))
        return calls

    def rows_per_prompt(self) -> list[int]:
        """Rows each call samples per prompt (the rollout's G, the greedy call's 1)."""
        return [self.G, 1][:2 if self.greedy else 1]

    def batch(self, rows: list[int], gens: list[Generation], version: int) -> RolloutBatch:
        """The batch rewards and the update read: the completions decoded (tool calls and results inline,
        where the model saw them), the rows' columns, the greedy completions."""
        picked = [self.rows[i] for i in rows]
        gen, G = gens[0], self.G
        greedy = gens[1].id_lists() if len(gens) > 1 else None
        completions = [self.tok.decode(ids) for ids in gen.id_lists()]
        keys = [k for k in picked[0] if k != "prompt"]
        columns = {k: [x[k] for x in picked for _ in range(G)] for k in keys}
        if gen.episodes is not None:   # in an environment: each row's episode (the `env` reward reads it)
            columns["episode"] = gen.episodes
        return RolloutBatch(
            gen=gen, group_ids=torch.arange(len(picked)).repeat_interleave(G),
            prompts=[x["prompt"] for x in picked for _ in range(G)], completions=completions,
            columns=columns,
            greedy=None if greedy is None else [self.tok.decode(x) for x in greedy for _ in range(G)],
            greedy_ids=None if greedy is None else [x for x in greedy for _ in range(G)], weight_version=version)

    def state(self) -> dict:
        return self.stream.state()

    def restore(self, state: dict) -> None:
        self.stream.restore(state)
