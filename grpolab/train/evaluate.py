"""Evaluation on held-out problems: greedy accuracy, pass@k (unbiased), maj@k."""

from __future__ import annotations

import functools
from collections import Counter
from fractions import Fraction
from math import comb

import torch

from .. import distributed as dist
from ..config import Config
from ..data.answers import extract_hash_answer, format_number, plain_hash_answer
from ..data.math_answers import parse_completion
from ..envs.reasoning_gym import extract_answer
from ..rewards import get_reward
from ..rewards.combine import TrainerState
from ..rewards.runtime import RewardRuntime
from ..rollout.engine import sample
from ..rollout.keys import completion_keys
from .eval_rewards import reward_means, reward_values, scores_answers

EVAL_SALT = 0x65766C   # 'evl'

def answer_key(completion: str, reward: str, reference: str | None = None) -> str | None:
    """What maj@k votes on: the completion's final answer as the eval reward reads it, numbers in
    canonical form ('0.5' for '#### 1/2' and for \\boxed{\\frac{1}{2}} alike)."""
    if reward == "reasoning_gym":
        return extract_answer(completion, reference)
    if reward != "math_accuracy":
        got = extract_hash_answer(completion)
        return format_number(got) if got is not None else None
    plain = plain_hash_answer(completion)
    if plain is not None:   # math_accuracy decides plain numbers exactly, as the reader does
        return format_number(plain)
    try:
        parsed = parse_completion(completion)
    except Exception:  # noqa: BLE001 - an unparseable sample casts no vote
        return None
    if not parsed:
        return None
    expr = parsed[0]
    if getattr(expr, "is_Rational", False):   # a sympy Integer or Rational: the same key as a plain number
        return format_number(Fraction(int(expr.p), int(expr.q)))
    return str(parsed[-1])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), for n samples with c correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _decode(tokenizer, gen, calls: list | None = None) -> list[str]:
    """Completion texts (tool calls and results inline); with `calls`, each row's tool calls are appended to it."""
    if calls is not None and gen.tool_calls is not None:
        calls += gen.tool_calls
    return [tokenizer.decode(ids) for ids in gen.id_lists()]


def _columns(rows: list[dict] | None, answers: list, reward: str, repeat: int, episodes: list | None = None) -> dict:
    """What the correctness check is called with besides the completions: the answers, and for
    code_exec the prompts and the rows' test columns; each repeated `repeat` times (k samples). The `env`
    check reads each completion's own episode."""
    rep = lambda xs: [x for x in xs for _ in range(repeat)]  # noqa: E731
    if reward == "env":
        return {"prompts": None, "episode": episodes}
    if reward in ("reasoning_gym", "verifiers") and rows is not None:   # the row's own task scores it
        return {"prompts": rep([r["prompt"] for r in rows]), "answer": rep(answers),
                reward: rep([r.get(reward) for r in rows])}
    if reward != "code_exec" or rows is None:
        return {"prompts": None, "answer": rep(answers)}
    keys = ("test", "entry_point", "test_cases", "answer")
    return {"prompts": rep([r["prompt"] for r in rows]), **{k: rep([r.get(k) for r in rows]) for k in keys}}


def score_samples(greedy: list[str], samples: list[str], answers: list[str | int | float], k: int,
                  reward: str = "gsm8k_accuracy", rows: list[dict] | None = None,
                  runtime: RewardRuntime | None = None, episodes: dict | None = None) -> tuple[dict, list[bool]]:
    """Metrics of given completions: greedy accuracy and, when k > 1 (`samples` holds k per
    problem, in order), pass@1..k and maj@k. Returns (metrics, per-problem greedy correctness).

    A completion is correct when the `reward` check gives it 1.0 (for code_exec: passes every test;
    `rows` then supply the prompts and test columns). maj@k votes on the final answers as the
    `reward` check reads them (samples with no answer cast no vote; a tie goes to the answer seen
    first) and counts the problem right when that answer is right; code has no final answer to
    vote on, so code_exec reports no maj@k. `runtime`: code_exec's sandbox (reward.code_exec).
    """
    check = get_reward(reward)
    if reward == "code_exec":
        check = functools.partial(check, runtime=runtime)
    n = len(answers)
    eps = episodes or {}
    greedy_ok = [v == 1.0 for v in check(completions=greedy, **_columns(rows, answers, reward, 1, eps.get("greedy")))]
    out = {"greedy_accuracy": sum(greedy_ok) / n}
    if k > 1:
        ok = [v == 1.0 for v in check(completions=samples, **_columns(rows, answers, reward, k, eps.get("samples")))]
        correct = [int(sum(ok[i * k:(i + 1) * k])) for i in range(n)]
        for j in sorted({1, k} | {x for x in (2, 4) if x < k}):
            out[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct) / n
        if reward in ("code_exec", "env"):   # no final answer to vote on
            return out, greedy_ok
        maj = 0
        for i in range(n):
            keys = [answer_key(s, reward, str(answers[i])) for s in samples[i * k:(i + 1) * k]]
            votes = Counter(a for a in keys if a is not None)
            if votes:
                top = votes.most_common(1)[0][0]   # Counter keeps first-seen order among equal counts
                maj += ok[i * k + keys.index(top)]
        out[f"maj@{k}"] = maj / n
    return out, greedy_ok


def evaluate(model, tokenizer, rows: list[dict], *, k: int = 8, temperature: float = 1.0,
             max_new_tokens: int = 32, batch_size: int = 512, seed: int = 0,
             reward: str = "gsm8k_accuracy", row_ids: list[int] | None = None, tools=None, engine=None,
             runtime: RewardRuntime | None = None, functions: list[str] | None = None,
             state: TrainerState | None = None) -> dict:
    """Greedy accuracy and, with k > 1 samples at `temperature`, pass@1..k and maj@k; with `functions` (reward
    specs, called with `state` as trainer_state), each one's mean on the greedy completions: rewards/<name>/mean
    (eval_rewards.py). Rows without answers under an answer-reading check: no accuracy, no samples.

    `reward` names the correctness check (gsm8k_accuracy or math_accuracy). maj@k takes
    the most common final answer among the k samples and counts it right when the samples
    giving it are right. Returns a metrics dict plus 'samples': one record per problem.
    Sample j of problem i is keyed by (seed, row_ids[i], j) (`row_ids` default 0..n-1): a
    problem gets the same samples whatever the batch size or the split of the problems.
    `tools` (rollout/tool_decode.ToolUse): the model may call tools; the greedy completions' calls per
    completion are reported as `tool_calls_per_completion`.
    `engine` (rollout/vllm_engine.VLLMEngine, holding `model`'s weights): samples in place of the built-in engine.
    """
    row_ids = list(range(len(rows))) if row_ids is None else list(row_ids)
    prompts = [tokenizer.render_prompt(r["prompt"]) for r in rows]
    answers = [r.get("answer") for r in rows]
    stop = tokenizer.stop_ids
    greedy: list[str] = []
    calls: list[list[dict]] = []
    episodes: dict[str, list] = {"greedy": [], "samples": []}   # in an environment: each completion's episode
    bind = (lambda lo, hi: None) if tools is None else (lambda lo, hi: tools.bind(rows[lo:hi]))  # noqa: E731
    rewarded: list[dict] = []   # per problem: its greedy completion's reward per function
    for lo in range(0, len(prompts), batch_size):
        gen = sample(model, prompts[lo:lo + batch_size], engine=engine, num_generations=1,
                     max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=stop, pad_id=tokenizer.pad_id,
                     tools=bind(lo, lo + batch_size))
        texts = _decode(tokenizer, gen, calls)
        greedy += texts
        episodes["greedy"] += gen.episodes or []
        rewarded += reward_values(functions or [], model, tokenizer, rows[lo:lo + batch_size], texts, gen,
                                  runtime=runtime, state=state)
    samples: list[str] = []
    scored = scores_answers(reward, rows)
    if k > 1 and scored:
        per = max(1, batch_size // k)
        for start in range(0, len(prompts), per):
            chunk = prompts[start:start + per]
            ids = torch.tensor(row_ids[start:start + per], dtype=torch.long)
            # salted: eval samples never share keys with the training rollouts of the same seed
            keys = completion_keys(seed ^ EVAL_SALT, ids.repeat_interleave(k), torch.arange(k).repeat(len(chunk)))
            gen = sample(model, chunk, engine=engine, num_generations=k, max_new_tokens=max_new_tokens,
                         temperature=temperature, stop_ids=stop, pad_id=tokenizer.pad_id, keys=keys,
                         tools=bind(start, start + per))
            samples += _decode(tokenizer, gen)
            episodes["samples"] += gen.episodes or []
    out, greedy_ok = score_samples(greedy, samples, answers, k if samples else 1, reward, rows, runtime, episodes) \
        if scored else ({}, [None] * len(rows))
    out.update(reward_means(rewarded))
    if calls:
        out["tool_calls_per_completion"] = sum(map(len, calls)) / max(1, len(calls))
    out["samples"] = _records(rows, greedy, greedy_ok, rewarded, calls, samples, episodes, k)
    return out


def _records(rows: list[dict], greedy: list[str], greedy_ok: list, rewarded: list[dict], calls: list,
             samples: list[str], episodes: dict[str, list], k: int) -> list[dict]:
    """One record per problem: its prompt, answer, greedy completion (scored, rewarded, its tool calls and
    episode) and its k samples."""
    eg, es = episodes["greedy"], episodes["samples"]
    return [{"prompt": r["prompt"], "answer": r.get("answer"), "greedy": g,
             "greedy_correct": None if ok_ is None else bool(ok_),
             **({"greedy_rewards": rewarded[i]} if rewarded[i] else {}),
             **({"greedy_tool_calls": calls[i]} if calls else {}),
             **({"greedy_episode": eg[i]} if eg else {}),
             **({"samples": samples[i * k:(i + 1) * k]} if samples else {}),
             **({"sample_episodes": es[i * k:(i + 1) * k]} if es else {})}
            for i, (r, g, ok_) in enumerate(zip(rows, greedy, greedy_ok))]


def evaluate_ranks(model, tokenizer, rows: list[dict], cfg: Config, world: dist.World, tools=None,
                   engine=None, runtime: RewardRuntime | None = None, functions: list[str] | None = None,
                   state: TrainerState | None = None) -> dict:
    """`evaluate` of the trainer's held-out rows with its eval.* settings (and `functions`' reward means). With
    several ranks each evaluates every N-th problem and the metrics are taken over all of them (every rank gets
    the same numbers)."""
    e = cfg.eval
    ids = list(range(world.rank, len(rows), world.size))   # every N-th problem (all of them in one process)
    res = {"samples": []}
    if ids:
        res = evaluate(model, tokenizer, [rows[i] for i in ids], k=e.k, temperature=e.temperature,
                       max_new_tokens=cfg.rollout.max_new_tokens, batch_size=e.batch_size, seed=cfg.train.seed,
                       reward=e.reward, row_ids=ids, tools=tools, engine=engine, runtime=runtime,
                       functions=functions, state=state)
    samples = res.pop("samples")
    if world.size == 1:
        return res
    recs = dist.unstride(dist.gather_objects(samples))   # every problem's record, in problem order
    k = len(recs[0].get("samples", [])) or 1
    episodes = {"greedy": [r.get("greedy_episode") for r in recs],
                "samples": [x for r in recs for x in r.get("sample_episodes", [])]}
    out, _ = score_samples([r["greedy"] for r in recs], [s for r in recs for s in r.get("samples", [])],
                           [r["answer"] for r in recs], k, e.reward, rows[:len(recs)], runtime, episodes) \
        if scores_answers(e.reward, rows) else ({}, [])
    out.update(reward_means([r.get("greedy_rewards", {}) for r in recs]))
    if "greedy_tool_calls" in recs[0]:
        out["tool_calls_per_completion"] = sum(len(r["greedy_tool_calls"]) for r in recs) / len(recs)
    return out
