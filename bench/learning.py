"""Learning curve of the demo: held-out greedy accuracy against wall-clock seconds.

Runs the real demo pipeline (`grpolab.pipeline.run_demo`, the function behind `grpolab demo`,
with the same config: defaults + overrides) in this process, with `train.eval_every` set so the
GRPO loop evaluates on the held-out split every N steps, and writes the curve:

    .venv/bin/python bench/learning.py [--out runs/bench-learning] [--eval-every 5] [--steps 60]
                                       [--seed 0] [--x wall|train] [key=value ...]

    # smoke test (~1 min): a short warm start and 6 RL steps
    .venv/bin/python bench/learning.py --out runs/bench-learning-smoke --steps 6 --eval-every 2 sft.steps=50

Outputs: OUT/learning_curve.json (every point, the phases, the run's timings) and
OUT/learning_curve.png; the run directory OUT also holds the demo's usual files (metrics.jsonl,
summary.json, report.html, checkpoints/). stdout gets one JSON line (the summary); the demo's
console output goes to stderr.

Points: one per held-out evaluation, i.e. RL step 0 (the warm-started model, the demo's "before"
eval), every `--eval-every` steps during GRPO, and the final step (the demo's "after" eval).
Each point carries greedy accuracy, pass@1 (and the other eval metrics when eval.k > 1) and
two clocks, both in seconds since `run_demo` was called:

  wall_s   wall clock when the evaluation started (the weights it measures are those of that
           moment); it includes setup (data generation, model build), the warm start, the GRPO
           steps, checkpoint saving and the time spent in the *earlier* evaluations.
  train_s  the same minus the time spent in earlier evaluations: the curve as if no evaluations
           had run. Evaluations are the bench's cost, not the method's; --eval-every changes
           wall_s but should barely move train_s.

The plot's x axis is wall_s by default (`--x train` for train_s); the JSON has both.

Where the times come from: metrics.jsonl records per-step durations (time/step and its parts)
but no wall-clock timestamps, no warm-start duration and no evaluation durations, and the step-0
and final evaluations live only in summary.json. So instead of reconstructing the clock from
those, this script wraps three functions for the duration of the run, in this process only
(nothing under grpolab/ is edited): `grpolab.pipeline.train_sft` (warm-start start/end),
`GRPOTrainer.train` (GRPO loop start/end) and `GRPOTrainer.evaluate` (start, end, step and
result of every evaluation). The results are then checked against the pipeline's own records:
the intermediate points against metrics.jsonl's eval/* keys, the first and last against
summary.json's before/after, and the sum of metrics.jsonl's time/step is reported next to the
GRPO time so the per-step overhead (logging, samples, checkpoint) is visible.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from grpolab.config.load import load_config
from grpolab.jobs import train as pipeline
from grpolab.monitor.console import Console
from grpolab.train.grpo import GRPOTrainer

DEFAULT_OUT = "runs/bench-learning"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- timing the real pipeline

class Clock:
    """Timestamps (seconds since `start`) of the warm start, the GRPO loop and every evaluation."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spans: dict[str, list[float]] = {}   # name -> [start_s, end_s]
        self.evals: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0


@contextmanager
def timed_pipeline(clock: Clock) -> Iterator[None]:
    """Wrap train_sft, GRPOTrainer.train and GRPOTrainer.evaluate to record into `clock`; restore after."""
    orig_sft, orig_train, orig_eval = pipeline.train_sft, GRPOTrainer.train, GRPOTrainer.evaluate

    def span(name: str, fn, *args, **kwargs):
        start = clock.now()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.spans[name] = [start, clock.now()]

    def sft(*args, **kwargs):
        return span("warm_start", orig_sft, *args, **kwargs)

    def train(self, *args, **kwargs):
        return span("grpo", orig_train, self, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        start = clock.now()
        res = orig_eval(self, *args, **kwargs)
        end = clock.now()
        clock.evals.append({"step": self.step, "start_s": start, "end_s": end, "metrics": dict(res)})
        log(f"[bench] eval at step {self.step}: greedy {res.get('greedy_accuracy', float('nan')):.3f} "
            f"({end - start:.1f}s, t={end:.0f}s)")
        return res

    pipeline.train_sft, GRPOTrainer.train, GRPOTrainer.evaluate = sft, train, evaluate
    try:
        yield
    finally:
        pipeline.train_sft, GRPOTrainer.train, GRPOTrainer.evaluate = orig_sft, orig_train, orig_eval


def run(out: str, steps: int | None, eval_every: int, seed: int, overrides: list[str]) -> tuple[Clock, dict]:
    """The demo as `grpolab demo` runs it (same config assembly as grpolab/cli.py), timed."""
    overrides = list(overrides) + [f"train.eval_every={eval_every}", f"train.seed={seed}",
                                   f"train.output_dir={out}"]
    if steps is not None:
        overrides.append(f"train.max_steps={steps}")
    cfg = load_config(None, overrides)
    clock = Clock()
    with timed_pipeline(clock):
        summary = pipeline.run_demo(cfg, Console(stream=sys.stderr, level=cfg.log.level))
    clock.spans["total"] = [0.0, clock.now()]
    return clock, summary


# ---------------------------------------------------------------- the curve

def build_points(clock: Clock) -> list[dict]:
    """One point per evaluation, with wall_s and train_s (wall_s minus earlier eval time)."""
    points, eval_so_far = [], 0.0
    for e in clock.evals:
        m = e["metrics"]
        points.append({"step": e["step"], "wall_s": round(e["start_s"], 2),
                       "train_s": round(e["start_s"] - eval_so_far, 2),
                       "eval_s": round(e["end_s"] - e["start_s"], 2),
                       "greedy_accuracy": m.get("greedy_accuracy"), "pass@1": m.get("pass@1"),
                       "metrics": m})
        eval_so_far += e["end_s"] - e["start_s"]
    return points


def check_against_records(run_dir: Path, points: list[dict], summary: dict) -> dict:
    """Compare the recorded points with metrics.jsonl and summary.json; return the step-time sum."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    logged = {r["step"]: r["eval/greedy_accuracy"] for r in rows if "eval/greedy_accuracy" in r}
    mine = {p["step"]: p["greedy_accuracy"] for p in points[1:-1]}
    problems = []
    if logged != mine:
        problems.append(f"intermediate evals differ from metrics.jsonl: {mine} vs {logged}")
    for p, key in ((points[0], "before"), (points[-1], "after")):
        if summary[key].get("greedy_accuracy") != p["greedy_accuracy"]:
            problems.append(f"{key}: {p['greedy_accuracy']} vs summary.json {summary[key]}")
    for msg in problems:
        log(f"[bench] WARNING: {msg}")
    return {"consistent": not problems, "steps_logged": len(rows),
            "sum_time_step_s": round(sum(r.get("time/step", 0.0) for r in rows), 2)}


def phases(clock: Clock) -> list[dict]:
    """setup (data, model) -> warm start (SFT) -> GRPO loop (periodic evals inside) -> after."""
    total = clock.spans["total"][1]
    sft = clock.spans.get("warm_start")
    grpo = clock.spans["grpo"]
    out = []
    if sft:
        out += [{"name": "setup", "start_s": 0.0, "end_s": sft[0]},
                {"name": "warm_start", "start_s": sft[0], "end_s": sft[1]}]
    out += [{"name": "grpo", "start_s": grpo[0], "end_s": grpo[1]},
            {"name": "final_eval_and_report", "start_s": grpo[1], "end_s": total}]
    return [{**p, "start_s": round(p["start_s"], 2), "end_s": round(p["end_s"], 2)} for p in out]


def to_train_s(wall: float, points: list[dict]) -> float:
    """A wall-clock time on the train_s clock: minus the evaluation time spent before it."""
    spent = sum(min(p["eval_s"], max(0.0, wall - p["wall_s"])) for p in points)
    return round(wall - spent, 2)


def plot(path: Path, points: list[dict], phase_list: list[dict], x_key: str, title: str) -> None:
    """Greedy accuracy (and pass@1) vs seconds, with the warm start and GRPO shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    grpo_label = "GRPO (incl. its evals)" if x_key == "wall_s" else "GRPO"
    shade = {"warm_start": ("tab:orange", "warm start (SFT)"), "grpo": ("tab:blue", grpo_label)}
    x_of = (lambda t: t) if x_key == "wall_s" else (lambda t: to_train_s(t, points))
    for ph in phase_list:
        if ph["name"] in shade:
            color, label = shade[ph["name"]]
            ax.axvspan(x_of(ph["start_s"]), x_of(ph["end_s"]), color=color, alpha=0.12, label=label)
    if x_key == "wall_s":   # on the wall clock the evaluations take time of their own: grey bands
        for i, p in enumerate(points):
            ax.axvspan(p["wall_s"], p["wall_s"] + p["eval_s"], color="grey", alpha=0.25,
                       label="held-out evals" if i == 0 else None)
    xs = [p[x_key] for p in points]
    ax.plot(xs, [p["greedy_accuracy"] for p in points], "o-", color="tab:green", label="greedy accuracy")
    if all(p["pass@1"] is not None for p in points):
        ax.plot(xs, [p["pass@1"] for p in points], "s--", color="tab:purple", ms=4, label="pass@1 (T=1)")
    for p in (points[0], points[-1]):
        ax.annotate(f"{p['greedy_accuracy']:.3f}", (p[x_key], p["greedy_accuracy"]),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xlabel("wall-clock seconds since start (incl. setup, warm start, earlier evals)"
                  if x_key == "wall_s" else "training seconds (wall clock minus evaluation time)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"run directory (default {DEFAULT_OUT})")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out eval every N GRPO steps (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: train.max_steps, 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--x", choices=("wall", "train"), default="wall",
                    help="plot's x axis: wall clock incl. eval time, or excluding it (default wall)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. sft.steps=50")
    args = ap.parse_args()
    torch.set_num_threads(2)

    clock, summary = run(args.out, args.steps, args.eval_every, args.seed, args.overrides)
    run_dir = Path(args.out)
    points = build_points(clock)
    check = check_against_records(run_dir, points, summary)
    phase_list = [{**ph, "start_train_s": to_train_s(ph["start_s"], points),
                   "end_train_s": to_train_s(ph["end_s"], points)} for ph in phases(clock)]
    span = {p["name"]: p["end_s"] - p["start_s"] for p in phase_list}
    eval_s = sum(p["eval_s"] for p in points)
    grpo_evals_s = sum(p["eval_s"] for p in points[1:-1])
    timing = {"setup_s": span.get("setup"), "warm_start_s": span.get("warm_start"),
              "rl_s": span["grpo"], "rl_train_s": span["grpo"] - grpo_evals_s,
              "eval_s": eval_s, "total_s": clock.spans["total"][1],
              "demo_wall_seconds": summary["wall_seconds"]}
    timing = {k: (round(v, 2) if v is not None else None) for k, v in timing.items()}
    steps = summary["steps"]
    record = {"bench": "learning", "run_dir": str(run_dir), "steps": steps, "eval_every": args.eval_every,
              "seed": args.seed, "overrides": args.overrides, "x_axis_plotted": f"{args.x}_s",
              "clocks": {"wall_s": "seconds since run_demo was called, at the start of the evaluation",
                         "train_s": "wall_s minus the time spent in earlier evaluations"},
              "phases": phase_list, "timing": timing, "check": check, "points": points,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    json_path, png_path = run_dir / "learning_curve.json", run_dir / "learning_curve.png"
    json_path.write_text(json.dumps(record, indent=2))
    title = (f"grpolab demo: {steps} GRPO steps, eval every {args.eval_every}; greedy "
             f"{points[0]['greedy_accuracy']:.3f} -> {points[-1]['greedy_accuracy']:.3f}; "
             f"total {timing['total_s']:.0f}s (evals {eval_s:.0f}s)")
    plot(png_path, points, phase_list, f"{args.x}_s", title)
    print(json.dumps({
        "bench": "learning", "start_greedy": points[0]["greedy_accuracy"],
        "end_greedy": points[-1]["greedy_accuracy"], "start_pass@1": points[0]["pass@1"],
        "end_pass@1": points[-1]["pass@1"], "steps": steps, "eval_every": args.eval_every,
        "warm_start_s": timing["warm_start_s"], "rl_s": timing["rl_s"], "rl_train_s": timing["rl_train_s"],
        "eval_s": timing["eval_s"], "total_s": timing["total_s"], "points": len(points),
        "consistent": check["consistent"], "json": str(json_path), "png": str(png_path),
        "torch": torch.__version__}))


if __name__ == "__main__":
    main()
