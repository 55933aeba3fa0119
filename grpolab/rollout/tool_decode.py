"""Decoding with tool calls inside the rollout.

Prompts are prefilled as in `engine._decode` (`core.prefill`: in chunks, a group's prompt kept once
where the cache can). All rows decode together, one position per forward pass. When a row
samples the end of a call, the calls of every row that ended one at that step are parsed and run
in parallel (`tools.ToolRunner`), and each row's result tokens are queued. A row with queued tokens
is fed them one per step through the same forward passes the other rows decode with: its sampled
token is overridden, its log-prob recorded as 0 and the position marked as a tool token. So the
result enters the row's KV cache at the positions it will have in the trainer's re-scoring
(contiguous, no gaps), the other rows never wait for it, and sampling resumes after the last one.

Masks: `completion_mask` marks the tokens the policy sampled (up to and including its stop token),
`tool_mask` the tokens tools wrote; both are context for the trainer, only the first gets loss,
KL and entropy. A tool error, an unparsable call or a call over `max_tool_calls` is answered with
an error text the model reads; nothing a tool does stops the rollout.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .core import PREFILL_CHUNK, check_finite, prefill
from .generation import Generation
from .keys import token_uniforms
from .sampling import sample_next
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


def build_tool_use(rollout_cfg, tokenizer, model_name: str = "the model") -> ToolUse | None:
    """The configured tools (rollout.tools), or None when there are none."""
    if not rollout_cfg.tools:
        return None
    tools = load_tools(list(rollout_cfg.tools))
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


def decode_with_tools(model, prompts, num_generations, max_new_tokens, temperature, top_k, top_p, stop_ids,
                      pad_id, generator, keys, tools: ToolUse, prefill_chunk: int = PREFILL_CHUNK) -> Generation:
    device = next(model.parameters()).device
    G = num_generations
    keys = keys.to(device) if keys is not None else None
    L = tools.max_completion_tokens or max_new_tokens   # completion positions: sampled + tool tokens
    pre = prefill(model, prompts, G, L, pad_id, prefill_chunk)
    p_ids, p_mask, cache, logits = pre.prompt_ids, pre.prompt_mask, pre.cache, pre.logits
    B = logits.size(0)

    out = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((B, L), dtype=torch.float32, device=device)
    forced = torch.zeros((B, L), dtype=torch.bool, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)      # sampled a real stop token
    end = torch.full((B,), L, dtype=torch.long, device=device)     # each row's length
    n_sampled = torch.zeros(B, dtype=torch.long, device=device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    triggers = torch.tensor(tools.format.triggers, dtype=torch.long, device=device)
    queues: list[deque] = [deque() for _ in range(B)]
    seg_start = [0] * B                  # where the model's current stretch of writing began
    n_calls = [0] * B
    records: list[list[dict]] = [[] for _ in range(B)]
    steps = 0
    for t in range(L):
        steps = t + 1
        u = token_uniforms(keys, t) if keys is not None else None
        tok, lp = sample_next(logits, temperature, top_k, top_p, generator, u)
        fed = [i for i in range(B) if queues[i]]
        is_fed = torch.zeros(B, dtype=torch.bool, device=device)
        if fed:   # rows reading a tool's result take its next token instead of a sample
            rows = torch.tensor(fed, device=device)
            tok[rows] = torch.tensor([queues[i].popleft() for i in fed], device=device)
            lp[rows] = 0.0
            is_fed[rows] = True
            for i in fed:
                seg_start[i] = t + 1
        out[:, t], logps[:, t], forced[:, t] = tok, lp, is_fed
        live = ~done & ~is_fed                    # rows that sampled this position
        n_sampled += live.long()
        no_room = (n_sampled >= max_new_tokens) | (t == L - 1)   # nothing more can follow this token
        is_call = torch.zeros(B, dtype=torch.bool, device=device)
        ended = (torch.isin(tok, triggers) & live & ~no_room).nonzero().squeeze(-1).tolist()
        if ended:
            found = []
            for i in ended:
                calls = tools.format.calls_in(out[i, seg_start[i]:t + 1].tolist())
                if calls is not None:
                    found.append((i, calls))
            _run_calls(found, tools, n_calls, records, queues)
            for i, _ in found:
                is_call[i] = True
        stop_now = torch.isin(tok, stops) & live & ~is_call
        finished = stop_now | (live & no_room & ~is_call)
        end = torch.where(finished, t + 1, end)
        stopped |= stop_now
        done |= finished
        if bool(done.all()) or t == L - 1:
            break
        logits = model(out[:, t:t + 1], cache=cache)[:, -1]
    out, logps, forced = out[:, :steps], logps[:, :steps], forced[:, :steps]
    valid = torch.arange(steps, device=device)[None, :] < end[:, None]
    sampled = valid & ~forced
    check_finite(logps, sampled)
    return Generation(
        prompt_ids=p_ids.repeat_interleave(G, dim=0), prompt_mask=p_mask.repeat_interleave(G, dim=0),
        completion_ids=out.masked_fill(~valid, pad_id), completion_mask=sampled,
        sampler_logprobs=logps.masked_fill(~sampled, 0.0), truncated=~stopped,
        tool_mask=valid & forced, tool_calls=records)


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
