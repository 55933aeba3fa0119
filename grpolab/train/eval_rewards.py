"""The held-out eval's reward means: each training reward function's mean on the eval prompts' greedy completions,
logged as eval/rewards/<name>/mean beside the training's rewards/<name>/mean (TRL scores its eval_dataset with the
reward functions too). The functions are called as in training (rewards/combine.py: the dataset columns by name,
the harness's guards); a function that cannot score the eval rows (a column it needs has no value there, e.g. an
`answer` the eval rows lack) has no eval mean, said once at the start."""

from __future__ import annotations

import contextlib
import math
import random

import torch

from ..errors import RewardError
from ..rewards import reward_names, wants_policy
from ..rewards.combine import TrainerState, check_signatures, score
from ..rewards.intrinsic import PolicyView
from ..rewards.runtime import RewardRuntime

# the correctness checks (eval.reward) that score a completion against the row's reference answer
ANSWER_CHECKS = ("gsm8k_accuracy", "math_accuracy")


def scores_answers(reward: str, rows: list[dict]) -> bool:
    """Whether greedy accuracy, pass@k and maj@k are computed: an answer-reading check needs some row with an
    answer (rows without one would all score 0, which says nothing)."""
    return reward not in ANSWER_CHECKS or any(r.get("answer") is not None for r in rows)


def eval_columns(rows: list[dict], episodes: list | None = None) -> dict[str, list]:
    """The dataset columns the reward functions get for the eval rows, as in training (rollout/prompt_feed.py):
    every column but the prompt, and in an environment each completion's episode."""
    keys = [k for k in (rows[0] if rows else {}) if k != "prompt"]
    cols = {k: [r.get(k) for r in rows] for k in keys}
    if episodes:
        cols["episode"] = episodes
    return cols


def eval_functions(functions: list[str], rows: list[dict]) -> tuple[list[str], list[str]]:
    """(the reward functions that can score these eval rows, a line for each one that cannot and why)."""
    kept, said = [], []
    columns = list(eval_columns(rows[:1]))
    for spec in functions:
        try:
            check_signatures([spec], columns, rows=rows, source="the eval rows")
        except RewardError as e:
            said.append(f"eval: no eval/rewards/{reward_names(functions)[spec]}/mean ({e})")
            continue
        kept.append(spec)
    return kept, said


@contextlib.contextmanager
def _rng_kept():
    """A reward function that draws random numbers in an eval must not move the run's random streams: how often
    the run evaluates (train.eval_every, a safe change on resume) never changes a training step."""
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)


def reward_values(functions: list[str], model, tokenizer, rows: list[dict], completions: list[str], gen, *,
                  runtime: RewardRuntime | None = None, state: TrainerState | None = None) -> list[dict]:
    """Per row, {metric name: its greedy completion's reward (None where the function does not apply)}; `gen`
    (the greedy Generation) gives the completion ids and what intrinsic rewards read."""
    if not functions or not rows:
        return [{} for _ in rows]
    policy = PolicyView(model, tokenizer, gen) if any(wants_policy(f) for f in functions) else None
    with _rng_kept():
        _, cols = score(functions, None, [r["prompt"] for r in rows], completions,
                        eval_columns(rows, gen.episodes), completion_ids=gen.id_lists(),
                        trainer_state=state or TrainerState(), policy=policy, runtime=runtime)
    names = reward_names(functions)
    return [{names[spec]: (None if math.isnan(float(col[i])) else float(col[i])) for spec, col in cols.items()}
            for i in range(len(rows))]


def reward_means(per_row: list[dict]) -> dict[str, float]:
    """{rewards/<name>/mean: mean over the rows where the function applies (NaN where it applies to none)}, as the
    training rows' rewards/<name>/mean."""
    out = {}
    for name in dict.fromkeys(k for r in per_row for k in r):
        vals = [r[name] for r in per_row if r.get(name) is not None]
        out[f"rewards/{name}/mean"] = sum(vals) / len(vals) if vals else float("nan")
    return out
