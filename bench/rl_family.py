"""PPO (critic + GAE) beside GRPO at the demo's settings, and label-free RL (RLIF's self-certainty,
RLPR) on the arithmetic task: held-out greedy accuracy every 10 steps against wall-clock seconds.

    .venv/bin/python bench/rl_family.py [--out runs/bench_rl_family] [--steps 60]   # ~12 min, 2 cores

All runs start from the same warm start (`grpolab sft`, the demo's, bit for bit) and go through the
CLI. Prints one JSON object (per run: steps, seconds, eval curve, final metrics) and writes
docs-ready plots to OUT/rl_family.png. No run of RLIF or RLPR reads a label in its reward:
self_certainty reads only the policy; rlpr reads the reference answer through the policy's
probability of it (the answer is never checked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RUNS = {
    "grpo": [],
    "ppo": ["algorithm.preset=ppo"],
    "rlif_self_certainty": ["reward.functions=[self_certainty]"],
    "rlpr": ["reward.functions=[rlpr]", "algorithm.std_filter_ema=0.9"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench_rl_family")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    root = Path(args.out)
    cli = [sys.executable, "-m", "grpolab"]
    subprocess.run(cli + ["sft", f"train.output_dir={root / 'warm'}", "log.level=quiet"], check=True,
                   stdout=subprocess.DEVNULL)
    warm = root / "warm" / "checkpoints" / "step_600"
    before = json.loads((root / "warm" / "eval.json").read_text())
    out = {"warm_start": before}
    for name, extra in RUNS.items():
        run = root / name
        t0 = time.perf_counter()
        subprocess.run(cli + ["train", f"model.init_from={warm}", f"train.max_steps={args.steps}",
                              "train.eval_every=10", f"train.output_dir={run}", "log.level=quiet", *extra], check=True,
                       stdout=subprocess.DEVNULL)
        secs = time.perf_counter() - t0
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        clock, curve = 0.0, [(0, 0.0, before["greedy_accuracy"])]
        for r in rows:
            clock += r["time/step"]
            if "eval/greedy_accuracy" in r:
                curve.append((r["step"], round(clock, 1), r["eval/greedy_accuracy"]))
        final = json.loads((run / "eval.json").read_text())
        curve.append((args.steps, round(clock, 1), final["greedy_accuracy"]))
        out[name] = {"seconds": round(secs, 1), "train_seconds": round(clock, 1), "curve": curve,
                     "final": {k: final[k] for k in ("greedy_accuracy", "pass@1", "pass@8") if k in final},
                     "reward_first10": sum(r["reward"] for r in rows[:10]) / 10,
                     "reward_last10": sum(r["reward"] for r in rows[-10:]) / 10}
    _plot(out, root / "rl_family.png")
    print(json.dumps(out, indent=2))
    return 0


def _plot(out: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name in ("grpo", "ppo"):
        c = out[name]["curve"]
        left.plot([x[1] for x in c], [x[2] for x in c], marker="o", label=name)
    left.set_title("GRPO vs PPO: held-out greedy accuracy")
    left.set_xlabel("training seconds (time/step summed, evals left out)")
    for name in ("grpo", "rlif_self_certainty", "rlpr"):
        c = out[name]["curve"]
        right.plot([x[0] for x in c], [x[2] for x in c], marker="o", label=name)
    right.set_title("label-free RL: held-out greedy accuracy")
    right.set_xlabel("step")
    for ax in (left, right):
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
