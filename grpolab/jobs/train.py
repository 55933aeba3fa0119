"""`grpolab train`: GRPO (and its family) for train.max_steps, then the final eval."""

from __future__ import annotations

import json
from argparse import Namespace

import torch

from .. import distributed
from ..config import Config
from ..errors import ConfigError
from ..models import CharTokenizer
from ..models.checkpoint import load_model
from ..models.hf import resolve_device
from ..monitor.console import Console
from ..train.callbacks import Hooks
from ..train.eval_rewards import scores_answers
from ..train.grpo import GRPOTrainer
from ..train.memory_budget import builtin_shape, check_run_memory
from ..train.run import Run
from .common import make_console, model_device, setup_torch, write_run_report
from .inputs import check_eval_rows, configure_rewards, fit_prompts, fit_prompts_to, load_data, load_policy


def build_trainer(cfg: Config, run: Run, console: Console) -> GRPOTrainer:
    """Data, starting policy (warm-started if built-in), prompt-length filter, trainer."""
    problem = distributed.check_world(distributed.world_from_env(), cfg.rollout.prompts_per_step)
    if problem:   # before any work, not after the warm start
        raise ConfigError(problem)
    ckpt = run.resume_checkpoint()   # rank 0 finds (and repairs) it; the others take its answer
    configure_rewards(cfg, console)
    train_rows, test_rows = load_data(cfg)
    said = eval_check_line(cfg, test_rows)
    if said:
        console.info(said)
    fitted = None
    if ckpt is None and cfg.model.name_or_path == "builtin" and not cfg.model.init_from:
        # before the warm start, not after it: prompts that cannot fit, a run larger than the machine
        fitted = (fit_prompts_to(cfg, cfg.model.block_size, CharTokenizer(), train_rows, console, "train"),
                  fit_prompts_to(cfg, cfg.model.block_size, CharTokenizer(), test_rows, console, "test"))
        check_run_memory(cfg, builtin_shape(cfg.model, CharTokenizer().vocab_size), CharTokenizer(), *fitted,
                         resolve_device(model_device(cfg)), distributed.world_from_env(), cfg.model.block_size)
    if ckpt is not None:   # the checkpoint holds the policy: no warm start again
        console.info(f"resuming from {ckpt}")
        model, tok = load_model(ckpt, dtype=cfg.model.dtype, device=model_device(cfg))
    else:
        model, tok = load_policy(cfg, train_rows, console)   # the warm start reads every row, as it always has
    train_rows, test_rows = fitted or (fit_prompts(cfg, model, tok, train_rows, console, "train"),
                                       fit_prompts(cfg, model, tok, test_rows, console, "test"))
    trainer = GRPOTrainer(cfg, model, tok, train_rows, test_rows, run.dir, console)
    check_eval_rows(cfg, test_rows)   # after the training reward's own check of the train rows
    for line in trainer.eval_said:   # reward functions that cannot score the eval rows
        console.info(line)
    if ckpt is not None:
        trainer.restore(ckpt, weights=False)   # the policy was loaded from ckpt above
    return trainer


def eval_check_line(cfg: Config, test_rows: list[dict] | None = None) -> str | None:
    """What the held-out eval scores with, said at start when the training reward is another one: the eval's
    correctness check (eval.reward) is not the training reward, and a user's own reward is no accuracy. Held-out
    rows without answers: no accuracy at all, the reward functions' means only."""
    if not cfg.eval.num_problems:
        return None
    if test_rows is not None and not scores_answers(cfg.eval.reward, test_rows[:cfg.eval.num_problems]):
        return (f"eval: the held-out rows have no answers, so eval.reward={cfg.eval.reward} scores nothing (no greedy "
                f"accuracy or pass@k); the eval reports each reward function's mean on its greedy completions "
                f"(eval/rewards/<name>/mean)")
    if cfg.eval.reward in cfg.reward.functions:
        return None
    return (f"eval: greedy accuracy and pass@{cfg.eval.k} on {cfg.eval.num_problems} held-out problems are scored "
            f"by eval.reward={cfg.eval.reward} against each row's answer, not by the training reward "
            f"({', '.join(map(str, cfg.reward.functions))}); set eval.reward to the check that fits the data")


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab train`: everything is in cfg."""
    return run_train(cfg)


def run_train(cfg: Config, console: Console | None = None, hooks: Hooks | None = None) -> dict:
    """SFT/loading, GRPO for train.max_steps, final eval. Returns the final eval metrics. `hooks`: a Python
    caller's callbacks."""
    setup_torch(cfg)
    try:
        return _train(cfg, console or make_console(cfg), hooks)
    finally:   # also on errors and Ctrl-C: a rank leaves its process group cleanly
        distributed.shutdown()


def _train(cfg: Config, console: Console, hooks: Hooks | None) -> dict:
    run = Run(cfg, GRPOTrainer.job)
    run.start()
    run_dir = run.dir
    trainer = build_trainer(cfg, run, console)
    if trainer.world.size > 1:
        console.info(f"{trainer.world.size} ranks ({torch.distributed.get_backend()}), "
                     f"{torch.get_num_threads()} threads each")
    try:
        trainer.train(final_eval=True, hooks=hooks)   # the final eval is logged with the last step
        final = trainer.final_eval if trainer.final_eval is not None else trainer.evaluate()
    finally:
        trainer.close()
    if trainer.world.main and not cfg.eval.num_problems:
        console.result("final eval: none (eval.num_problems=0; no eval.json)")
    elif trainer.world.main:
        (run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        console.result("final eval: " + "  ".join(f"{k} {v:.3f}" for k, v in final.items()))
    if trainer.world.main:   # with or without an eval
        write_run_report(run_dir, console)
    distributed.barrier()   # all ranks leave together: none tears down the group while rank 0 still writes
    return final
