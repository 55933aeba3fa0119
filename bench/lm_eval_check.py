"""Accuracy of one model by lm-evaluation-harness and by `grpolab eval`, side by side, on GSM8K (or MATH):
the independent check of the number grpolab's own eval reports.

    .venv/bin/python bench/lm_eval_check.py MODEL_DIR --data DIR [--task gsm8k|math] [--n N]
        [--system-prompt TEXT] [--max-new-tokens T] [--batch-size 16] [--threads 1] [--check-prompts 5] [--out DIR]

    # before training: the base model on the first 250 of the easy GSM8K subset (scripts/gsm8k_easy.py writes it)
    .venv/bin/python bench/lm_eval_check.py models/SmolLM2-135M-Instruct --data data/gsm8k_easy --n 250
    # after: a trained run exported to a plain Hugging Face directory (--merge folds a LoRA run's adapters in)
    .venv/bin/grpolab export --merge runs/RUN/checkpoints/step_N runs/RUN/export
    .venv/bin/python bench/lm_eval_check.py runs/RUN/export --data data/gsm8k_easy --n 250
    # the MATH run (configs/smollm2_math.yaml): its prompt, length and math_accuracy
    .venv/bin/python bench/lm_eval_check.py runs/smollm2_math/export --task math --data data/math_easy --n 250

MODEL_DIR is a Hugging Face model directory (what `grpolab export` writes, or models/SmolLM2-135M-Instruct).
DIR holds the task's rows in test.jsonl: gsm8k {"question", "answer": "... #### 18"}; math {"problem",
"solution": "... \\boxed{10} ..."}. Both tools get the first N test problems, the same system prompt as a
system message before the problem (default: the task's, below), greedy decoding for at most --max-new-tokens
tokens (default gsm8k 200, math 160) ending at the tokenizer's end of turn, the same batch size and torch
thread count, float32 on the CPU, and the same correctness check (gsm8k_accuracy, or math_accuracy):

- lm-eval: its `hf` model (HFLM) through `lm_eval.simple_evaluate` with apply_chat_template and
  system_instruction, on bench/lm_eval_tasks/gsm8k_local.yaml (math_local.yaml) pointed at DIR/test.jsonl,
  scored with grpolab's answer reader (bench/lm_eval_tasks/utils.py says why). For gsm8k, lm-eval's stock
  GSM8K 'strict-match' rule is reported beside it as `strict_match`.
- grpolab: `grpolab eval MODEL_DIR` in a subprocess with eval.k=1 (greedy only) and the same data, keeping
  every prompt as lm-eval does (data.max_prompt_length=0; grpolab's default drops prompts over 512 tokens).

They run one after the other (never at once), each timed from start to end, model loading included. Before
the scores are compared, the prompt token ids of the first --check-prompts problems are checked to be equal:
the ids lm-eval feeds the model (its chat-templated context through its own tokenizer call) against the ids
grpolab's tokenizer renders for the message prompt `grpolab eval` used. Prints one JSON line:

    {"task", "model", "data", "n", ..., "lm_eval": {"version", "accuracy", "se", "strict_match", "seconds"},
     "grpolab": {"accuracy", "se", "seconds"}, "difference", "within_one_se", "same_correctness",
     "same_completion", "prompts_checked", "prompts_equal"}

se = sqrt(p (1 - p) / n); `difference` is lm-eval's accuracy minus grpolab's; `within_one_se`: |difference|
is at most lm-eval's se (at p = 0 or 1 that se is 0 and the scores must be equal). `same_correctness` /
`same_completion`: problems on which the two tools' greedy answers are scored alike / are the same text.
With --out, both tools' per-problem records are kept there (per_problem.jsonl) with grpolab's eval files.

On a busy machine keep --threads 1 (SmolLM2 HF generate, batch 8, 2 cores at load ~6: 0.20 s a step at 1
thread, 0.26 at 2).
A bad argument or a missing file is one line on stderr (`lm_eval_check: error: ...`) and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import yaml

# grpolab before torch (load_hf's module imports it): grpolab sets the OpenMP wait policy torch reads at load
from grpolab.determinism import pin_cpu_numerics
from grpolab.models.hf import load_hf, quiet_hub

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "bench" / "lm_eval_tasks"
SYSTEM_PROMPT = ("You are a helpful assistant. Solve the problem step by step, then give the final answer "
                 "on its own line as '#### <number>'.")


@dataclass(frozen=True)
class Task:
    yaml: str            # the lm-eval task file in bench/lm_eval_tasks/
    question: str        # the column holding the problem
    data: dict           # grpolab's data config for these rows (besides train_path and system_prompt)
    reward: str          # grpolab's eval.reward: the correctness check both tools score with
    system_prompt: str   # defaults of --system-prompt and --max-new-tokens
    max_new_tokens: int
    make_data: str       # how to write the default data directory


TASKS = {
    # the easy GSM8K subset and the '####' answer line
    "gsm8k": Task("gsm8k_local.yaml", "question", {"task": "gsm8k"}, "gsm8k_accuracy", SYSTEM_PROMPT, 200,
                  "python scripts/gsm8k_easy.py writes data/gsm8k_easy"),
    # MATH Levels 1-2 with \boxed{} answers: the prompt and length of configs/smollm2_math.yaml, the GRPO run
    "math": Task("math_local.yaml", "problem",
                 {"task": "files", "prompt_key": "problem", "answer_key": "solution"}, "math_accuracy",
                 "You are a helpful assistant. Solve the problem step by step and put the final answer in \\boxed{}.",
                 160, "make easy-data writes data/math_easy"),
}


class CheckError(Exception):
    """Bad input: reported as one line, exit code 2."""


def standard_error(p: float, n: int) -> float:
    """The standard error of an accuracy p measured on n problems: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1 - p) / n)


def run_grpolab(task: Task, model: Path, data: Path, n: int, system_prompt: str, max_new_tokens: int,
                batch_size: int, threads: int, out: Path) -> tuple[list[dict], float]:
    """`grpolab eval` in its own process, greedy only (eval.k=1): its per-problem records and its seconds."""
    # a config file, not key=value overrides: the system prompt reaches grpolab verbatim, whatever it holds
    config = {"model": {"device": "cpu", "dtype": "float32"},
              # max_prompt_length 0: every prompt is kept, as lm-eval keeps it (the model's context still bounds it)
              "data": {**task.data, "train_path": str(data), "system_prompt": system_prompt, "max_prompt_length": 0},
              "rollout": {"max_new_tokens": max_new_tokens},
              "train": {"threads": threads},
              "eval": {"k": 1, "num_problems": n, "batch_size": batch_size, "reward": task.reward}}
    (out / "lm_eval_check.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "grpolab", "eval", str(model), "--config", str(out / "lm_eval_check.yaml"),
           "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise CheckError(f"grpolab eval failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    with open(out / "eval_samples.jsonl") as f:
        return [json.loads(line) for line in f], seconds


def run_lm_eval(task: Task, model: Path, test_file: Path, n: int, system_prompt: str, max_new_tokens: int,
                batch_size: int) -> tuple[list[dict], float, object]:
    """lm-eval's `hf` model on the task's local file: its per-problem samples (in document order), its
    seconds and the HFLM (for its tokenizer)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(TASK_DIR / task.yaml)   # resolves `!function utils.process_results`
    cfg["dataset_kwargs"]["data_files"]["test"] = str(test_file.resolve())
    cfg["generation_kwargs"]["max_gen_toks"] = max_new_tokens
    start = time.perf_counter()
    with quiet_hub(offline=True):   # the model is on disk: HFLM's model-card lookup must not ask the hub
        lm = HFLM(pretrained=str(model), dtype="float32", device="cpu", batch_size=batch_size)
        # a task manager of this folder only: the default one indexes every built-in task (~20 s)
        tasks = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
        res = simple_evaluate(lm, tasks=[ConfigurableTask(config=cfg)], limit=n, apply_chat_template=True,
                              system_instruction=system_prompt, log_samples=True, task_manager=tasks)
    seconds = time.perf_counter() - start
    samples = sorted(res["samples"][cfg["task"]], key=lambda s: s["doc_id"])
    return samples, seconds, lm


def prompt_ids_equal(model: Path, lm, g_rows: list[dict], l_rows: list[dict], k: int) -> int:
    """How many of the first k problems get the same prompt ids from both tools: lm-eval's ids are its own
    tokenizer call on the context it built (what HFLM.generate_until feeds the model); grpolab's are its
    tokenizer's rendering of the messages `grpolab eval` recorded for that problem."""
    _, tok = load_hf(str(model))
    same = 0
    for g, s in zip(g_rows[:k], l_rows[:k]):
        context = s["arguments"][0][0] if isinstance(s["arguments"][0], (list, tuple)) else s["arguments"][0]
        ids, _ = lm.tok_batch_encode([context])
        same += ids[0].tolist() == tok.render_prompt(g["prompt"])
    return same


def compare(model: Path, data: Path, n: int, task: str = "gsm8k", system_prompt: str | None = None,
            max_new_tokens: int | None = None, batch_size: int = 16, threads: int = 1, check_prompts: int = 5,
            out: Path | None = None) -> dict:
    """Both tools on the first n problems of data/test.jsonl; the result line as a dict. system_prompt and
    max_new_tokens default to the task's."""
    t = TASKS[task]
    system_prompt = t.system_prompt if system_prompt is None else system_prompt
    max_new_tokens = t.max_new_tokens if max_new_tokens is None else max_new_tokens
    test_file = data / "test.jsonl"
    if not (model / "config.json").is_file():
        raise CheckError(f"{model}: not a Hugging Face model directory (no config.json); give one, e.g. what "
                         f"`grpolab export` writes (`grpolab export --merge` for a LoRA run)")
    if not test_file.is_file():
        raise CheckError(f"{data}: no test.jsonl ({task} rows); {t.make_data}")
    for name, value in (("--n", n), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size),
                        ("--threads", threads)):
        if value < 1:
            raise CheckError(f"{name} must be at least 1, got {value}")
    pin_cpu_numerics(threads)   # lm-eval runs in this process; grpolab gets the same count (train.threads)
    with tempfile.TemporaryDirectory() as tmp:
        g_dir = out if out is not None else Path(tmp)
        g_rows, g_seconds = run_grpolab(t, model, data, n, system_prompt, max_new_tokens, batch_size, threads, g_dir)
        l_rows, l_seconds, lm = run_lm_eval(t, model, test_file, n, system_prompt, max_new_tokens, batch_size)
    if len(g_rows) != len(l_rows):
        raise CheckError(f"grpolab evaluated {len(g_rows)} problems, lm-eval {len(l_rows)} (grpolab drops prompts "
                         f"that leave no room for --max-new-tokens in the model's context)")
    for i, (g, s) in enumerate(zip(g_rows, l_rows)):
        if g["prompt"][-1]["content"] != s["doc"][t.question]:
            raise CheckError(f"problem {i}: the two tools read different problems (grpolab drops prompts that "
                             f"leave no room for --max-new-tokens in the model's context)")
    checked = min(check_prompts, len(g_rows))
    same_prompts = prompt_ids_equal(model, lm, g_rows, l_rows, checked)
    g_ok = [bool(g["greedy_correct"]) for g in g_rows]
    l_ok = [s["acc"] == 1.0 for s in l_rows]
    l_text = [s["filtered_resps"][0] for s in l_rows]
    count = len(g_rows)
    g_acc, l_acc = sum(g_ok) / count, sum(l_ok) / count
    l_se = standard_error(l_acc, count)
    if out is not None:
        with open(out / "per_problem.jsonl", "w") as f:
            for g, s, ok, text in zip(g_rows, l_rows, l_ok, l_text):
                f.write(json.dumps({"question": s["doc"][t.question], "answer": g["answer"],
                                    "grpolab": g["greedy"], "grpolab_correct": g["greedy_correct"],
                                    "lm_eval": text, "lm_eval_correct": ok}) + "\n")
    return {
        "task": task, "model": str(model), "data": str(test_file), "n": count, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "threads": threads, "system_prompt": system_prompt,
        "lm_eval": {"version": version("lm-eval"), "accuracy": l_acc, "se": l_se,
                    **({"strict_match": sum(s["strict_match"] for s in l_rows) / count} if task == "gsm8k" else {}),
                    "seconds": round(l_seconds, 1)},
        "grpolab": {"accuracy": g_acc, "se": standard_error(g_acc, count), "seconds": round(g_seconds, 1)},
        "difference": l_acc - g_acc,
        "within_one_se": abs(l_acc - g_acc) <= l_se + 1e-12,
        "same_correctness": sum(a == b for a, b in zip(g_ok, l_ok)),
        "same_completion": sum(g["greedy"] == t for g, t in zip(g_rows, l_text)),
        "prompts_checked": checked, "prompts_equal": same_prompts,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lm_eval_check", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="Hugging Face model directory (e.g. what `grpolab export` writes)")
    p.add_argument("--data", type=Path, required=True, help="directory with the task's rows in test.jsonl")
    p.add_argument("--task", choices=sorted(TASKS), default="gsm8k",
                   help="gsm8k ('####' answers, gsm8k_accuracy) or math (\\boxed{} answers, math_accuracy)")
    p.add_argument("--n", type=int, default=500, help="first N test problems (default 500)")
    p.add_argument("--system-prompt", default=None, help="system message before each problem (default: the task's)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="greedy tokens at most (default: the task's, gsm8k 200, math 160)")
    p.add_argument("--batch-size", type=int, default=16, help="problems decoded together, both tools (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, both tools (default 1)")
    p.add_argument("--check-prompts", type=int, default=5, help="problems whose prompt ids are compared (default 5)")
    p.add_argument("--out", type=Path, default=None, help="keep per_problem.jsonl and grpolab's eval files here")
    args = p.parse_args(argv)
    # everything is on disk: the json dataset builder must not ask the network (read when datasets is imported)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("lm_eval_check: error: lm-eval is not installed: .venv/bin/pip install lm-eval==0.4.13",
              file=sys.stderr)
        return 2
    try:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
        result = compare(args.model, args.data, args.n, args.task, args.system_prompt, args.max_new_tokens,
                         args.batch_size, args.threads, args.check_prompts, args.out)
    except (CheckError, OSError) as e:
        print(f"lm_eval_check: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
