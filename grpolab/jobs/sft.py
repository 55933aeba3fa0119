"""`grpolab sft`: supervised fine-tuning."""

from __future__ import annotations

from ..config import Config
from ..monitor.console import Console
from ..train.sft import SFTTrainer, warm_start_hook
from .inputs import fit_prompts
from .offline import finish_job, run_job, sft_data, start_job, starting_model


def run(cfg: Config, console: Console | None = None, before: dict | None = None) -> dict:
    """Supervised fine-tuning (`grpolab sft`); returns summary.json's contents."""
    return run_job(cfg, "sft", console, lambda c: _sft(cfg, c, before))


def _sft(cfg: Config, console: Console, before: dict | None) -> dict:
    run_dir, ckpt, train_task, test_task = start_job(cfg, "sft", console)
    rows, heldout = sft_data(cfg, train_task, test_task, cfg.sft.train_path)
    model, tok = starting_model(cfg, ckpt, console)
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    s = cfg.sft
    trainer = SFTTrainer(cfg, model, tok, rows, test_rows=test_task, heldout_rows=heldout, run_dir=run_dir,
                         console=console, batch_hook=warm_start_hook(cfg, len(rows)))
    console.info(f"sft: {len(rows)} rows, {trainer.max_steps} steps x {s.batch_size} rows")
    return finish_job(trainer, cfg, run_dir, ckpt, console, before)


