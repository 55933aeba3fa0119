"""save_model's copy: a checkpoint's model files (weights, config, tokenizer; not its training state) copied into a
directory the way transformers' save_pretrained writes one: files of the same names are replaced and every other
file stays, so `save_model(output_dir)`, TRL's idiom, leaves the run whole. Refused in one line: a target in the
run's checkpoints/ (a resume reads them), and one holding another model's files that the copy would not replace (a
directory mixing two models loads the wrong one)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..errors import ConfigError

# a checkpoint's training state, and the eval outputs `grpolab eval` may have left in it: not the model
NOT_MODEL = ("optimizer.pt", "rng.pt", "ref.safetensors", "critic.safetensors", "critic_optimizer.pt",
             "trainer_state.json", "manifest.json", "run_config.yaml", "eval.json", "eval_samples.jsonl")
# the files that decide what a directory loads as (transformers, peft, grpolab's built-in GPT)
MODEL_FILE = re.compile(r"((adapter_|model_)?config\.json|.*\.(safetensors|bin|gguf)|.*\.index\.json)")


def copy_model(ckpt: Path, target: Path) -> None:
    """The model files of `ckpt` (a run's checkpoints/step_N) into `target`, made if missing."""
    checkpoints = ckpt.parent.resolve()
    where = target.resolve()
    if where == checkpoints or checkpoints in where.parents:
        raise ConfigError(f"save_model: {target} is inside the run's checkpoints ({ckpt.parent}), which a resume "
                          f"reads; give another directory, e.g. the run directory {ckpt.parent.parent}")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"save_model: {target} is a file; give a directory")
    names = [p.name for p in sorted(ckpt.iterdir()) if p.name not in NOT_MODEL]
    if target.is_dir():
        stale = sorted(p.name for p in target.iterdir() if MODEL_FILE.fullmatch(p.name) and p.name not in names)
        if stale:
            raise ConfigError(f"save_model: {target} holds {', '.join(stale)} of another model, which the copy "
                              f"would not replace (the directory would load as a mix of two models); give a new or "
                              f"empty directory, or remove them")
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            if (ckpt / name).is_dir():
                shutil.copytree(ckpt / name, target / name, dirs_exist_ok=True)
            else:
                shutil.copyfile(ckpt / name, target / name)
    except OSError as e:
        raise ConfigError(f"save_model: cannot write {target}: {e.strerror or e}") from None
