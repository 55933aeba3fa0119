"""`grpolab dpo`: direct preference optimisation on (prompt, chosen, rejected) rows."""

from __future__ import annotations

from argparse import Namespace

from ..config import Config
from ..data.loading import read_records
from ..data.preference import fit_pairs, preference_rows
from ..errors import ConfigError
from ..monitor.console import Console
from ..train.callbacks import Hooks
from ..train.dpo import DPOTrainer
from ..train.sft import model_context
from .inputs import fit_prompts
from .offline import finish_job, run_job, start_job, starting_model


def read_pairs(cfg: Config, path: str | None) -> list[dict]:
    if not path:
        raise ConfigError("dpo.pairs: give the preference rows (prompt, chosen, rejected), e.g. the file "
                          "`grpolab sample CHECKPOINT --pairs --out pairs.jsonl` writes")
    d = cfg.data
    return preference_rows(read_records(path, d.train_split, d.dataset_config), source=path, prompt_key=d.prompt_key,
                           chosen_key=d.chosen_key, rejected_key=d.rejected_key)


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab dpo`: everything is in cfg."""
    return run_dpo(cfg)


def run_dpo(cfg: Config, console: Console | None = None, before: dict | None = None,
           hooks: Hooks | None = None) -> dict:
    """Direct preference optimisation (`grpolab dpo`); returns summary.json's contents."""
    return run_job(cfg, "dpo", console, lambda c: _dpo(cfg, c, before, hooks))


def _dpo(cfg: Config, console: Console, before: dict | None, hooks: Hooks | None) -> dict:
    pairs = read_pairs(cfg, cfg.dpo.pairs)
    run_dir, ckpt, _, test_task = start_job(cfg, "dpo", console)
    model, tok = starting_model(cfg, ckpt, console)
    pairs, dropped = fit_pairs(pairs, tok, model_context(model) or 10 ** 9, source=cfg.dpo.pairs)
    if dropped:
        console.info(f"dpo: dropped {len(dropped)} of {len(pairs) + len(dropped)} pairs whose prompt fills the "
                     f"model's context (rows {', '.join(map(str, dropped[:10]))}{' ...' if len(dropped) > 10 else ''})")
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    trainer = DPOTrainer(cfg, model, tok, pairs, test_rows=test_task, run_dir=run_dir, console=console)
    console.info(f"dpo: {len(pairs)} pairs, {trainer.max_steps} steps x {cfg.dpo.batch_size} pairs, "
                 f"beta {cfg.dpo.beta}, {cfg.dpo.loss_type}")
    return finish_job(trainer, cfg, run_dir, ckpt, console, before, hooks)


