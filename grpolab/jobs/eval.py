"""`grpolab eval`: a checkpoint (ours, or any Hugging Face model directory) on the test split."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from ..models.checkpoint import load_model
from ..monitor.console import Console
from ..rollout.env_decode import build_env_use
from ..rollout.tool_decode import build_tool_use
from ..train.eval_rewards import eval_functions, scores_answers
from ..train.evaluate import evaluate
from ..train.memory_budget import check_eval_memory
from .common import setup_torch
from .inputs import check_eval_rows, configure_rewards, fit_prompts, load_data


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab eval CHECKPOINT [--out DIR]`."""
    return run_eval(args.checkpoint, cfg, out=args.out)


def run_eval(checkpoint: str, cfg: Config, console: Console | None = None, out: str | None = None) -> dict:
    """Evaluate a checkpoint (ours, or any Hugging Face model directory) on the test split;
    writes eval.json and eval_samples.jsonl to `out` and prints a table."""
    if not cfg.eval.num_problems:
        raise ConfigError("eval.num_problems: 0 evaluates nothing; give the number of test problems")
    console = console or Console(level=cfg.log.level)
    setup_torch(cfg)
    model, tok = load_model(checkpoint, dtype=cfg.model.dtype, device=cfg.model.device)
    runtime = configure_rewards(cfg, console)
    _, test_rows = load_data(cfg)
    check_eval_rows(cfg, test_rows)
    test_rows = fit_prompts(cfg, model, tok, test_rows, console, "test")
    check_eval_memory(cfg, model, tok, test_rows)   # eval.k / eval.batch_size beyond the memory: one line
    e = cfg.eval
    # eval.reward's default follows reward.functions (config/validate.py eval_check): say which check scores
    rows = test_rows[:e.num_problems]
    console.info(f"eval: {len(rows)} problems scored by eval.reward={e.reward}" if scores_answers(e.reward, rows)
                 else f"eval: {len(rows)} problems without answers: no accuracy, the reward functions' means only")
    functions, said = eval_functions(cfg.reward.functions, rows)   # their means on the greedy completions
    for line in said:
        console.info(line)
    res = evaluate(model, tok, rows, k=e.k, temperature=e.temperature,
                   max_new_tokens=cfg.rollout.max_new_tokens, batch_size=e.batch_size, seed=cfg.train.seed,
                   reward=e.reward, runtime=runtime, functions=functions,
                   tools=build_tool_use(cfg.rollout, tok, checkpoint, runtime) or build_env_use(cfg, tok, checkpoint))
    samples = res.pop("samples")
    out_dir = Path(out or checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(res, indent=2))
    with open(out_dir / "eval_samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    console.table(["metric", "value"], [[k, v] for k, v in res.items()], always=True)
    return res
