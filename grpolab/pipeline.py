"""The jobs behind the CLI: demo, train, eval. Each wires library pieces in order."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import yaml

from .config import Config
from .data.tasks import arithmetic
from .eval import evaluate
from .logging.console import Console
from .models import CharTokenizer, build_builtin
from .train.checkpoint import load_model
from .train.grpo import GRPOTrainer
from .train.sft import train_sft

EVAL_KEYS = ("greedy_accuracy", "pass@1", "pass@8")


def setup_torch(cfg: Config) -> None:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    d = cfg.data
    task = arithmetic.ArithmeticConfig(min_ops=d.min_ops, max_ops=d.max_ops, max_operand=d.max_operand,
                                       max_value=d.max_value, allow_mul=d.allow_mul)
    return (arithmetic.generate("train", d.train_size, cfg.train.seed, task),
            arithmetic.generate("test", d.test_size, cfg.train.seed, task))


def load_policy(cfg: Config, train_rows: list[dict], console: Console):
    """The starting policy: a checkpoint (model.init_from), or a fresh model warm-started with SFT."""
    if cfg.model.init_from:
        console.info(f"loading {cfg.model.init_from}")
        return load_model(cfg.model.init_from)
    tok = CharTokenizer()
    model = build_builtin(cfg.model, tok)
    console.info(f"built-in GPT: {model.num_params() / 1e6:.2f}M parameters")
    if cfg.sft.steps:
        t0 = time.perf_counter()
        rows = arithmetic.warm_start_rows(train_rows, cfg.sft.bare_fraction, cfg.train.seed)
        train_sft(model, tok, rows, cfg.sft, seed=cfg.train.seed, log=console.info)
        console.info(f"warm start done in {time.perf_counter() - t0:.0f}s")
    model.eval()
    return model, tok


def write_run_config(cfg: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def run_train(cfg: Config, console: Console | None = None) -> dict:
    """SFT/loading, GRPO for train.max_steps, final eval. Returns the final eval metrics."""
    console = console or Console()
    setup_torch(cfg)
    run_dir = Path(cfg.train.output_dir)
    write_run_config(cfg, run_dir)
    train_rows, test_rows = load_data(cfg)
    model, tok = load_policy(cfg, train_rows, console)
    trainer = GRPOTrainer(cfg, model, tok, train_rows, test_rows, run_dir, console)
    trainer.train()
    final = trainer.evaluate()
    (run_dir / "eval.json").write_text(json.dumps(final, indent=2))
    console.info("final eval: " + "  ".join(f"{k} {v:.3f}" for k, v in final.items()))
    return final


def run_demo(cfg: Config, console: Console | None = None) -> dict:
    """Warm start, evaluate, GRPO, evaluate; print a before/after table; write summary.json."""
    console = console or Console()
    t0 = time.perf_counter()
    setup_torch(cfg)
    run_dir = Path(cfg.train.output_dir)
    write_run_config(cfg, run_dir)
    train_rows, test_rows = load_data(cfg)
    model, tok = load_policy(cfg, train_rows, console)
    trainer = GRPOTrainer(cfg, model, tok, train_rows, test_rows, run_dir, console)
    console.info(f"evaluating on {len(trainer.test_rows)} held-out problems ...")
    before = trainer.evaluate()
    console.info(f"GRPO: {cfg.train.max_steps} steps x {cfg.rollout.prompts_per_step} prompts x "
                 f"{cfg.rollout.num_generations} completions")
    history = trainer.train()
    after = trainer.evaluate()
    wall = time.perf_counter() - t0
    gen_tps = [m["perf/gen_tokens_per_sec"] for m in history]
    summary = {"before": {k: before[k] for k in EVAL_KEYS if k in before},
               "after": {k: after[k] for k in EVAL_KEYS if k in after},
               "steps": cfg.train.max_steps, "seed": cfg.train.seed, "wall_seconds": wall,
               "rollout_tokens_per_sec": sorted(gen_tps)[len(gen_tps) // 2] if gen_tps else None}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.info("")
    console.table(["metric (held-out)", "before", "after", "change"],
                  [[k, before[k], after[k], after[k] - before[k]] for k in EVAL_KEYS if k in before])
    console.info(f"\nwall time {wall:.0f}s; summary in {run_dir / 'summary.json'}")
    return summary


def run_eval(checkpoint: str, cfg: Config, console: Console | None = None, out: str | None = None) -> dict:
    """Evaluate a checkpoint on the test split; writes eval.json and eval_samples.jsonl to `out`."""
    console = console or Console()
    setup_torch(cfg)
    model, tok = load_model(checkpoint)
    _, test_rows = load_data(cfg)
    e = cfg.eval
    res = evaluate(model, tok, test_rows[:e.num_problems], k=e.k, temperature=e.temperature,
                   max_new_tokens=cfg.rollout.max_new_tokens, batch_size=e.batch_size, seed=cfg.train.seed)
    samples = res.pop("samples")
    out_dir = Path(out or checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(res, indent=2))
    with open(out_dir / "eval_samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    console.table(["metric", "value"], [[k, v] for k, v in res.items()])
    return res
