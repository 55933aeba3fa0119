"""The Python API's speed against the order of its imports, idle and beside a CPU burner.

docs/python-api.md's GRPO example (SmolLM2-135M-Instruct, LoRA r=16 on all linear layers, 8 rows = 2 prompts x 4
completions of up to 64 tokens, reward_len) at 3 steps, written out as a script with its imports in two orders:

  peft_first     `from peft import LoraConfig` before `from grpolab import ...`, as the docs write it: torch (and
                 with it the OpenMP runtime) is loaded before grpolab can set the runtime's environment
  grpolab_first  grpolab imported first

Each script runs in a fresh process, the orders alternating, `--rounds` times per order and condition:
  idle       nothing else started by the benchmark
  contended  `--hogs` busy-loop processes (default: one per core) for the whole measurement

    .venv/bin/python bench/api_import_order.py --rounds 3
    .venv/bin/python bench/api_import_order.py --rounds 2 --env GOMP_SPINCOUNT=10000   # a setting to try
    .venv/bin/python bench/api_import_order.py --rounds 2 --tree before=/tmp/base --tree after=.   # two checkouts

--tree LABEL=DIR runs the scripts on the grpolab of another checkout (DIR on PYTHONPATH), each tree in every round
and condition beside the others, so that an old and a new version are compared in one run.

Prints one JSON line per process (s/step: the median `time/step` of its metrics.jsonl; wall: the whole script),
then per condition and order the medians, the ratio of the two orders, and whether every process ended with the
same loss bits; the last line sums it up (`orders_within_10pct`: each condition's s/step ratio within 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _proc import run_reaped  # (bench/ is on the path when this file runs as a script)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
ORDERS = ("peft_first", "grpolab_first")
# variables that would change what an order measures; each process starts from none of them (grpolab sets its own)
CLEAN = ("OMP_", "GOMP_", "KMP_", "MKL_")
HOG = "while True:\n    pass\n"
IMPORTS = {"peft_first": "from datasets import Dataset\nfrom peft import LoraConfig\n"
                         "from grpolab import GRPOConfig, GRPOTrainer\n",
           "grpolab_first": "from grpolab import GRPOConfig, GRPOTrainer\nfrom datasets import Dataset\n"
                            "from peft import LoraConfig\n"}
# docs/python-api.md's example, max_steps=3
BODY = """
dataset = Dataset.from_list([{"prompt": p} for p in ["Write a haiku about the sea.", "Name three prime numbers.",
                                                      "Describe a cat in one sentence.", "What is 7 times 8?"]])

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

args = GRPOConfig(output_dir=OUT, learning_rate=1e-5, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=64, max_steps=3, logging_steps=1)
trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=args, train_dataset=dataset,
                      peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
trainer.train()
"""


def script(order: str, out: str) -> str:
    return f"{IMPORTS[order]}OUT = {out!r}\nMODEL = {str(MODEL)!r}\n{BODY}"


def step_seconds(out: str) -> tuple[float, dict]:
    """The median training step's seconds and the last step's loss bits (hex)."""
    rows = [json.loads(ln) for ln in Path(out, "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if "time/step" in r]
    bits = {k: float(steps[-1][k]).hex() for k in ("loss", "grad_norm") if k in steps[-1]}
    return statistics.median(r["time/step"] for r in steps), bits


def run_once(order: str, condition: str, extra_env: dict, timeout: float, tree: tuple[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)} | extra_env
    env["PYTHONPATH"] = str(Path(tree[1]).resolve())
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as err:
        path = Path(tmp, "example.py")
        out = str(Path(tmp, "run"))
        path.write_text(script(order, out))
        code, wall, cpu, timed_out = run_reaped([sys.executable, str(path)], cwd=tmp, env=env,
                                                stdout=subprocess.DEVNULL, stderr=err, timeout=timeout)
        row = {"tree": tree[0], "condition": condition, "order": order, "wall_s": round(wall, 2),
               "cpu_s": round(cpu, 2)}
        if timed_out:
            return {**row, "timed_out": True, "s_per_step": None, "bits": None}
        if code != 0:
            err.seek(0)
            raise SystemExit(f"{order} failed ({code}): {err.read().decode(errors='replace')[-2000:]}")
        per_step, bits = step_seconds(out)
        return {**row, "s_per_step": round(per_step, 3), "bits": bits}


def summarize(rows: list[dict], trees: list[str], conditions: list[str], orders: list[str]) -> list[dict]:
    """Per tree and condition: each order's medians, and the ratio of the orders when both ran."""
    bits = {json.dumps(r["bits"], sort_keys=True) for r in rows if r["bits"] is not None}
    out = []
    for tree in trees:
        for cond in conditions:
            med = {}
            for order in orders:
                sel = [r for r in rows if (r["tree"], r["condition"], r["order"]) == (tree, cond, order)
                       and r["s_per_step"] is not None]
                med[order] = {"s_per_step": statistics.median(r["s_per_step"] for r in sel),
                              "wall_s": statistics.median(r["wall_s"] for r in sel), "runs": len(sel)}
            row = {"summary": True, "tree": tree, "condition": cond, **med, "same_bits_everywhere": len(bits) == 1}
            if len(med) == 2:
                row["s_per_step_peft_over_grpolab"] = round(
                    med["peft_first"]["s_per_step"] / med["grpolab_first"]["s_per_step"], 3)
                row["wall_peft_over_grpolab"] = round(med["peft_first"]["wall_s"] / med["grpolab_first"]["wall_s"], 3)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per order and condition (alternated)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy-loop processes when contended")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a process is stopped")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in every process (e.g. an OpenMP setting to try)")
    ap.add_argument("--conditions", default="idle,contended", help="comma-separated: idle, contended")
    ap.add_argument("--orders", default=",".join(ORDERS), help="comma-separated: " + ", ".join(ORDERS))
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                    help="a checkout whose grpolab the scripts run (default: this one)")
    a = ap.parse_args()
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"{MODEL} is missing: run `make smollm2` first")
    extra = dict(kv.split("=", 1) for kv in a.env)
    conditions, orders = a.conditions.split(","), a.orders.split(",")
    trees = [tuple(t.split("=", 1)) for t in a.tree] or [("this", str(ROOT))]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the hogs on a plain kill too
    print(json.dumps({"cpus": os.cpu_count(), "hogs": a.hogs, "rounds": a.rounds, "env": extra, "trees": trees,
                      "loadavg_start": os.getloadavg()}), flush=True)
    rows = []
    for i in range(a.rounds):
        for cond in conditions:
            hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(a.hogs)] if cond == "contended" else []
            try:
                # rotate which tree and order run first after a switch of condition
                runs = [(t, o) for t in trees for o in orders]
                for tree, order in runs[i % len(runs):] + runs[:i % len(runs)]:
                    r = run_once(order, cond, extra, a.timeout, tree) | {"round": i}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
    summary = summarize(rows, [t[0] for t in trees], conditions, orders)
    for s in summary:
        print(json.dumps(s), flush=True)
    within = {f"{s['tree']}/{s['condition']}": 1 / 1.1 <= s["s_per_step_peft_over_grpolab"] <= 1.1
              for s in summary if "s_per_step_peft_over_grpolab" in s}
    print(json.dumps({"loadavg_end": os.getloadavg(), "orders_within_10pct": within}), flush=True)


if __name__ == "__main__":
    main()
