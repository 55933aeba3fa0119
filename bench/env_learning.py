"""Does SmolLM2-135M-Instruct learn a reasoning-gym task with GRPO + LoRA on this CPU? Held-out accuracy before
and after training, with standard errors, from one config (configs/smollm2_reasoning_gym.yaml by default):

    1. `grpolab eval` of the base model on the held-out problems (greedy, and k samples at the rollout temperature)
    2. `grpolab train` (its wall time is the training's)
    3. `grpolab eval` of the final checkpoint on the same problems with the same sample keys

Accuracy is the task's own scorer == 1.0. sampled accuracy = the mean over problems of the share of k samples
right (pass@1); its standard error is the std of the per-problem shares / sqrt(problems), and the rise's is the
std of the per-problem differences / sqrt(problems) (the same problems before and after: a paired error).

    make smollm2 && pip install 'grpolab[envs]' && python bench/env_learning.py [--config C] [--update]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpolab.config.load import load_config  # noqa: E402
from grpolab.jobs.inputs import load_data  # noqa: E402
from grpolab.rewards import get_reward  # noqa: E402


def cli(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "grpolab.cli", *args], cwd=ROOT, check=True)
    return time.perf_counter() - t0


def per_problem(out: Path, rows: list[dict], check: str) -> tuple[list[float], list[float]]:
    """(greedy right 0/1, share of samples right) per problem, rescored from eval_samples.jsonl."""
    recs = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    fn = get_reward(check)
    greedy = [float(r["greedy_correct"]) for r in recs]
    shares = []
    for r, row in zip(recs, rows):
        k = len(r["samples"])
        cols = {key: [row.get(key)] * k for key in ("answer", check) if key in row}
        shares.append(sum(v == 1.0 for v in fn(completions=r["samples"], **cols)) / k)
    return greedy, shares


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2_reasoning_gym.yaml")
    ap.add_argument("--update", action="store_true", help="write bench/results/env_learning.json")
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    run = Path(cfg.train.output_dir)
    before, after = run.with_name(run.name + "_before"), run.with_name(run.name + "_after")
    eval_before = cli("eval", cfg.model.name_or_path, "--config", args.config, "--out", str(before))
    train = cli("train", args.config, f"train.output_dir={run}", "eval.num_problems=0")
    final = run / "checkpoints" / f"step_{cfg.train.max_steps}"
    cli("eval", str(final), "--config", args.config, "--out", str(after))
    _, rows = load_data(cfg)
    rows = rows[:cfg.eval.num_problems]
    g0, s0 = per_problem(before, rows, cfg.eval.reward)
    g1, s1 = per_problem(after, rows, cfg.eval.reward)
    result = {"command": "python bench/env_learning.py " + " ".join(sys.argv[1:]), "config": args.config,
              "machine": "2-core AMD EPYC (shared), torch CPU, float32", "problems": len(rows),
              "k": cfg.eval.k, "train_seconds": round(train, 1), "eval_seconds": round(eval_before, 1)}
    for name, a, b in (("greedy_accuracy", g0, g1), ("sampled_accuracy", s0, s1)):
        (m0, e0), (m1, e1) = mean_se(a), mean_se(b)
        rise, rise_se = mean_se([y - x for x, y in zip(a, b)])
        result[name] = {"before": round(m0, 4), "before_se": round(e0, 4), "after": round(m1, 4),
                        "after_se": round(e1, 4), "rise": round(rise, 4), "rise_se": round(rise_se, 4),
                        "rise_in_se": round(rise / rise_se, 2) if rise_se else None}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward" in m]
    result["reward_by_step"] = [round(m["reward"], 4) for m in steps]
    print(json.dumps(result, indent=2))
    if args.update:
        (ROOT / "bench/results/env_learning.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
