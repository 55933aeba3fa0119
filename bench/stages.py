"""The post-training stages on the built-in arithmetic task, at the demo's scale: what each one does
to held-out accuracy (issue 16's acceptance numbers; docs/stages.md quotes them).

    .venv/bin/python bench/stages.py [--out runs/bench_stages]     # about 8 min on 2 CPU cores

Every run goes through the CLI, as a user would type it:
  1. `grpolab sft` with the defaults: the demo's warm start (same code, same bits), and SFT on
     worked answers only (sft.bare_fraction=0)
  2. `grpolab train` (GRPO, the demo's 60 steps) from the warm start: the teacher below
  3. `grpolab sample --pairs` from the warm start, then `grpolab dpo` on those pairs
  4. `grpolab distill` (logits, forward KL) from the GRPO model into a 2-layer built-in GPT
  5. `grpolab distill` (on_policy) from the GRPO model into a 2-layer warm-started student
Prints one JSON object: the held-out greedy accuracy / pass@1 of each model, the checks, seconds.
Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GRPOLAB = [sys.executable, "-m", "grpolab"]


def run(args: list[str], out: Path) -> tuple[dict, float]:
    t0 = time.perf_counter()
    subprocess.run(GRPOLAB + args + [f"train.output_dir={out}", "log.level=quiet"], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads((out / "eval.json").read_text()), time.perf_counter() - t0


def ckpt(run_dir: Path) -> str:
    return str(max((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1])))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench_stages")
    root = Path(ap.parse_args().out)
    res, secs = {}, {}

    res["warm_start"], secs["sft_warm_start"] = run(["sft"], root / "sft")
    res["sft_worked_answers"], secs["sft_worked"] = run(["sft", "sft.bare_fraction=0"], root / "sft_worked")
    warm = ckpt(root / "sft")
    res["grpo"], secs["grpo"] = run(["train", f"model.init_from={warm}", "train.max_steps=60"], root / "grpo")
    teacher = ckpt(root / "grpo")

    t0 = time.perf_counter()
    pairs = root / "pairs.jsonl"
    subprocess.run(GRPOLAB + ["sample", warm, "--pairs", "--k", "8", "--out", str(pairs), "sample.num_prompts=1024",
                             "log.level=quiet"], check=True, stdout=subprocess.DEVNULL)
    res["dpo"], secs["dpo"] = run(["dpo", f"model.init_from={warm}", f"dpo.pairs={pairs}", "dpo.steps=60"],
                                  root / "dpo")
    secs["dpo"] += time.perf_counter() - t0

    res["distill_logits_2layer"], secs["distill_logits"] = run(
        ["distill", f"distill.teacher={teacher}", "model.n_layer=2", "distill.steps=600"], root / "distill_logits")
    res["student_2layer_warm_start"], secs["sft_2layer"] = run(["sft", "model.n_layer=2"], root / "sft_2layer")
    res["distill_on_policy"], secs["distill_on_policy"] = run(
        ["distill", f"distill.teacher={teacher}", f"model.init_from={ckpt(root / 'sft_2layer')}",
         "distill.mode=on_policy", "distill.steps=60", "distill.lr=3e-4", "distill.warmup_steps=5"],
        root / "distill_on_policy")

    g = {k: v["greedy_accuracy"] for k, v in res.items()}
    checks = {
        "sft_worked_answers >= warm_start": g["sft_worked_answers"] >= g["warm_start"],
        "dpo > its start (warm_start)": g["dpo"] > g["warm_start"],
        "distill_logits_2layer >= 0.8 * teacher (grpo)": g["distill_logits_2layer"] >= 0.8 * g["grpo"],
        "distill_on_policy > its start (student_2layer_warm_start)":
            g["distill_on_policy"] > g["student_2layer_warm_start"],
    }
    print(json.dumps({"greedy_accuracy": g, "pass@1": {k: v.get("pass@1") for k, v in res.items()},
                      "checks": checks, "seconds": {k: round(v, 1) for k, v in secs.items()}}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
