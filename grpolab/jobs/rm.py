"""`grpolab rm`: a reward model trained on preference pairs."""

from __future__ import annotations

import random
from argparse import Namespace
from pathlib import Path

from .. import distributed
from ..config import Config
from ..data.loading import read_records
from ..data.preference import heldout_size, preference_rows
from ..errors import ConfigError
from ..models import CharTokenizer, build_builtin
from ..models.checkpoint import list_checkpoints, load_model
from ..models.hf import DTYPES, resolve_device
from ..models.lora import lora_config
from ..models.reward_head import BUILTIN_RM, BuiltinRewardModel, checkpoint_kind, load_builtin_rm, load_hf_rm
from ..monitor.console import Console
from ..train.callbacks import Hooks
from ..train.rm import RewardTrainer
from ..train.run import Run
from .common import model_device
from .offline import finish_job, run_job


def rm_pairs(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(training pairs, held-out pairs): rm.test_pairs, else rm.eval_size pairs drawn from rm.pairs with
    train.seed (the same split on every run and resume)."""
    r = cfg.rm
    if not r.pairs:
        raise ConfigError("rm.pairs: give the preference rows (prompt, chosen, rejected), e.g. the file "
                          "`grpolab sample CHECKPOINT --pairs --out pairs.jsonl` writes")
    pairs = read_preferences(cfg, r.pairs, margin=True)
    if r.test_pairs:
        return pairs, read_preferences(cfg, r.test_pairs, margin=True)
    k = heldout_size(r.eval_size, len(pairs))
    if not k:
        return pairs, []
    if k >= len(pairs):
        raise ConfigError(f"rm.eval_size: {k} held-out pairs leave none of the {len(pairs)} in rm.pairs "
                          f"to train on; lower rm.eval_size or give rm.test_pairs")
    order = list(range(len(pairs)))
    random.Random(cfg.train.seed).shuffle(order)
    held = set(order[:k])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def read_preferences(cfg: Config, path: str, margin: bool = False) -> list[dict]:
    d = cfg.data
    return preference_rows(read_records(path, d.train_split, d.dataset_config), source=path, margin=margin,
                           prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key)


def load_rm(cfg: Config, ckpt, console: Console):
    """The reward model to train: resumed from `ckpt`, or a score head on model.init_from (a policy
    checkpoint: the usual start is the SFT model) / model.name_or_path (a Hugging Face model, or a
    fresh built-in GPT); LoRA (model.lora_rank) applied."""

    m = cfg.model
    device = str(resolve_device(model_device(cfg)))
    source = m.init_from or (None if m.name_or_path == "builtin" else m.name_or_path)
    if ckpt is not None and checkpoint_kind(ckpt) == BUILTIN_RM:
        console.info(f"resuming from {ckpt}")
        return load_builtin_rm(ckpt, device)   # base and adapters together
    if ckpt is not None and not m.lora_rank:
        console.info(f"resuming from {ckpt}")
        source = str(ckpt)
    kind = checkpoint_kind(source) if source else "fresh"
    if kind == "builtin-gpt":
        policy, tok = load_model(source, device=device)
        rm = BuiltinRewardModel(policy, tok)
    elif kind == BUILTIN_RM:
        rm = load_builtin_rm(source, device)
    elif kind == "fresh":
        tok = CharTokenizer()
        rm = BuiltinRewardModel(build_builtin(m, tok), tok)
    elif kind == "adapter":
        raise ConfigError(f"model.init_from: {source} is a LoRA adapter; merge it first (`grpolab export "
                          f"{source} OUT --merge`) and start the reward model from OUT")
    else:
        key = "model.init_from" if m.init_from else "model.name_or_path"
        if source.startswith((".", "/", "~")) and not Path(source).expanduser().is_dir():
            raise ConfigError(f"{key}: {source!r} is not a directory; give a checkpoint, a Hugging Face model "
                              f"directory or a hub id")
        try:
            rm = load_hf_rm(source, dtype=DTYPES[m.dtype], trust_remote_code=m.trust_remote_code)
        except OSError as e:
            raise ConfigError(f"{key}: cannot load a model and tokenizer from {source!r} "
                              f"({(str(e).strip().splitlines() or [''])[0]})") from None
    rm = rm.to(device)
    if m.lora_rank and not rm.lora:
        rm.add_lora(lora_config(m, rm.lora_target()))
        if ckpt is not None:   # a Hugging Face LoRA reward model resumes its adapter on the same base
            import peft
            from safetensors.torch import load_file
            peft.set_peft_model_state_dict(rm.hf, load_file(str(Path(ckpt) / "adapter" / "adapter_model.safetensors")))
            console.info(f"resuming from {ckpt}")
    if m.gradient_checkpointing:
        rm.set_gradient_checkpointing(True)
    return rm


def run(cfg: Config, args: Namespace) -> dict:
    """`grpolab rm`: everything is in cfg."""
    return run_rm(cfg)


def run_rm(cfg: Config, console: Console | None = None, before: dict | None = None,
          hooks: Hooks | None = None) -> dict:
    """Reward-model training (`grpolab rm`); returns summary.json's contents."""
    return run_job(cfg, "rm", console, lambda c: _rm(cfg, c, before, hooks))


def _rm(cfg: Config, console: Console, before: dict | None, hooks: Hooks | None) -> dict:
    pairs, test_pairs = rm_pairs(cfg)
    if distributed.world_from_env().size > 1:
        raise ConfigError("rm runs in one process; drop --nproc / torchrun")
    run = Run(cfg, "rm")
    run.start()
    ckpt = run.resume_checkpoint()
    run_dir = run.dir
    rm = load_rm(cfg, ckpt, console)
    trainer = RewardTrainer(cfg, rm, pairs, test_pairs=test_pairs, run_dir=run_dir, console=console)
    trained = sum(p.numel() for p in rm.parameters() if p.requires_grad)
    console.info(f"rm: {len(pairs)} pairs ({len(test_pairs)} held out), {trainer.max_steps} steps x "
                 f"{cfg.rm.batch_size} pairs, {trained / 1e6:.2f}M trained parameters")
    summary = finish_job(trainer, cfg, run_dir, ckpt, console, before, hooks)
    final = list_checkpoints(run_dir / "checkpoints")[-1]
    console.result(f"reward model: {final} (use it as reward.functions=[rm:{final}])")
    return summary


