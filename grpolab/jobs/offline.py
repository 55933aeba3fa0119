"""What the offline jobs (sft, dpo, rm, distill) share: their rows, the starting model, and the run
around a trainer (resume, eval before and after, summary.json, report)."""

from __future__ import annotations

import json
from pathlib import Path

from .. import distributed
from ..config import Config
from ..data.formats import has
from ..data.loading import normalize_rows, read_records
from ..data.supervised import has_sft_target, sft_rows, task_sft_rows
from ..errors import ConfigError
from ..models.checkpoint import load_model
from ..monitor.console import Console
from ..train.callbacks import Hooks
from ..train.memory_budget import check_eval_memory
from ..train.run import Run
from ..utils.files import write_json
from .common import (
    EVAL_KEYS,
    make_console,
    model_device,
    setup_torch,
    write_run_report,
)
from .inputs import configure_rewards, load_data, load_policy

BUILTIN_TASKS = ("arithmetic", "gsm8k", "pyfunc", "humaneval")


def read_sft(cfg: Config, path: str, split: str) -> list[dict]:
    d = cfg.data
    return sft_rows(read_records(path, split, d.dataset_config), prompt_key=d.prompt_key, response_key=d.response_key,
                    source=path)


def task_rows(cfg: Config, console: Console) -> tuple[list[dict], list[dict], str | None]:
    """(train rows, test rows for accuracy, why there is no accuracy eval or None). Built-in tasks
    always have answers; a files task is evaluated when its rows have data.prompt_key and data.answer_key."""
    if cfg.data.task in BUILTIN_TASKS:
        configure_rewards(cfg, console)
        train, test = load_data(cfg)
        return train, test, None
    d = cfg.data
    opts = dict(prompt_key=d.prompt_key, system_prompt=d.system_prompt, prompt_suffix=d.prompt_suffix)
    train_records = read_records(d.train_path, d.train_split, d.dataset_config)
    train = normalize_rows(train_records, answer_key=None, source=d.train_path, **opts) \
        if train_records and all(has(r, d.prompt_key) for r in train_records) else []   # prompts (on-policy distill)
    test_src = d.test_path or d.train_path
    records = read_records(test_src, d.test_split, d.dataset_config)
    if not records or not all(has(r, d.prompt_key) and has(r, d.answer_key) for r in records):
        return train, [], f"{test_src} rows lack data.prompt_key/data.answer_key columns: no accuracy eval"
    return train, normalize_rows(records, answer_key=d.answer_key, source=test_src, **opts), None


def sft_data(cfg: Config, train_task: list[dict], test_task: list[dict],
             path: str | None) -> tuple[list[dict], list[dict]]:
    """(SFT rows, held-out SFT rows) for sft and logits distillation: `path` (sft.train_path,
    distill.train_path), else the task's (built-in: prompt + worked answer; files: data.train_path's
    prompt/completion or messages rows)."""
    d, s = cfg.data, cfg.sft
    if path:
        rows = read_sft(cfg, path, d.train_split)
    elif d.task in BUILTIN_TASKS:
        rows = task_sft_rows(train_task)
    else:
        rows = read_sft(cfg, d.train_path, d.train_split)
        rows = rows[:d.train_size] if d.train_size else rows
    if s.test_path:
        heldout = read_sft(cfg, s.test_path, d.test_split)
    elif d.task in BUILTIN_TASKS:
        heldout = task_sft_rows(test_task)
    elif d.test_path:   # the held-out file's rows, when they are SFT rows (an RL test file may have no completions)
        records = read_records(d.test_path, d.test_split, d.dataset_config)
        sft_like = records and all(has_sft_target(r, d.response_key) for r in records)
        heldout = sft_rows(records, prompt_key=d.prompt_key, response_key=d.response_key,
                           source=d.test_path) if sft_like else []
    else:
        heldout = []
    return rows, heldout


def start_job(cfg: Config, job: str, console: Console):
    """Run dir, resume checkpoint (train.resume), task rows; (run_dir, ckpt, train_task, test_task)."""
    if distributed.world_from_env().size > 1:
        raise ConfigError(f"{job} runs in one process; drop --nproc / torchrun (data-parallel {job} is not built yet)")
    if not cfg.eval.num_problems:
        raise ConfigError(f"eval.num_problems: 0 (no held-out eval) is for grpolab train; {job} reports its eval "
                          f"before and after training")
    run = Run(cfg, job)
    run.start()
    ckpt = run.resume_checkpoint()
    run_dir = run.dir
    train_task, test_task, why = task_rows(cfg, console)
    if why:
        console.info(why)
    return run_dir, ckpt, train_task, test_task


def starting_model(cfg: Config, ckpt, console: Console):
    if ckpt is not None:
        console.info(f"resuming from {ckpt}")
        return load_model(ckpt, dtype=cfg.model.dtype, device=model_device(cfg))
    return load_policy(cfg, [], console, warm_start=False)


def fresh_model(cfg: Config) -> bool:
    """The job starts from a newly initialised built-in GPT (nothing to evaluate before it trains)."""
    return cfg.model.name_or_path == "builtin" and not cfg.model.init_from


def finish_job(trainer, cfg: Config, run_dir: Path, ckpt, console: Console, before: dict | None,
               hooks: Hooks | None = None) -> dict:
    """Resume (ckpt), train, evaluate, write eval.json / summary.json and the report. `before`: the
    starting model's held-out eval when known (a pipeline's previous stage), else evaluated once
    before training. `hooks`: a Python caller's callbacks."""
    if trainer.max_steps == 0:
        raise ConfigError(f"{trainer.job}.steps: 0 steps to run; set {trainer.job}.steps or {trainer.job}.epochs")
    # an eval batch the memory cannot hold (eval.k, eval.batch_size): one line now, not at the final eval
    check_eval_memory(cfg, trainer.model, trainer.tok, getattr(trainer, "test_rows", []))
    if ckpt is not None:
        trainer.restore(ckpt, weights=False)
    before_file = run_dir / "eval_before.json"
    if ckpt is None or not before_file.is_file():
        if before is not None:
            before = {f"eval/{k}": v for k, v in before.items()}
        else:   # a freshly initialised model is not worth an evaluation (it is right by chance only)
            before = {} if fresh_model(cfg) else trainer.evaluate()
        write_json(before_file, before)
    before = json.loads(before_file.read_text())
    trainer.train(final_eval=True, hooks=hooks)   # the final eval is logged with the last step
    after = trainer.final_eval if trainer.final_eval is not None else trainer.evaluate()
    write_json(run_dir / "eval.json", {k.removeprefix("eval/"): v for k, v in after.items()})
    keys = [k for k in after if k.removeprefix("eval/") in getattr(trainer, "summary_keys", (*EVAL_KEYS, "loss"))]
    # (summary "before" is empty for a fresh model)
    summary = {"job": trainer.job, "before": {k.removeprefix("eval/"): before[k] for k in keys if k in before},
               "after": {k.removeprefix("eval/"): after[k] for k in keys}, "steps": trainer.max_steps,
               "seed": trainer.cfg.train.seed}
    write_json(run_dir / "summary.json", summary)
    if summary["after"]:   # no "before" value (a fresh model; a stage before without this metric): a dash
        b = summary["before"]
        console.table(["metric (held-out)", "before", "after", "change"],
                      [[k, b.get(k), v, v - b[k] if k in b else None] for k, v in summary["after"].items()],
                      always=True)
    write_run_report(run_dir, console)
    return summary


def run_job(cfg: Config, job: str, console: Console | None, body) -> dict:
    setup_torch(cfg)
    try:
        return body(console or make_console(cfg))
    finally:
        distributed.shutdown()


