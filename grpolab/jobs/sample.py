"""Rejection sampling (`grpolab sample`): K completions per training prompt from a checkpoint,
scored by the configured rewards; the accepted ones become SFT rows, or each prompt's best and
worst become a DPO pair.

Sample j of prompt i is keyed by (train.seed, i, j) (rollout/keys.py): the same file however the
prompts are batched, and again after an interrupted run.
"""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import torch

from ..config import Config
from ..models.checkpoint import load_model
from ..monitor.console import Console
from ..rewards import reward_names
from ..rewards.combine import score
from ..rollout.engine import generate
from ..rollout.keys import completion_keys
from ..rollout.tool_decode import build_tool_use
from ..utils.files import write_atomic
from .common import model_device, setup_torch
from .inputs import configure_rewards, fit_prompts, load_data

SAMPLE_SALT = 0x736D706C   # 'smpl': never the keys of the training rollouts of the same seed


def select_accepted(completions: list[str], rewards: list[float], min_reward: float, max_per_prompt: int) -> list[int]:
    """Indices of the completions to keep for one prompt: reward >= min_reward, not empty, best first
    (ties in sampling order), distinct texts, at most max_per_prompt."""
    order = sorted((i for i, r in enumerate(rewards)
                    if not math.isnan(r) and r >= min_reward and completions[i].strip()),
                   key=lambda i: -rewards[i])
    seen, out = set(), []
    for i in order:
        if completions[i] not in seen and len(out) < max_per_prompt:
            seen.add(completions[i])
            out.append(i)
    return out


def select_pair(completions: list[str], rewards: list[float]) -> tuple[int, int] | None:
    """(best, worst) by reward for one prompt (first of equals in sampling order) among the scored,
    non-empty completions; None when they all tie, or fewer than two."""
    scored = [i for i, r in enumerate(rewards) if not math.isnan(r) and completions[i].strip()]
    if len(scored) < 2:
        return None
    best = max(scored, key=lambda i: (rewards[i], -i))
    worst = min(scored, key=lambda i: (rewards[i], i))
    if rewards[best] == rewards[worst] or completions[best] == completions[worst]:
        return None
    return best, worst


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab sample CHECKPOINT --out FILE`: cfg holds --k and --pairs."""
    return run_sample(args.checkpoint, cfg, args.out)


def run_sample(checkpoint: str, cfg: Config, out: str | Path, console: Console | None = None) -> dict:
    """Sample, score, select, write `out` (jsonl, atomically); returns the counts."""
    console = console or Console(level=cfg.log.level)
    setup_torch(cfg)
    sm, r, w = cfg.sample, cfg.rollout, cfg.reward
    model, tok = load_model(checkpoint, dtype=cfg.model.dtype, device=model_device(cfg))
    runtime = configure_rewards(cfg, console)
    rows, _ = load_data(cfg, with_test=False)   # sampling needs no test split
    rows = fit_prompts(cfg, model, tok, rows, console, "train")
    # rollout.tools: samples may call them (SFT masks outputs)
    tools = build_tool_use(cfg.rollout, tok, checkpoint, runtime)
    rows = rows[:sm.num_prompts] if sm.num_prompts else rows
    names = reward_names(w.functions)
    k = sm.k
    per = max(1, sm.batch_size // k)
    records, n_scored, n_correct = [], 0, 0
    console.info(f"sampling {k} completions for each of {len(rows)} prompts from {checkpoint}")
    for start in range(0, len(rows), per):
        chunk = rows[start:start + per]
        ids = torch.arange(start, start + len(chunk))
        keys = completion_keys(cfg.train.seed ^ SAMPLE_SALT, ids.repeat_interleave(k),
                               torch.arange(k).repeat(len(chunk)))
        gen = generate(model, [tok.render_prompt(x["prompt"]) for x in chunk], num_generations=k,
                       max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                       stop_ids=tok.stop_ids, pad_id=tok.pad_id, keys=keys, tools=tools)
        id_lists = gen.id_lists()
        texts = [tok.decode(ids) for ids in id_lists]
        columns = {c: [x[c] for x in chunk for _ in range(k)] for c in chunk[0] if c != "prompt"}
        total, cols = score(w.functions, w.weights, [x["prompt"] for x in chunk for _ in range(k)], texts, columns,
                            completion_ids=id_lists, runtime=runtime)
        for i, row in enumerate(chunk):
            comp = texts[i * k:(i + 1) * k]
            rew = [float(v) for v in total[i * k:(i + 1) * k]]
            n_scored += sum(not math.isnan(v) for v in rew)
            n_correct += sum(v >= sm.min_reward for v in rew if not math.isnan(v))
            per_fn = lambda j: {names.get(s, s): (None if math.isnan(float(c[i * k + j])) else float(c[i * k + j]))  # noqa: E731
                                for s, c in cols.items()}
            extra = {c: row[c] for c in ("answer",) if c in row}
            if sm.pairs:
                pair = select_pair(comp, rew)
                if pair:
                    b, wst = pair
                    records.append({"prompt": row["prompt"], "chosen": comp[b], "rejected": comp[wst],
                                    "chosen_reward": rew[b], "rejected_reward": rew[wst], **extra})
            else:
                for j in select_accepted(comp, rew, sm.min_reward, sm.max_per_prompt):
                    records.append({"prompt": row["prompt"], "completion": comp[j], "reward": rew[j],
                                    "rewards": per_fn(j), **extra})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(rec) + "\n" for rec in records))
    stats = {"prompts": len(rows), "samples": len(rows) * k, "scored": n_scored,
             "reward_at_least_min": n_correct / max(1, n_scored), ("pairs" if sm.pairs else "accepted"): len(records)}
    console.result(f"wrote {len(records)} {'pairs' if sm.pairs else 'rows'} to {out} "
                   f"({n_correct} of {n_scored} samples scored >= {sm.min_reward})")
    return stats
