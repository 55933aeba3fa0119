"""What load-independent determinism costs: the demo's warm start and GRPO steps with and without
grpolab's CPU numerics settings (grpolab/determinism.py), alternated in fresh processes.

    .venv/bin/python bench/determinism.py --runs 5

modes:
  pinned  what grpolab does: MKL_CBWR=AUTO, MKL dynamic threading off, torch.set_num_threads(all cores)
  free    what it did before: MKL's defaults (no CNR, dynamic threading on), thread count not set

Prints one JSON line per process, then a summary line with the medians and the ratio pinned/free
(below 1.0 = pinned is faster). Also reports whether the two modes computed the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workload(mode: str, sft_steps: int, grpo_steps: int) -> dict:
    """Runs inside a fresh process: warm start then GRPO steps at the demo's sizes; timings and a hash."""
    import hashlib
    import tempfile

    import torch

    from grpolab.config.load import load_config
    from grpolab.determinism import pin_cpu_numerics
    from grpolab.jobs.inputs import load_data, load_policy
    from grpolab.monitor.console import Console
    from grpolab.train.grpo import GRPOTrainer

    if mode == "pinned":
        pin_cpu_numerics(0)
    torch.manual_seed(0)
    out = tempfile.mkdtemp()
    cfg = load_config(None, [f"sft.steps={sft_steps}", f"sft.bare_steps={sft_steps // 5}",
                             f"train.output_dir={out}"])
    train_rows, test_rows = load_data(cfg)
    t0 = time.perf_counter()
    model, tok = load_policy(cfg, train_rows, Console(quiet=True))
    t1 = time.perf_counter()
    trainer = GRPOTrainer(cfg, model, tok, train_rows, test_rows, out)
    steps = [trainer.train_step() for _ in range(grpo_steps)]
    t2 = time.perf_counter()
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().contiguous().numpy().tobytes())
    return {"mode": mode, "sft_s": t1 - t0, "grpo_s_per_step": (t2 - t1) / grpo_steps,
            "gen_s_per_step": sum(m["time/generate"] for m in steps) / grpo_steps,
            "update_s_per_step": sum(m["time/update"] for m in steps) / grpo_steps,
            "weights_sha256": h.hexdigest()[:16]}


def _env(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}
    if mode == "free":   # MKL's own defaults; an empty MKL_CBWR keeps grpolab from setting it
        env.update(MKL_CBWR="", MKL_DYNAMIC="TRUE", OMP_DYNAMIC="FALSE")
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="processes per mode (alternated)")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--grpo-steps", type=int, default=6)
    ap.add_argument("--inner", choices=["pinned", "free"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inner:
        print(json.dumps(workload(a.inner, a.sft_steps, a.grpo_steps)))
        return
    rows: dict[str, list[dict]] = {"pinned": [], "free": []}
    for i in range(a.runs):
        for mode in (("pinned", "free") if i % 2 == 0 else ("free", "pinned")):
            r = subprocess.run([sys.executable, __file__, "--inner", mode, "--sft-steps", str(a.sft_steps),
                                "--grpo-steps", str(a.grpo_steps)], env=_env(mode), cwd=ROOT,
                               capture_output=True, text=True, check=True)
            row = json.loads(r.stdout.strip().splitlines()[-1])
            rows[mode].append(row)
            print(json.dumps(row), flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("sft_s", "grpo_s_per_step")}
           for m, rs in rows.items()}
    print(json.dumps({
        "bench": "determinism", "runs": a.runs, "sft_steps": a.sft_steps, "grpo_steps": a.grpo_steps,
        "median": med,
        "ratio_pinned_over_free": {k: med["pinned"][k] / med["free"][k] for k in ("sft_s", "grpo_s_per_step")},
        "pinned_runs_identical": len({r["weights_sha256"] for r in rows["pinned"]}) == 1,
        "free_runs_identical": len({r["weights_sha256"] for r in rows["free"]}) == 1,
    }))


if __name__ == "__main__":
    main()
