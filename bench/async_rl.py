"""Asynchronous RL on a small CPU machine: the synchronous loop against one rollout worker process beside
the trainer (train.rollout_workers=1, train.async_steps=k), at EQUAL TOTAL THREADS (2 = this machine's
cores). Every run is a real `grpolab train` process (`python -m grpolab train ...`), its stdout/stderr in
its run directory; the numbers come from its metrics.jsonl, eval.json and the process itself.

configurations (--configs, in this order, reversed every other round with --rounds):
  sync    train.threads=2, no workers: sampling, scoring and the update one after another in one process
  sync1   train.threads=1, no workers: what one core does alone (selectable, not in the default list)
  w0      train.threads=1 + --rollout-workers 1 with train.worker_threads=1, train.async_steps=0: the worker
          samples batch t with the policy after step t-1 (the same run as sync, bit for bit, but
          generation and the update never overlap: the worker waits for the update, the trainer for the batch)
  k1, k2  the same with train.async_steps=1 / 2 and algorithm.rollout_correction=tis: batch t is sampled with
          the policy after step t-k-1, so the worker samples the next batches while the trainer updates
          (off-policy by up to k steps, corrected by truncated importance weights)

shapes (--shape):
  demo       the demo's config (grpolab's defaults: the built-in GPT, arithmetic, 16 prompts x 8 completions,
             at most 32 new tokens). The demo's SFT warm start runs ONCE, as `grpolab train
             train.max_steps=0` (the same load_policy path the demo takes; it saves checkpoints/step_0 and its
             eval.json is the step-0 held-out accuracy); every configuration then starts from that checkpoint
             (model.init_from) with train.eval_every=E, so there are held-out accuracy points.
  realistic  the random 54M Llama of bench/step.py --shape realistic (bench/memory.py's build_model: hidden
             512, 8 layers, MLP 1024, untied head, 32,000-entry character tokenizer), saved once as a Hugging
             Face directory; 8 prompts of exactly --prompt-tokens (128) tokens x 8 completions x exactly 128 new
             tokens (rollout.ignore_eos), beta 0.04, reward `length`, lr 1e-5: bench/step.py's step. Random
             weights: times only (the final eval runs on 1 problem, eval.k=1, and is not reported).
             bench/step.py measured this step at ~33 s on 2 threads (generate 8 s, reference 6 s, update 19 s).

    .venv/bin/python bench/async_rl.py --shape demo --steps 60 --eval-every 10 --configs sync,sync1,w0,k1,k2
    .venv/bin/python bench/async_rl.py --shape realistic --steps 5 --configs sync,w0,k1,k2 --rounds 2
    # --shape both runs demo then realistic; --steps, when given, is then the same for both
    # smoke test (~2 min): a short warm start, 3 steps of a shrunken demo
    .venv/bin/python bench/async_rl.py --shape demo --steps 3 --eval-every 3 --out /tmp/async-smoke \\
        --results /tmp/async-smoke/async_rl.json sft.steps=20 rollout.prompts_per_step=4 eval.num_problems=20

Extra `key=value` arguments are config overrides given to every run (for demo also to the warm start); the
configuration's own keys and the bench's (output_dir, init_from, max_steps, eval_every) come after them.
For realistic they come after the shape's keys, so rollout.max_new_tokens=16 etc. shrink it; the sizes used
are in every output line ("sizes").

Paper model (summary "paper_model", per shape with w0): seconds per step at 1 inference device + N training
devices from w0's per-phase times (one thread each, one after the other): synchronous G + U/N, with
async_steps >= 1 max(G, U/N) (see paper_model). `--merge A.json B.json --results OUT.json` summarizes
earlier results files together without running anything.

Output: one JSON line per (shape, configuration, round), then one summary line; all of it is also written
to --results (bench/results/async_rl.json). A failed run stops the bench with exit status 1 and the run's
last stderr line. Per run:
  step_s_mean / step_s_median   time/step: the trainer's wall per step, waiting for the batch included
  steady_step_s_mean            the same over steps 2.. (step 1 also starts the worker process and ships it
                                the model, which time/step counts but time/rollout_wait does not): the
                                number to compare configurations by in short runs
  train_s                       sum of time/step (evaluations and checkpoints are not in it)
  process_wall_s, process_cpu_s the `grpolab train` process from start to exit (imports, model load,
                                evaluations, checkpoint); its CPU seconds include its reaped rollout workers
  trainer_idle_frac             sum(time/rollout_wait) / sum(time/step): the trainer waiting for a batch
  worker_idle_frac              sum(time/worker_idle) / (sum(time/worker_idle) + sum(time/generate)): the
                                worker waiting for a request (a new weight version); *_steady: the same
                                over steps 2.. that do not follow an evaluation (during an evaluation the
                                trainer publishes nothing, so a worker waiting on it counts that as idle)
  phase_s_mean                  means per step of time/generate (sync: sampling inside the step; workers:
                                the worker's sampling of that batch), trainer_busy (time/step -
                                time/rollout_wait), rollout_wait, worker_idle, reward, ref_and_advantages,
                                update
  staleness_mean                async/staleness: optimizer steps between the sampling policy and the trained one
  completion_tokens_mean        completions/mean_length (demo: lengths change as the policy learns)
  curve (demo)                  [step, cumulative train_s, held-out greedy accuracy]: step 0 = the warm start
                                (train_s 0), every E steps, the final eval folded into the last step
  final (demo)                  eval.json: greedy_accuracy and pass@1 after the last step
Summary, per shape and configuration: medians over rounds, and train_s_vs_sync = sync's train_s / this
one's (> 1: faster than the synchronous loop at the same threads); demo also accuracy_at_budget: the
accuracy of each run's last eval point within the smallest train_s any configuration took.

Caveat for the demo curves: with k >= 1 the worker keeps sampling requested batches while the trainer
evaluates, time the train_s clock does not count; the periodic evals thus flatter k1/k2 slightly (the more
so the smaller E). The realistic shape has no periodic eval.

Run it on a quiet machine: nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _proc import run_reaped  # (bench/ is on the path when this file runs as a script)

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2   # this machine's cores: every configuration uses this many torch threads in all
CONFIGS = {   # name -> (trainer threads, rollout workers, worker threads, async_steps)
    "sync": (THREADS, 0, 0, 0),
    "sync1": (THREADS // 2, 0, 0, 0),
    "w0": (THREADS // 2, 1, THREADS // 2, 0),
    "k1": (THREADS // 2, 1, THREADS // 2, 1),
    "k2": (THREADS // 2, 1, THREADS // 2, 2),
}
DEFAULT_STEPS = {"demo": 60, "realistic": 5}
# OpenMP/MKL settings of the caller's shell would change what train.threads means; grpolab sets its own
CLEAN = ("OMP_", "GOMP_", "KMP_", "MKL_")
PHASES = ("generate", "reward", "ref_and_advantages", "update", "rollout_wait", "worker_idle", "weight_sync")


def config_args(name: str) -> list[str]:
    """The configuration's own CLI arguments."""
    threads, workers, worker_threads, k = CONFIGS[name]
    if not workers:
        return [f"train.threads={threads}", "train.rollout_workers=0", "train.async_steps=0"]
    # k >= 1 trains on stale batches: with the correction the docs recommend for it (TIS)
    return ["--rollout-workers", str(workers), f"train.threads={threads}", f"train.worker_threads={worker_threads}",
            f"train.async_steps={k}", *(["algorithm.rollout_correction=tis"] if k else [])]


def run_grpolab(args: list[str], run_dir: Path, timeout: float) -> dict:
    """`python -m grpolab ARGS` with its output in run_dir/stdout.txt and stderr.txt; its wall and CPU
    seconds (wait4: its own and its reaped children's, the rollout workers). Exits 1 when it fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    cmd = [sys.executable, "-m", "grpolab", *args]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    with open(run_dir / "stdout.txt", "w") as out, open(run_dir / "stderr.txt", "w") as err:
        code, wall, cpu, timed_out = run_reaped(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, timeout=timeout)
    if code != 0 or timed_out:
        lines = [x for x in (run_dir / "stderr.txt").read_text(errors="replace").splitlines() if x.strip()]
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {code}"
        print(f"async_rl: {' '.join(args[:1])} in {run_dir} failed ({why}): "
              f"{lines[-1] if lines else '(no stderr)'}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    return {"process_wall_s": round(wall, 2), "process_cpu_s": round(cpu, 2)}


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _frac(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def summarize_rows(rows: list[dict]) -> dict:
    """The per-run numbers of the module docstring, from metrics.jsonl's rows."""
    steps = [r["time/step"] for r in rows]
    workers = "time/rollout_wait" in rows[0]
    out = {"steps": len(rows), "train_s": round(sum(steps), 3), "step_s_mean": _mean(steps),
           "step_s_median": round(statistics.median(steps), 4), "steady_step_s_mean": _mean(steps[1:])}
    phases = {p: _mean([r[f"time/{p}"] for r in rows if f"time/{p}" in r]) for p in PHASES}
    phases["trainer_busy"] = _mean([r["time/step"] - r.get("time/rollout_wait", 0.0) for r in rows])
    out["phase_s_mean"] = {k: v for k, v in phases.items() if v is not None}
    if workers:
        # steady: not step 1 (worker start) and not a step right after an evaluation (nothing published then)
        steady = [r for i, r in enumerate(rows) if i > 0 and not any(k.startswith("eval/") for k in rows[i - 1])]

        def fractions(sel: list[dict]) -> tuple:
            wait = sum(r["time/rollout_wait"] for r in sel)
            idle, gen = sum(r["time/worker_idle"] for r in sel), sum(r["time/generate"] for r in sel)
            return _frac(wait, sum(r["time/step"] for r in sel)), _frac(idle, idle + gen)
        out["trainer_idle_frac"], out["worker_idle_frac"] = fractions(rows)
        out["trainer_idle_frac_steady"], out["worker_idle_frac_steady"] = fractions(steady) if steady else (None,
                                                                                                           None)
        out["staleness_mean"] = _mean([r["async/staleness"] for r in rows])
    else:
        out["trainer_idle_frac"] = out["worker_idle_frac"] = None
    out["completion_tokens_mean"] = _mean([r["completions/mean_length"] for r in rows])
    return out


def accuracy_curve(rows: list[dict], start: float | None) -> list[list]:
    """[step, cumulative train seconds, greedy accuracy] at step 0 (when known) and every evaluated step."""
    curve = [[0, 0.0, start]] if start is not None else []
    clock = 0.0
    for r in rows:
        clock += r["time/step"]
        if "eval/greedy_accuracy" in r:
            curve.append([r["step"], round(clock, 2), r["eval/greedy_accuracy"]])
    return curve


def run_sizes(run_dir: Path, prompt_tokens: int | None) -> dict:
    """The batch and model sizes the run actually used (its config.yaml)."""
    import yaml
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    r, m = cfg["rollout"], cfg["model"]
    sizes = {"prompts_per_step": r["prompts_per_step"], "num_generations": r["num_generations"],
             "max_new_tokens": r["max_new_tokens"], "ignore_eos": r["ignore_eos"]}
    if prompt_tokens is not None:
        sizes["prompt_tokens"] = prompt_tokens
    if m["name_or_path"] == "builtin":
        sizes["model"] = {k: m[k] for k in ("n_layer", "n_head", "n_embd")}
    return sizes


# ---------------------------------------------------------------- shapes

def prepare_demo(out: Path, extra: list[str], timeout: float) -> dict:
    """The demo's warm start, once: `grpolab train train.max_steps=0` (checkpoints/step_0, eval.json)."""
    warm = out / "warm"
    print(f"async_rl: demo warm start in {warm} ...", file=sys.stderr, flush=True)
    proc = run_grpolab(["train", *extra, f"train.threads={THREADS}", "train.max_steps=0",
                        f"train.output_dir={warm}"], warm, timeout)
    start = json.loads((warm / "eval.json").read_text())
    return {"args": [f"model.init_from={warm / 'checkpoints' / 'step_0'}"], "prompt_tokens": None,
            "start_accuracy": start.get("greedy_accuracy"), "warm_start": {**proc, "eval": start}}


def prepare_realistic(out: Path, prompt_tokens: int) -> dict:
    """bench/step.py's realistic model (bench/memory.py builds it) as a Hugging Face directory, and its rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory
    model = out / "model"
    if not (model / "config.json").is_file():
        print(f"async_rl: building the realistic model in {model} ...", file=sys.stderr, flush=True)
        memory.build_model(model, layers=8, intermediate=1024, tie=False)
    rows = memory.rows(64, prompt_tokens)   # the trainer draws 8 a step, in its own seeded order
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    args = [f"model.name_or_path={model}", "data.task=files", f"data.train_path={out / 'train.jsonl'}",
            f"data.test_path={out / 'test.jsonl'}", "algorithm.preset=grpo", "algorithm.beta=0.04",
            "reward.functions=[length]", "rollout.prompts_per_step=8", "rollout.num_generations=8",
            "rollout.max_new_tokens=128", "rollout.temperature=1.0", "rollout.ignore_eos=true", "optim.lr=1e-5",
            "optim.beta2=0.999", "optim.warmup_steps=0", "optim.lr_schedule=constant", "eval.num_problems=1",
            "eval.k=1", "log.samples_every=0"]
    return {"args": args, "prompt_tokens": prompt_tokens, "start_accuracy": None}


def run_config(shape: str, name: str, rnd: int, prep: dict, extra: list[str], out: Path, steps: int,
               eval_every: int, timeout: float) -> dict:
    run_dir = out / f"{name}-r{rnd}"
    threads, workers, worker_threads, k = CONFIGS[name]
    base = prep["args"] if shape == "realistic" else []
    args = ["train", *base, *extra, *config_args(name), *(prep["args"] if shape == "demo" else []),
            f"train.max_steps={steps}", f"train.eval_every={eval_every}", f"train.output_dir={run_dir}"]
    print(f"async_rl: {shape} {name} round {rnd} in {run_dir} ...", file=sys.stderr, flush=True)
    proc = run_grpolab(args, run_dir, timeout)
    rows = read_rows(run_dir)
    res = {"shape": shape, "config": name, "round": rnd, "trainer_threads": threads, "rollout_workers": workers,
           "worker_threads": worker_threads, "async_steps": k, "sizes": run_sizes(run_dir, prep["prompt_tokens"]),
           **proc, **summarize_rows(rows), "run_dir": str(run_dir)}
    if shape == "demo":
        res["curve"] = accuracy_curve(rows, prep["start_accuracy"])
        final = json.loads((run_dir / "eval.json").read_text())
        res["final"] = {k: final[k] for k in ("greedy_accuracy", "pass@1") if k in final}
    return res


def at_budget(curve: list[list], budget: float) -> float | None:
    """The accuracy of the last curve point within `budget` train seconds."""
    within = [p[2] for p in curve if p[1] <= budget + 1e-9 and p[2] is not None]
    return within[-1] if within else None


def paper_model(generate_s: float, update_s: float, ns=(1, 2, 4, 8)) -> list[dict]:
    """Seconds per step at 1 inference device + N training devices, from one device's per-phase times:
    G (sampling a batch) and U (the trainer's work on it, weight broadcast included). Synchronous, the
    devices take turns: G + U/N. With async_steps >= 1 they overlap: max(G, U/N). Assumes the update
    scales linearly over N data-parallel devices and G does not change with N."""
    out = []
    for n in ns:
        sync, ahead = generate_s + update_s / n, max(generate_s, update_s / n)
        out.append({"training_devices": n, "sync_s": round(sync, 4), "async_s": round(ahead, 4),
                    "speedup": round(sync / ahead, 3), "bound_by": "inference" if generate_s >= update_s / n
                    else "training"})
    return out


def summarize(runs: list[dict]) -> dict:
    """Per shape and configuration: medians over rounds; train_s against sync's; the demo's accuracy at
    the smallest train_s any configuration took."""
    out: dict = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        mine = [r for r in runs if r["shape"] == shape]
        names = list(dict.fromkeys(r["config"] for r in mine))
        budget = min(r["train_s"] for r in mine)
        per: dict = {}
        for name in names:
            sel = [r for r in mine if r["config"] == name]

            def med(key: str, sel=sel):
                xs = [r[key] for r in sel if r.get(key) is not None]
                return round(statistics.median(xs), 4) if xs else None
            per[name] = {k: med(k) for k in ("step_s_mean", "step_s_median", "steady_step_s_mean", "train_s",
                                             "process_wall_s", "process_cpu_s", "trainer_idle_frac",
                                             "worker_idle_frac", "trainer_idle_frac_steady",
                                             "worker_idle_frac_steady")}
            per[name]["rounds"] = len(sel)
            per[name]["phase_s_mean"] = {p: round(statistics.median(r["phase_s_mean"][p] for r in sel), 4)
                                         for p in sel[0]["phase_s_mean"]}
            if shape == "demo":
                per[name]["final_greedy_accuracy"] = round(statistics.median(
                    r["final"]["greedy_accuracy"] for r in sel), 4)
                at = [a for a in (at_budget(r["curve"], budget) for r in sel) if a is not None]
                per[name]["accuracy_at_budget"] = round(statistics.median(at), 4) if at else None
        if "sync" in per:
            for name in names:
                per[name]["train_s_vs_sync"] = round(per["sync"]["train_s"] / per[name]["train_s"], 3)
        out[shape] = {"configs": per, **({"budget_train_s": round(budget, 2)} if shape == "demo" else {})}
        if "w0" in per:   # one thread each side, one after the other: each phase's time on one "device"
            g, u = per["w0"]["phase_s_mean"]["generate"], per["w0"]["phase_s_mean"]["trainer_busy"]
            out[shape]["paper_model"] = {"generate_s": g, "trainer_busy_s": u, "rows": paper_model(g, u)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("demo", "realistic", "both"), default="demo")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"GRPO steps per run (default: {DEFAULT_STEPS['demo']} demo, "
                         f"{DEFAULT_STEPS['realistic']} realistic)")
    ap.add_argument("--eval-every", type=int, default=10, help="demo: held-out eval every E steps (realistic: none)")
    ap.add_argument("--configs", default="sync,w0,k1,k2", help=f"comma-separated, of {','.join(CONFIGS)}")
    ap.add_argument("--rounds", type=int, default=1, help="the configuration list R times, reversed every other round")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="realistic: tokens per prompt")
    ap.add_argument("--out", default="runs/bench-async", help="run directories go under OUT/<shape>/")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "async_rl.json"),
                    help="where the whole result (runs and summary) is written as JSON")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one grpolab process may take")
    ap.add_argument("--merge", nargs="+", default=None, metavar="RESULTS",
                    help="run nothing: merge the runs of earlier --results files, summarize them into --results")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    a = ap.parse_args()
    if a.merge:
        parts = [json.loads(Path(f).read_text()) for f in a.merge]
        runs = [r for p in parts for r in p["runs"]]
        merged = {"bench": "async_rl", "merged": a.merge, "argv": [p["argv"] for p in parts],
                  "prepared": {k: v for p in parts for k, v in p.get("prepared", {}).items()}, "runs": runs,
                  "summary": {"summary": True, **summarize(runs)}}
        Path(a.results).write_text(json.dumps(merged, indent=1) + "\n")
        print(json.dumps(merged["summary"]), flush=True)
        return 0
    configs = [c for c in a.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS] + [o for o in a.overrides if "=" not in o]
    if bad or not configs:
        ap.error(f"unknown configurations or overrides: {bad or a.configs}")
    if a.rounds < 1 or (a.steps is not None and a.steps < 1) or a.eval_every < 0 or a.prompt_tokens < 1:
        ap.error("--rounds, --steps and --prompt-tokens must be >= 1, --eval-every >= 0")
    shapes = ["demo", "realistic"] if a.shape == "both" else [a.shape]
    root = Path(a.out).resolve()
    header = {"bench": "async_rl", "argv": sys.argv[1:], "cpus": os.cpu_count(), "threads_total": THREADS,
              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(header), flush=True)
    runs, prepared = [], {}
    t0 = time.perf_counter()
    for shape in shapes:
        out = root / shape
        out.mkdir(parents=True, exist_ok=True)
        steps = a.steps or DEFAULT_STEPS[shape]
        if shape == "demo":
            prep = prepare_demo(out, a.overrides, a.timeout)
            prepared[shape] = prep["warm_start"]
        else:
            prep = prepare_realistic(out, a.prompt_tokens)
        for rnd in range(a.rounds):
            for name in (configs if rnd % 2 == 0 else configs[::-1]):
                r = run_config(shape, name, rnd, prep, a.overrides, out, steps,
                               a.eval_every if shape == "demo" else 0, a.timeout)
                runs.append(r)
                print(json.dumps(r), flush=True)
    summary = {"summary": True, **summarize(runs), "bench_wall_s": round(time.perf_counter() - t0, 1),
               "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(summary), flush=True)
    results = Path(a.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({**header, "prepared": prepared, "runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
