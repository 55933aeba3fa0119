"""`grpolab demo`: warm start, evaluate, GRPO, evaluate; a before/after table and summary.json."""

from __future__ import annotations

import json
import time
from argparse import Namespace

from .. import distributed
from ..config import Config
from ..errors import ConfigError
from ..monitor.console import Console
from ..train.grpo import GRPOTrainer
from ..train.run import Run
from .common import EVAL_KEYS, make_console, setup_torch, write_run_report
from .train import build_trainer


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab demo`: cfg holds --steps, --seed and --out (cli.py folds them in)."""
    return run_demo(cfg)


def run_demo(cfg: Config, console: Console | None = None) -> dict:
    """Warm start, evaluate, GRPO, evaluate; print a before/after table; write summary.json."""
    t0 = time.perf_counter()
    setup_torch(cfg)
    try:
        return _demo(cfg, console or make_console(cfg), t0)
    finally:
        distributed.shutdown()


def _demo(cfg: Config, console: Console, t0: float) -> dict:
    if not cfg.eval.num_problems:
        raise ConfigError("eval.num_problems: 0 (no held-out eval) is for grpolab train; the demo's summary is "
                          "its eval before and after training")
    run = Run(cfg, GRPOTrainer.job)
    run.start()
    run_dir = run.dir
    trainer = build_trainer(cfg, run, console)
    try:
        console.info(f"evaluating on {len(trainer.test_rows)} held-out problems ...")
        before = trainer.evaluate()
        console.info(f"GRPO: {cfg.train.max_steps} steps x {cfg.rollout.prompts_per_step} prompts x "
                     f"{cfg.rollout.num_generations} completions")
        history = trainer.train(final_eval=True)
        after = trainer.final_eval if trainer.final_eval is not None else trainer.evaluate()
    finally:
        trainer.close()
    wall = time.perf_counter() - t0
    gen_tps = [m["perf/gen_tokens_per_sec"] for m in history]
    summary = {"before": {k: before[k] for k in EVAL_KEYS if k in before},
               "after": {k: after[k] for k in EVAL_KEYS if k in after},
               "steps": cfg.train.max_steps, "seed": cfg.train.seed, "wall_seconds": wall,
               "rollout_tokens_per_sec": sorted(gen_tps)[len(gen_tps) // 2] if gen_tps else None}
    if trainer.world.main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        console.info("")
        console.table(["metric (held-out)", "before", "after", "change"],
                      [[k, before[k], after[k], after[k] - before[k]] for k in EVAL_KEYS if k in before],
                      always=True)
        console.result(f"\nwall time {wall:.0f}s; summary in {run_dir / 'summary.json'}")
        write_run_report(run_dir, console)
    distributed.barrier()
    return summary
