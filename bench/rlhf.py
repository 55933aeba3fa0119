"""RLHF on the built-in arithmetic task with no outside data (issue 23's acceptance; docs/rlhf.md
quotes it). Every run goes through the CLI, as a user would type it:
  1. `grpolab sft` with the defaults: the demo's warm start
  2. `grpolab sample --pairs` from it: for each of --prompts training prompts, the best vs the worst
     of 8 samples by gsm8k_accuracy (ties skipped), as preference pairs
  3. `grpolab rm` on those pairs, from the SFT model; 200 pairs held out
  4. `grpolab train` (GRPO, 60 steps, KL to the SFT model with --beta) from the SFT model with
     rm:<that checkpoint> as the only reward
  5. the same GRPO with the verifier (gsm8k_accuracy) as the reward, for comparison
  6. `grpolab dpo` on the same training pairs (the reward model's 200 held-out pairs left out), from
     the SFT model: rm:<that checkpoint> is its implicit reward, beta * log pi/pi_ref; its held-out
     pairwise accuracy, and GRPO with it as the only reward as in step 4 (beta --implicit-beta)

    .venv/bin/python bench/rlhf.py [--out runs/bench_rlhf] [--prompts 12000] [--rm-steps 600]
    # about 25 min on 2 CPU cores; --reuse skips the steps whose output is already there

Prints one JSON object: both reward models' held-out pairwise accuracy, the held-out greedy accuracy
and pass@1 of each policy, the checks, seconds. Exit code 1 when a check fails: held-out pairwise
accuracy >= 0.80 (each reward model), and GRPO with each reward model raises greedy accuracy over the
warm start.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

GRPOLAB = [sys.executable, "-m", "grpolab"]


def ckpt(run_dir: Path) -> str:
    return str(max((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1])))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench_rlhf")
    ap.add_argument("--prompts", type=int, default=12000, help="training prompts sampled for pairs")
    ap.add_argument("--rm-steps", type=int, default=600)
    ap.add_argument("--rm-lr", type=float, default=1e-3)
    ap.add_argument("--grpo-steps", type=int, default=60)
    ap.add_argument("--beta", type=float, default=0.5, help="GRPO's KL coefficient (algorithm.beta): without it "
                    "the policy games the reward model")
    ap.add_argument("--implicit-beta", type=float, default=2.0, help="algorithm.beta of GRPO on the implicit "
                    "reward, which the policy games at 0.5")
    ap.add_argument("--reuse", action="store_true", help="skip a step whose output exists")
    a = ap.parse_args()
    root = Path(a.out)
    secs: dict[str, float] = {}

    def run(name: str, args: list[str], done: Path) -> None:
        if a.reuse and done.exists():
            return
        t0 = time.perf_counter()
        subprocess.run(GRPOLAB + args + ["log.level=quiet"], check=True, stdout=subprocess.DEVNULL)
        secs[name] = round(time.perf_counter() - t0, 1)

    run("sft", ["sft", f"train.output_dir={root / 'sft'}"], root / "sft" / "eval.json")
    warm = ckpt(root / "sft")
    pairs = root / "pairs.jsonl"
    run("sample", ["sample", warm, "--pairs", "--k", "8", "--out", str(pairs), f"sample.num_prompts={a.prompts}"],
        pairs)
    run("rm", ["rm", f"rm.pairs={pairs}", f"model.init_from={warm}", f"rm.steps={a.rm_steps}", f"rm.lr={a.rm_lr}",
               "rm.eval_size=200", f"train.output_dir={root / 'rm'}"], root / "rm" / "eval.json")
    rm = ckpt(root / "rm")
    # the reward model's split (offline.rm_pairs: train.seed 0, rm.eval_size 200), for DPO and both evaluations
    rows = pairs.read_text().splitlines(keepends=True)
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    held = [json.loads(rows[i]) for i in order[:200]]
    train = root / "dpo_pairs.jsonl"
    train.write_text("".join(rows[i] for i in sorted(order[200:])))
    run("dpo", ["dpo", f"dpo.pairs={train}", f"model.init_from={warm}", "dpo.steps=300", "dpo.batch_size=32",
                f"train.output_dir={root / 'dpo'}"], root / "dpo" / "eval.json")
    implicit = ckpt(root / "dpo")
    for name, reward, beta in (("grpo_rm", f"rm:{rm}", a.beta), ("grpo_verifier", "gsm8k_accuracy", a.beta),
                               ("grpo_implicit_rm", f"rm:{implicit}", a.implicit_beta)):
        run(name, ["train", f"model.init_from={warm}", f"train.max_steps={a.grpo_steps}", f"algorithm.beta={beta}",
                   f"reward.functions=[{reward}]", f"train.output_dir={root / name}"], root / name / "eval.json")

    ev = {name: json.loads((root / name / "eval.json").read_text())
          for name in ("sft", "grpo_rm", "grpo_verifier", "grpo_implicit_rm")}
    rm_eval = json.loads((root / "rm" / "eval.json").read_text())
    from grpolab.rewards import get_reward
    accuracy = {}
    for name, model in (("rm", rm), ("implicit_rm", implicit)):
        fn = get_reward(f"rm:{model}")
        c = fn([p["prompt"] for p in held], [p["chosen"] for p in held])
        r = fn([p["prompt"] for p in held], [p["rejected"] for p in held])
        accuracy[name] = sum(a > b for a, b in zip(c, r)) / len(held)
    assert accuracy["rm"] == rm_eval["accuracy"], "the rm job's held-out pairs are not the ones scored here"
    n_pairs = sum(1 for _ in pairs.open())
    res = {
        "pairs": n_pairs, "rm_heldout_accuracy": rm_eval["accuracy"], "rm_heldout_margin": rm_eval["margin"],
        "implicit_rm_heldout_accuracy": accuracy["implicit_rm"],
        "greedy_accuracy": {k: v["greedy_accuracy"] for k, v in ev.items()},
        "pass@1": {k: v["pass@1"] for k, v in ev.items()},
        "seconds": secs,
    }
    warm_acc = ev["sft"]["greedy_accuracy"]
    res["checks"] = {"rm_heldout_accuracy_at_least_0.80": rm_eval["accuracy"] >= 0.80,
                     "implicit_rm_heldout_accuracy_at_least_0.80": accuracy["implicit_rm"] >= 0.80,
                     "grpo_with_rm_beats_warm_start": ev["grpo_rm"]["greedy_accuracy"] > warm_acc,
                     "grpo_with_implicit_rm_beats_warm_start": ev["grpo_implicit_rm"]["greedy_accuracy"] > warm_acc}
    print(json.dumps(res))
    return 0 if all(res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
