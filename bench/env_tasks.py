"""SmolLM2-135M-Instruct's base pass@8 on reasoning-gym tasks: where GRPO has signal to learn from (issue 53 asks
for a task with pass@8 between 0.1 and 0.6). Each task is evaluated as `grpolab eval` does, on its held-out rows,
scored by the task's own scorer.

    make smollm2 && pip install 'grpolab[envs]' && python bench/env_tasks.py [--problems 50] [--update]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import fetch_smollm2  # noqa: E402

from grpolab.config.load import config_from_dict  # noqa: E402
from grpolab.jobs.eval import run_eval  # noqa: E402
from grpolab.monitor.console import Console  # noqa: E402

# (task, its config): easy settings of tasks whose answers are short
TASKS = [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2}),
    ("letter_counting", {"min_words": 3, "max_words": 5}),
    ("spell_backward", {"min_word_len": 3, "max_word_len": 5}),
    ("number_sorting", {"min_numbers": 3, "max_numbers": 4}),
    ("word_sequence_reversal", {"min_words": 3, "max_words": 4}),
    ("gcd", {"min_numbers": 2, "max_numbers": 2, "max_value": 50}),
    ("gcd", {"min_numbers": 2, "max_numbers": 2, "max_value": 100}),
    ("lcm", {"min_numbers": 2, "max_numbers": 2, "max_value": 10}),
]


# reasoning-gym's default system prompt (think, then <answer>) gets no tagged answer from this model at all
SYSTEM = "Give only the final answer, inside <answer></answer> tags. Example: <answer>42</answer>"

SUFFIX = "\nWrite the final answer inside <answer></answer>."


def measure(model: str, task: str, task_config: dict, problems: int, max_new_tokens: int, out: Path,
            system: str | None, suffix: str | None, temperature: float) -> dict:
    cfg = config_from_dict({
        "model": {"name_or_path": model},
        "data": {"task": f"reasoning_gym:{task}", "task_config": task_config, "train_size": 200,
                 "test_size": problems, "system_prompt": system, "prompt_suffix": suffix},
        "rollout": {"max_new_tokens": max_new_tokens},
        "reward": {"functions": ["reasoning_gym"]},
        "eval": {"num_problems": problems, "k": 8, "temperature": temperature},
        "log": {"level": "quiet"},
    })
    t0 = time.perf_counter()
    res = run_eval(model, cfg, Console(level="quiet"), out=str(out / task))
    return {"task": task, "task_config": task_config, "system_prompt": system, "prompt_suffix": suffix,
            "problems": len((out / task / "eval_samples.jsonl").read_text().splitlines()),
            "temperature": temperature, "max_new_tokens": max_new_tokens,
            **{k: round(v, 4) for k, v in res.items() if isinstance(v, float)},
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tasks", nargs="*", help="a subset of the task names")
    ap.add_argument("--system", default=SYSTEM, help="the system prompt ('' = reasoning-gym's default)")
    ap.add_argument("--suffix", default=SUFFIX, help="appended to the question ('' = nothing)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--update", action="store_true", help="write bench/results/env_tasks.json")
    args = ap.parse_args()
    model = str(fetch_smollm2.fetch(fetch_smollm2.DEFAULT_OUT))
    out = Path("runs/bench_env_tasks")
    rows = []
    for task, task_config in TASKS:
        if args.tasks and task not in args.tasks:
            continue
        row = measure(model, task, task_config, args.problems, args.max_new_tokens, out / str(len(rows)),
                      args.system or None, args.suffix or None, args.temperature)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.update:
        path = ROOT / "bench/results/env_tasks.json"
        path.write_text(json.dumps({"command": "python bench/env_tasks.py " + " ".join(sys.argv[1:]),
                                    "machine": "2-core AMD EPYC (shared), torch CPU, float32", "rows": rows},
                                   indent=2) + "\n")


if __name__ == "__main__":
    main()
