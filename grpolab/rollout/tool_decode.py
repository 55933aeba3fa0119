"""Decoding with tool calls inside the rollout.

Rows decode in the same loop as without tools (`core.decode`: chunked prefill, a group's prompt kept
once where the cache can, all rows together, one position per forward pass); `ToolSession` is the
tools' part of it. When a row samples the end of a call, the calls of every row that ended one at
that step are parsed and run in parallel (`tools.ToolRunner`), and each row's result tokens are
queued. A row with queued tokens is fed them one per step through the same forward passes the other
rows decode with: its sampled token is overridden, its log-prob recorded as 0 and the position
marked as a tool token. So the result enters the row's KV cache at the positions it will have in the
trainer's re-scoring (contiguous, no gaps), the other rows never wait for it, and sampling resumes
after the last one.

Masks: `completion_mask` marks the tokens the policy sampled (up to and including its stop token),
`tool_mask` the tokens tools wrote; both are context for the trainer, only the first gets loss,
KL and entropy. A tool error, an unparsable call or a call over `max_tool_calls` is answered with
an error text the model reads; nothing a tool does stops the rollout.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..rewards.runtime import RewardRuntime
from .fed_rows import FedRows
from .tool_formats import tool_format
from .tools import CallRecord, ToolRunner, load_tools


@dataclass
class ToolUse:
    """Tools for one trainer or evaluation: the format the model writes calls in and a runner."""
    format: object                       # tool_formats.BuiltinFormat | HermesFormat
    runner: ToolRunner
    max_calls: int = 4                   # calls per completion; more are answered with an error
    max_completion_tokens: int | None = None  # positions the model and tools fill together (None: max_new_tokens)

    def close(self) -> None:
        self.runner.close()

    def bind(self, rows: list[dict]) -> ToolUse:
        """The tools for a rollout of these dataset rows: the same for every row."""
        return self

    def session(self, rows: int, max_new_tokens: int, device) -> ToolSession:
        return ToolSession(self, rows, max_new_tokens, device)

    def metrics(self, gen, gather=lambda t: t) -> dict[str, float]:
        """A rollout's tools/* metrics (`tool_metrics`)."""
        return tool_metrics(gen.tool_calls, list(self.runner.tools), gather)


def build_tool_use(rollout_cfg, tokenizer, model_name: str = "the model",
                   runtime: RewardRuntime | None = None) -> ToolUse | None:
    """The configured tools (rollout.tools), or None when there are none; `runtime`: the sandbox the python
    tool runs its programs in (reward.code_exec's)."""
    if not rollout_cfg.tools:
        return None
    tools = load_tools(list(rollout_cfg.tools), runtime)
    fmt = tool_format(tokenizer, [t.schema for t in tools.values()], model_name)
    runner = ToolRunner(tools, timeout=rollout_cfg.tool_timeout, max_output_chars=rollout_cfg.tool_output_max_chars)
    return ToolUse(fmt, runner, rollout_cfg.max_tool_calls, rollout_cfg.max_completion_tokens)


def tool_metrics(calls: list[list[dict]], names: list[str], gather=lambda t: t) -> dict[str, float]:
    """tools/calls_per_completion, tools/error_rate (errors per call), tools/calls/<name> (per completion).
    `gather`: rows of every rank (distributed.gather_rows)."""
    n = gather(torch.tensor([float(len(c)) for c in calls]))
    err = gather(torch.tensor([float(sum(x["error"] for x in c)) for c in calls]))
    out = {"tools/calls_per_completion": float(n.mean()) if len(n) else 0.0,
           "tools/error_rate": float(err.sum() / n.sum()) if float(n.sum()) else 0.0}
    for name in names:
        k = gather(torch.tensor([float(sum(x["name"] == name for x in c)) for c in calls]))
        out[f"tools/calls/{name}"] = float(k.mean()) if len(k) else 0.0
    return out


class ToolSession(FedRows):
    """One rollout's tool state, driven by `core.decode`: each row's queued result tokens, its calls so
    far and their records, and where its current stretch of writing began."""

    def __init__(self, tools: ToolUse, rows: int, max_new_tokens: int, device) -> None:
        super().__init__(rows, device)
        self.tools = tools
        self.length = tools.max_completion_tokens or max_new_tokens   # positions: sampled + tool tokens
        self.triggers = torch.tensor(tools.format.triggers, dtype=torch.long, device=device)
        self.n_calls = [0] * rows
        self.records: list[list[dict]] = [[] for _ in range(rows)]

    def finish(self, out: torch.Tensor, end: torch.Tensor) -> dict:
        """The Generation's fields this session adds: each row's calls."""
        return {"tool_calls": self.records}

    def calls(self, t: int, out: torch.Tensor, tok: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Among `candidates` (rows that sampled position t with room left), those that ended a call:
        every such call is run now, together, and its result queued; the (B,) mask of those rows."""
        is_call = torch.zeros(tok.size(0), dtype=torch.bool, device=tok.device)
        ended = (torch.isin(tok, self.triggers) & candidates).nonzero().squeeze(-1).tolist()
        if ended:
            found = []
            for i in ended:
                calls = self.tools.format.calls_in(out[i, self.seg_start[i]:t + 1].tolist())
                if calls is not None:
                    found.append((i, calls))
            _run_calls(found, self.tools, self.n_calls, self.records, self.queues)
            for i, _ in found:
                is_call[i] = True
        return is_call


def _run_calls(found: list[tuple[int, list]], tools: ToolUse, n_calls: list[int], records: list[list[dict]],
               queues: list[deque]) -> None:
    """Run the calls of every row in `found` together; queue each row's result tokens."""
    flat, owner = [], []
    over: dict[int, list[CallRecord]] = {}
    for i, calls in found:
        room = max(0, tools.max_calls - n_calls[i])
        for c in calls[:room]:
            flat.append(c)
            owner.append(i)
        if len(calls) > room:   # over the limit: the model is told, and goes on without the result
            over[i] = [CallRecord(c[0] if isinstance(c, tuple) else None, c[1] if isinstance(c, tuple) else None,
                                  f"error: tool call limit reached (rollout.max_tool_calls={tools.max_calls}); "
                                  f"answer without more calls", True) for c in calls[room:]]
        n_calls[i] += len(calls)
    done = tools.runner.run(flat) if flat else []
    per_row: dict[int, list[CallRecord]] = {i: [] for i, _ in found}
    for i, rec in zip(owner, done):
        per_row[i].append(rec)
    for i, recs in per_row.items():
        recs = recs + over.get(i, [])
        records[i].extend(r.to_dict() for r in recs)
        queues[i].extend(tools.format.render(recs))
