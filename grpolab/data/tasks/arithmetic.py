"""Synthetic arithmetic word problems, GSM8K-style: one step per line, then '#### <answer>'.

    prompt: "Mia has 7 shells, finds 5 more, gives away 3. How many now?"
    answer: "7+5=12\n12-3=9\n#### 9"

Train and test are disjoint by construction: a problem's split is fixed by a hash of its
text, so no seed or size can put the same problem in both.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

# Terse on purpose: the character model pays for every prompt character in every forward pass.
NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Amy", "Tom"]
ITEMS = ["apples", "shells", "coins", "books", "pens", "stamps", "cards", "eggs", "marbles", "beads"]
ADD = ["finds {n} more", "buys {n} more", "gets {n} more", "is given {n} more"]
SUB = ["gives away {n}", "loses {n}", "sells {n}", "uses {n}"]
MUL = {2: "doubles them", 3: "triples them"}


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs: number of operations per problem and the size of the numbers."""
    min_ops: int = 2
    max_ops: int = 3
    max_operand: int = 10   # starting amount and each added/removed amount are in [1, max_operand]
    max_value: int = 60     # every intermediate result stays in [0, max_value]
    allow_mul: bool = True  # 'doubles'/'triples' steps
    test_fraction: float = 0.1


def split_of(key: str, test_fraction: float) -> str:
    """'test' for a share `test_fraction` of keys (by their SHA-256), else 'train': a key's split never changes."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if h < test_fraction else "train"


def make_problem(rng: random.Random, cfg: ArithmeticConfig) -> dict:
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    value = rng.randint(2, cfg.max_operand)
    start = value
    phrases, steps = [], []
    for _ in range(rng.randint(cfg.min_ops, cfg.max_ops)):
        # only operations that keep the result inside [0, max_value]
        choices = (["add"] if value < cfg.max_value else []) + (["sub"] if value > 0 else []) \
            + (["mul"] if cfg.allow_mul and 0 < value and value * 2 <= cfg.max_value else [])
        op = rng.choice(choices)
        if op == "add":
            n = rng.randint(1, min(cfg.max_operand, cfg.max_value - value))
            phrase, new, line = rng.choice(ADD).format(n=n), value + n, f"{value}+{n}={value + n}"
        elif op == "sub":
            n = rng.randint(1, min(cfg.max_operand, value))
            phrase, new, line = rng.choice(SUB).format(n=n), value - n, f"{value}-{n}={value - n}"
        else:
            n = 3 if value * 3 <= cfg.max_value and rng.random() < 0.5 else 2
            phrase, new, line = MUL[n], value * n, f"{value}*{n}={value * n}"
        phrases.append(phrase)
        steps.append(line)
        value = new
    return {"prompt": f"{name} has {start} {item}, {', '.join(phrases)}. How many now?",
            "answer": "\n".join(steps) + f"\n#### {value}"}


def generate(split: str, n: int, seed: int = 0, cfg: ArithmeticConfig | None = None) -> list[dict]:
    """n distinct problems of `split` ('train' or 'test'), deterministic in (split, n, seed, cfg)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    cfg = cfg or ArithmeticConfig()
    rng = random.Random(f"arithmetic/{split}/{seed}")
    rows, seen = [], set()
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise ValueError(f"could not find {n} distinct {split} problems; raise max_operand or lower n")
        row = make_problem(rng, cfg)
        if row["prompt"] in seen or split_of(row["prompt"], cfg.test_fraction) != split:
            continue
        seen.add(row["prompt"])
        rows.append(row)
    return rows


def bare_answer(row: dict, key: str = "answer") -> dict:
    """The same problem with the worked steps dropped: the answer (column `key`) is just '#### N'."""
    return {**row, key: row[key].rsplit("\n", 1)[-1]}


def with_calculator(row: dict, fraction: float, seed: int = 0, key: str = "answer") -> dict:
    """The row with a seeded `fraction` of its worked steps done by the calculator tool: 'a+b=c' becomes
    '<|call|>calculator a+b<|/call|><|out|>c<|/out|>' (the built-in model's tool-call format; the
    <|out|>...<|/out|> part is what the engine writes at rollout time, and SFT does not train on it)."""
    rng = random.Random(f"calculator/{seed}/{row['prompt']}")
    lines = row[key].split("\n")
    for i, line in enumerate(lines[:-1]):
        expr, _, value = line.partition("=")
        if value and rng.random() < fraction:
            lines[i] = f"<|call|>calculator {expr}<|/call|><|out|>{value}<|/out|>"
    return {**row, key: "\n".join(lines)}


def warm_start_mixer(bare_fraction: float, from_step: int = 0, seed: int = 0, key: str = "answer"):
    """SFT batch hook: from step `from_step` on, a seeded `bare_fraction` of answers (column `key`) are
    '#### N' alone.

    The demo's warm start first learns to solve (worked answers only), then, for its last
    steps, learns to often just guess. The greedy model then guesses although it can
    solve; RL has to discover from reward alone that showing the work pays (as real
    LLM RL elicits reasoning the base model rarely volunteers).
    """
    rng = random.Random(f"warm_start/{seed}")

    def mix(batch: list[dict], step: int) -> list[dict]:
        if step < from_step:
            return batch
        return [bare_answer(r, key) if rng.random() < bare_fraction else r for r in batch]
    return mix
