"""`grpolab distill`: a student distilled from distill.teacher (logits or on-policy)."""

from __future__ import annotations

from argparse import Namespace

from ..config import Config
from ..errors import ConfigError, DataError
from ..models.checkpoint import load_model
from ..monitor.console import Console
from ..train.callbacks import Hooks
from ..train.distill import DistillTrainer
from .common import model_device
from .inputs import fit_prompts
from .offline import finish_job, run_job, sft_data, start_job, starting_model


def check_vocabularies(teacher_tok, student_tok, teacher, student) -> None:
    """Teacher and student must share one vocabulary (same token ids for the same strings)."""
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    kinds = type(teacher_tok).__name__, type(student_tok).__name__
    if kinds[0] != kinds[1]:
        raise ConfigError(f"distill.teacher: its tokenizer ({kinds[0]}) is not the student's ({kinds[1]}); logit "
                          f"distillation needs one shared vocabulary")
    if hasattr(teacher_tok, "tok") and teacher_tok.tok.get_vocab() != student_tok.tok.get_vocab():
        raise ConfigError("distill.teacher: its vocabulary differs from the student's (token ids map to different "
                          "strings); distil between models that share a tokenizer")
    if tv != sv:
        raise ConfigError(f"distill.teacher: its output layer has {tv} tokens, the student's {sv}; logit distillation "
                          f"needs one shared vocabulary")


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab distill`: everything is in cfg."""
    return run_distill(cfg)


def run_distill(cfg: Config, console: Console | None = None, before: dict | None = None,
               hooks: Hooks | None = None) -> dict:
    """Distillation from distill.teacher into the student (`grpolab distill`); returns summary.json's contents."""
    return run_job(cfg, "distill", console, lambda c: _distill(cfg, c, before, hooks))


def _distill(cfg: Config, console: Console, before: dict | None, hooks: Hooks | None) -> dict:
    d = cfg.distill
    if not d.teacher:
        raise ConfigError("distill.teacher: give the teacher, a checkpoint (…/checkpoints/step_N) or a Hugging Face "
                          "model directory")
    run_dir, ckpt, train_task, test_task = start_job(cfg, "distill", console)
    teacher, teacher_tok = load_model(d.teacher, dtype=cfg.model.dtype, device=model_device(cfg))
    model, tok = starting_model(cfg, ckpt, console)
    check_vocabularies(teacher_tok, tok, teacher, model)
    test_task = fit_prompts(cfg, model, tok, test_task, console, "test") if test_task else []
    if d.mode == "on_policy":
        if not train_task:
            raise DataError("distill.mode=on_policy: needs prompts; use a task with prompts (data.task)")
        rows = fit_prompts(cfg, model, tok, train_task, console, "train")
    else:
        rows, _ = sft_data(cfg, train_task, test_task, d.train_path)
    trainer = DistillTrainer(cfg, model, tok, teacher, rows, test_rows=test_task, run_dir=run_dir, console=console)
    console.info(f"distill ({d.mode}{', ' + d.kl + ' KL' if d.mode == 'logits' else ''}): teacher {d.teacher}, "
                 f"student {model.num_params() / 1e6:.2f}M parameters, {trainer.max_steps} steps")
    return finish_job(trainer, cfg, run_dir, ckpt, console, before, hooks)
