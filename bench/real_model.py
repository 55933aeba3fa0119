"""What the real-model runs (configs/smollm2_length.yaml, configs/smollm2_math.yaml) learned:
numbers with standard errors and a plot, from the files the runs wrote, plus a held-out sample
for the length run.

    # after `grpolab train configs/smollm2_length.yaml` (held-out: 64 GSM8K test questions x 4 samples
    # with the run's system prompt, base model and the run's last checkpoint; T=1, 48 new tokens)
    .venv/bin/python bench/real_model.py length runs/smollm2_length [--plot docs/smollm2_length.png]
    # after the math run and the base model's eval (commands in configs/smollm2_math.yaml)
    .venv/bin/python bench/real_model.py math runs/smollm2_math runs/smollm2_math_before/eval.json \
        [--after runs/smollm2_math_after/eval.json] [--plot docs/smollm2_math.png]

One JSON line on stdout. Standard errors: sqrt(p(1-p)/n) over the n problems for every metric
(exact for greedy accuracy, conservative for pass@1); a difference's SE is the two in quadrature
(conservative again: both evals score the same problems, so their errors are positively correlated).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
TARGET = 20


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def _last_checkpoint(run: Path) -> Path:
    return max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, math.sqrt(var / n)


def _sample_lengths(model: Path, prompts: list, n: int, seed: int) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        subprocess.run([sys.executable, "-m", "grpolab", "generate", str(model), "--in", str(inp), "--out", str(out),
                        "--n", str(n), "max_tokens=48", "temperature=1.0", f"seed={seed}"],
                       check=True, stdout=subprocess.DEVNULL)
        lengths = []
        for r in _rows(out):
            texts = r.get("completions") or [r["completion"]]
            lengths += [len(t) for t in texts]
        return lengths


def length(run: Path, plot: Path | None, prompts: int = 64, n: int = 4) -> dict:
    metrics = _rows(run / "metrics.jsonl")
    cfg_model = str(ROOT / "models" / "SmolLM2-135M-Instruct")
    system = yaml.safe_load((run / "config.yaml").read_text())["data"]["system_prompt"]
    questions = [[{"role": "system", "content": system}, {"role": "user", "content": r["question"]}]
                 for r in _rows(GSM8K_TEST)[:prompts]]   # the run's prompts: its system prompt, chat messages
    out = {"run": str(run), "steps": len(metrics), "train_seconds": round(sum(m["time/step"] for m in metrics), 1)}
    for name, model in (("before", cfg_model), ("after", str(_last_checkpoint(run)))):
        lens = _sample_lengths(Path(model), questions, n, seed=1)
        dev = [abs(TARGET - x) for x in lens]
        out[name] = {"mean_chars": mean_se(lens), "mean_abs_dev_chars": mean_se(dev),
                     "reward": mean_se([-d for d in dev]), "samples": len(lens)}
    out["curve"] = [{"step": m["step"], "reward_x20": 20 * m["reward"], "tokens": m["completions/mean_length"]}
                    for m in metrics]
    if plot:
        _plot_length(metrics, plot)
    return out


def _plot_length(metrics: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [m["step"] for m in metrics]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [TARGET * m["reward"] for m in metrics], marker=".")
    a.axhline(0, color="grey", lw=0.5)
    a.set(xlabel="GRPO step", ylabel="reward x 20 = -mean |20 - chars|", title="length reward (train batch)")
    b.plot(steps, [m["completions/mean_length"] for m in metrics], marker=".", color="C1")
    b.set(xlabel="GRPO step", ylabel="mean completion length (tokens)", title="completion length")
    fig.suptitle("SmolLM2-135M-Instruct + LoRA, configs/smollm2_length.yaml, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _eval_ses(ev: dict, n: int, k: int) -> dict:
    """Each metric with sqrt(p(1-p)/n): exact for greedy accuracy, an upper bound for pass@1 (the
    mean of k samples per problem varies less than one sample) and the binomial SE of pass@k."""
    return {key: (ev[key], math.sqrt(ev[key] * (1 - ev[key]) / n))
            for key in ("greedy_accuracy", "pass@1", f"pass@{k}") if key in ev} | {"n": n}


def math_run(run: Path, before_json: Path, plot: Path | None, after_json: Path | None = None) -> dict:
    metrics = _rows(run / "metrics.jsonl")
    k = 4
    n = len(_rows(before_json.with_name("eval_samples.jsonl")))   # the problems both evals scored
    before = _eval_ses(json.loads(before_json.read_text()), n, k)
    after = _eval_ses(json.loads((after_json or run / "eval.json").read_text()), n, k)
    out = {"run": str(run), "steps": len(metrics), "train_seconds": round(sum(m["time/step"] for m in metrics), 1),
           "before": before, "after": after}
    for key in before:
        if key == "n" or key not in after:
            continue
        d = after[key][0] - before[key][0]
        se = math.hypot(before[key][1], after[key][1])
        out[f"diff/{key}"] = {"diff": d, "se": se, "z": d / se if se else None}
    if plot:
        _plot_math(metrics, before, after, plot)
    return out


def _plot_math(metrics: list[dict], before: dict, after: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    wall = [0.0]
    for m in metrics:
        wall.append(wall[-1] + m["time/step"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    acc = [k for k in metrics[0] if k.startswith("rewards/") and k.endswith("/mean")]
    for key in acc:
        a.plot([w / 60 for w in wall[1:]], [m[key] for m in metrics], marker=".", label=key.split("/")[1])
    a.set(xlabel="training minutes", ylabel="mean reward (train batch)", title="rewards per step")
    a.legend()
    names = [k for k in ("greedy_accuracy", "pass@1", "pass@4") if k in before and k in after]
    xs = range(len(names))
    for off, (label, ev) in zip((-0.2, 0.2), (("before", before), ("after", after))):
        b.bar([x + off for x in xs], [ev[n][0] for n in names], width=0.4, label=label,
              yerr=[ev[n][1] or 0 for n in names], capsize=3)
    b.set_xticks(list(xs), names)
    b.set(ylabel=f"held-out ({after['n']} problems)", title="before / after, +-1 SE")
    b.legend()
    fig.suptitle("SmolLM2-135M-Instruct + LoRA, GRPO on MATH Levels 1-2, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("length")
    a.add_argument("run", type=Path)
    a.add_argument("--plot", type=Path)
    b = sub.add_parser("math")
    b.add_argument("run", type=Path)
    b.add_argument("before", type=Path)
    b.add_argument("--plot", type=Path)
    b.add_argument("--after", type=Path, help="eval.json of the trained model (default RUN/eval.json, the final eval)")
    args = ap.parse_args()
    if args.cmd == "length":
        res = length(args.run, args.plot)
    else:
        res = math_run(args.run, args.before, args.plot, args.after)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
