"""Episodes in an environment, decoded on one token stream per row (envs/environment.py has the contract).

Each row of a rollout is an episode: its prompt is the dataset row's, its first turn is sampled as any
completion. When a row samples its end-of-turn token, the turn's text goes to the row's environment (the rows
that ended a turn at that step together, in threads, each with env.timeout); unless the episode is over, the
reply is rendered once through the chat template (`envs.turns.TurnRenderer`) and fed to the row through the same
forward passes the other rows decode with (fed_rows.py), and the next turn is sampled after it. So the tokens the
trainer scores are the tokens sampled, the reply's tokens sit where the model read them, masked out of the loss
(`tool_mask`), and each sampled token keeps its sampler log-prob.

An episode ends when the environment says done, after env.max_turns turns, or at the episode's token budget
(rollout.max_completion_tokens: sampled and reply tokens; the model's own tokens also stop at
rollout.max_new_tokens): a turn cut by the budget is still stepped, so every turn the model wrote is scored, and
a reply with no room left after it ends the episode there (its record says `cut`). A reply longer than the whole
budget stops the run with one line (no episode could hold it), as does an environment that raises, hangs or
returns a malformed reply (a message role that is not a chat role included) or a non-finite reward, or calls
os._exit (envs/calls.py guards every call, close() and the factory's included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import Config
from ..envs.calls import call_envs
from ..envs.environment import Environment, Reply, check_reply
from ..envs.load import env_factory
from ..envs.turns import TurnRenderer
from ..errors import EnvError
from .fed_rows import FedRows


@dataclass
class EnvUse:
    """An environment for one trainer or evaluation: how episodes are made and bounded, and how replies render."""
    make_env: Callable[[], Environment]
    renderer: TurnRenderer
    name: str = "env"                     # the spec, for messages
    max_turns: int = 4
    max_tokens: int | None = None         # the episode's positions after the prompt (None: max_new_tokens)
    timeout: float = 30.0                 # seconds per reset or step

    def bind(self, rows: list[dict]) -> BoundEnv:
        """The environment for a rollout of these dataset rows (in order; each row's G episodes follow it)."""
        return BoundEnv(self, rows)

    def close(self) -> None:
        pass

    def metrics(self, gen, gather=lambda t: t) -> dict[str, float]:
        """env/turns (per episode), env/done (share the environment ended, not the turn or token limit),
        env/cut (share the token budget ended), env/reply_tokens (the environment's tokens per episode)."""
        turns = gather(torch.tensor([float(e["turns"]) for e in gen.episodes]))
        done = gather(torch.tensor([float(e["done"]) for e in gen.episodes]))
        cut = gather(torch.tensor([float(e["cut"]) for e in gen.episodes]))
        replies = gather(gen.tool_mask.sum(-1).float().cpu())
        return {"env/turns": float(turns.mean()), "env/done": float(done.mean()), "env/cut": float(cut.mean()),
                "env/reply_tokens": float(replies.mean())}


def build_env_use(cfg: Config, tokenizer, model_name: str = "the model") -> EnvUse | None:
    """The configured environment (env.name), or None without one."""
    e = cfg.env
    if e.name is None:
        return None
    return EnvUse(env_factory(e.name), TurnRenderer(tokenizer, model_name), e.name, e.max_turns,
                  cfg.rollout.max_completion_tokens, e.timeout)


@dataclass
class BoundEnv:
    use: EnvUse
    rows: list[dict]

    def session(self, rows: int, max_new_tokens: int, device) -> EpisodeSession:
        return EpisodeSession(self, rows, max_new_tokens, device)


class EpisodeSession(FedRows):
    """One rollout's episodes, driven by decode_loop.decode: each row's environment, turns, rewards and replies."""

    def __init__(self, env: BoundEnv, rows: int, max_new_tokens: int, device) -> None:
        super().__init__(rows, device)
        self.use = env.use
        self.length = env.use.max_tokens or max_new_tokens
        self.triggers = torch.tensor(env.use.renderer.tok.stop_ids, dtype=torch.long, device=device)
        per = rows // max(1, len(env.rows))
        self.rows = [r for r in env.rows for _ in range(per)]
        self.said_done = [False] * rows
        self.envs = self._run("reset", [(i, None) for i in range(rows)])
        self.turns = [0] * rows
        self.rewards: list[list[float]] = [[] for _ in range(rows)]
        self.over = [False] * rows            # done, out of turns, or out of tokens
        self.cut = [False] * rows             # ended by the token budget
        self.stepped_to = [0] * rows          # positions up to here have been stepped

    def calls(self, t: int, out: torch.Tensor, tok: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Among `candidates` (rows that sampled position t with room left), those whose turn ended and whose
        episode goes on: their replies are queued; the (B,) mask of those rows."""
        goes_on = torch.zeros(tok.size(0), dtype=torch.bool, device=tok.device)
        ended = (torch.isin(tok, self.triggers) & candidates).nonzero().squeeze(-1).tolist()
        for i, reply in self._step(out, [(i, t + 1) for i in ended]):
            if self.over[i]:
                continue
            ids = self.use.renderer.render(reply.messages)
            if len(ids) + 1 >= self.length:   # no episode could hold it: the environment and the budget disagree
                raise EnvError(f"environment {self.use.name}: episode {i}'s reply after turn {self.turns[i]} is "
                               f"{len(ids)} tokens, more than the whole episode's rollout.max_completion_tokens="
                               f"{self.length} leaves for a reply and a turn; raise rollout.max_completion_tokens "
                               f"or shorten the environment's replies")
            if t + 1 + len(ids) >= self.length:   # no room left for it and a next turn: the episode ends here
                self.over[i] = self.cut[i] = True
                continue
            self.queues[i].extend(ids)
            goes_on[i] = True
        return goes_on

    def finish(self, out: torch.Tensor, end: torch.Tensor) -> dict:
        """Step the last turn of episodes the budget cut (not yet stepped), close the environments; the
        Generation's fields this session adds: each row's episode record."""
        last = [(i, int(end[i])) for i in range(len(self.envs))
                if not self.over[i] and int(end[i]) > self.stepped_to[i]]
        for _ in self._step(out, last):
            pass
        call_envs(self.use.name, [e.close for e in self.envs], [f"episode {i}, close" for i in range(len(self.envs))],
                  self.use.timeout)
        return {"episodes": [{"turns": self.turns[i], "rewards": list(self.rewards[i]), "reward": sum(self.rewards[i]),
                              "done": self.said_done[i], "cut": self.cut[i]} for i in range(len(self.envs))]}

    def _step(self, out: torch.Tensor, ends: list[tuple[int, int]]) -> list[tuple[int, Reply]]:
        """Step the rows' turns (row, end position) together; the replies, each row's state updated."""
        if not ends:
            return []
        texts = [(i, self.use.renderer.tok.decode(out[i, self.seg_start[i]:e].tolist())) for i, e in ends]
        replies = self._run("step", texts)
        for (i, e), reply in zip(ends, replies):
            self.stepped_to[i] = e
            self.turns[i] += 1
            self.rewards[i].append(reply.reward)
            self.said_done[i] = reply.done
            self.over[i] = reply.done or self.turns[i] >= self.use.max_turns
        return [(i, r) for (i, _), r in zip(ends, replies)]

    def _run(self, what: str, jobs: list[tuple[int, str | None]]) -> list:
        """reset (a new environment per row) or step, for every job at once (envs/calls.py: daemon threads under
        env.timeout, os._exit guarded); EnvError on the first failure, in row order."""
        calls = [(lambda i=i: self._reset(i)) if what == "reset" else (lambda i=i, x=text: self.envs[i].step(x))
                 for i, text in jobs]
        wheres = [f"episode {i}, {what}" + (f" of turn {self.turns[i] + 1}" if what == "step" else "")
                  for i, _ in jobs]
        got = call_envs(self.use.name, calls, wheres, self.use.timeout)
        return got if what == "reset" else [check_reply(r, f"environment {self.use.name}: {w}")
                                            for r, w in zip(got, wheres)]

    def _reset(self, i: int) -> Environment:
        env = self.use.make_env()
        env.reset(self.rows[i])
        return env

