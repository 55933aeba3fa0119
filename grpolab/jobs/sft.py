"""`grpolab sft`: supervised fine-tuning.

The sft section's defaults are the built-in model's warm start (lr 3e-3, 20 warmup steps). For a
Hugging Face model, a default the user left as it is changes (one line at start says which):
sft.lr 3e-3 -> TRL's values, 2e-5 (SFTConfig's default) for full fine-tuning or 2e-4 (TRL's LoRA
example, "~10x the full fine-tuning rate") with model.lora_rank; a default sft.warmup_steps longer
than the run becomes a tenth of its steps. For every model, a warmup_steps the user set longer than
the run is refused. With sft.train_path rows on a Hugging Face model and data.task left at the
built-in arithmetic task, there is no eval on that task (the line says so).
"""

from __future__ import annotations

from argparse import Namespace

from ..config import Config
from ..config.schema import SFTConfig
from ..errors import ConfigError
from ..monitor.console import Console
from ..train.callbacks import Hooks
from ..train.offline_trainer import total_steps
from ..train.sft import SFTTrainer, warm_start_hook
from .inputs import fit_prompts
from .offline import finish_job, read_sft, run_job, sft_data, start_job, starting_model

BUILTIN_DEFAULTS = SFTConfig()
DEFAULT_TASK = "arithmetic"
HF_LR = 2e-5        # TRL SFTConfig's learning_rate default (full fine-tuning)
HF_LORA_LR = 2e-4   # TRL's LoRA example (trl/scripts/sft.py, PEFT docs)


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab sft`: everything is in cfg."""
    return run_sft(cfg)


def run_sft(cfg: Config, console: Console | None = None, before: dict | None = None,
           hooks: Hooks | None = None) -> dict:
    """Supervised fine-tuning (`grpolab sft`); returns summary.json's contents."""
    return run_job(cfg, "sft", console, lambda c: _sft(cfg, c, before, hooks))


def hf_model(cfg: Config) -> bool:
    return cfg.model.name_or_path != "builtin"


def hf_lr(cfg: Config) -> str | None:
    """For a Hugging Face model with sft.lr at the built-in model's default: sets TRL's lr; the line to say."""
    s = cfg.sft
    if not hf_model(cfg) or s.lr != BUILTIN_DEFAULTS.lr:
        return None
    s.lr = HF_LORA_LR if cfg.model.lora_rank else HF_LR
    what = "TRL's LoRA example" if cfg.model.lora_rank else "TRL SFTConfig's default for full fine-tuning"
    return f"sft.lr {BUILTIN_DEFAULTS.lr:g} -> {s.lr:g} ({what})"


def fit_warmup(cfg: Config, steps: int) -> str | None:
    """sft.warmup_steps within the run's `steps`: a value the user set longer is refused with one line;
    the default, for a Hugging Face model, becomes a tenth of the steps (returns the line to say)."""
    s = cfg.sft
    if s.warmup_steps <= steps or (s.warmup_steps == BUILTIN_DEFAULTS.warmup_steps and not hf_model(cfg)):
        return None   # (the built-in model keeps the warm start's recipe: `grpolab sft` is the demo's warm start)
    if s.warmup_steps != BUILTIN_DEFAULTS.warmup_steps:
        raise ConfigError(f"sft.warmup_steps={s.warmup_steps} is longer than the run's {steps} steps "
                          f"({'sft.epochs' if s.epochs else 'sft.steps'}): the lr would never reach sft.lr; "
                          f"set sft.warmup_steps <= {steps}")
    s.warmup_steps = steps // 10
    return f"sft.warmup_steps {BUILTIN_DEFAULTS.warmup_steps} -> {s.warmup_steps} (a tenth of the {steps} steps)"


def own_rows_only(cfg: Config) -> bool:
    """SFT on the user's rows (sft.train_path) with a Hugging Face model and data.task left at the
    built-in task: that task's eval would measure something the run does not train."""
    return hf_model(cfg) and bool(cfg.sft.train_path) and cfg.data.task == DEFAULT_TASK


def _sft(cfg: Config, console: Console, before: dict | None, hooks: Hooks | None) -> dict:
    s = cfg.sft
    changed = [hf_lr(cfg)]
    if not s.epochs:   # known before the data: config.yaml records the value used
        changed.append(fit_warmup(cfg, s.steps))
    run_dir, ckpt, train_task, test_task = start_job(cfg, "sft", console)
    rows, heldout = sft_data(cfg, train_task, test_task, s.train_path)
    if s.epochs:
        changed.append(fit_warmup(cfg, total_steps(s, len(rows))))
    changed = [c for c in changed if c]
    if changed:
        console.info(f"sft: defaults for a Hugging Face model: "
                     f"{'; '.join(changed)}; set the keys to choose")
    if own_rows_only(cfg):
        test_task = []
        heldout = read_sft(cfg, s.test_path, cfg.data.test_split) if s.test_path else []
        console.info(f"sft: no eval on the built-in {DEFAULT_TASK} task (the rows are sft.train_path's); "
                     f"sft.test_path gives a held-out loss, data.task an accuracy eval")
    model, tok = starting_model(cfg, ckpt, console)
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    trainer = SFTTrainer(cfg, model, tok, rows, test_rows=test_task, heldout_rows=heldout, run_dir=run_dir,
                         console=console, batch_hook=warm_start_hook(cfg, len(rows)))
    console.info(f"sft: {len(rows)} rows, {trainer.max_steps} steps x {s.batch_size} rows")
    return finish_job(trainer, cfg, run_dir, ckpt, console, before, hooks)
