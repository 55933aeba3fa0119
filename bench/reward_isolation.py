"""What reward isolation and reward.timeout cost on a realistic batch: 256 completions of 1 KB, with
256 token ids each, 300-character prompts (plain, or chat: a 200-character system message and a user
message), an `answer` column.

    .venv/bin/python bench/reward_isolation.py

Prints, per function call (best of --reps): the copy every reward function gets (combine.own_copy)
next to copy.deepcopy of the same data, and a whole score() of gsm8k_accuracy with the copy and the
timeout watchdog, without the watchdog (timeout 0), and without either.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time

from grpolab.rewards import combine
from grpolab.rewards.calling import TrainerState, as_completions


def best_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(min(times) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--chars", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghij klmnop 0123456789\n") for _ in range(n))

    B = args.batch
    completions = [text(args.chars) for _ in range(B)]
    plain = [text(300) for _ in range(B)]
    chat = [[{"role": "system", "content": text(200)}, {"role": "user", "content": text(300)}] for _ in range(B)]
    ids = [[rng.randrange(50_000) for _ in range(256)] for _ in range(B)]
    cols = {"answer": [text(8) for _ in range(B)]}
    out = {"batch": B, "completion_chars": args.chars}
    for label, prompts in (("plain", plain), ("chat", chat)):
        kwargs = {"prompts": prompts, "completions": as_completions(prompts, completions), "completion_ids": ids,
                  "trainer_state": TrainerState(), **cols}
        out[f"{label}_own_copy_ms"] = best_ms(lambda: combine.own_copy(kwargs), args.reps)
        out[f"{label}_deepcopy_ms"] = best_ms(lambda: copy.deepcopy(kwargs), args.reps)

    def run(timeout: float) -> None:
        combine.score(["gsm8k_accuracy"], None, plain, completions, cols, completion_ids=ids, timeout=timeout)
    out["score_ms"] = best_ms(lambda: run(300), args.reps)
    out["score_no_timeout_ms"] = best_ms(lambda: run(0), args.reps)
    own = combine.own_copy
    combine.own_copy = lambda kwargs: kwargs   # the same call with the functions sharing the caller's objects
    try:
        out["score_no_timeout_no_copy_ms"] = best_ms(lambda: run(0), args.reps)
    finally:
        combine.own_copy = own
    print(json.dumps(out))


if __name__ == "__main__":
    main()
