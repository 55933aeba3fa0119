"""Checkpoints: atomic save (temp dir, fsync, rename) and loading.

Layout of checkpoints/step_N/:
    model.safetensors      weights
    model_config.json      built-in GPT: architecture ({"type": "builtin-gpt", ...GPTConfig})
    config.json, tokenizer Hugging Face models: the `save_pretrained` layout, so
    files, ...             `AutoModelForCausalLM.from_pretrained(step_N)` loads it
    optimizer.pt           optimizer and scheduler state (present for training checkpoints)
    trainer_state.json     step and data position
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file, save_model
from safetensors.torch import load_model as load_safetensors_model

from ..models import GPT, GPTConfig, CharTokenizer
from ..models.hf import HFPolicy, load_hf


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: str | Path, step: int, model, *, tokenizer=None, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, rng: dict | None = None, ref_model=None) -> Path:
    """Write checkpoints/step_N atomically; an interrupted write never leaves a half checkpoint."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if isinstance(model, HFPolicy):
        model.save(tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)
    else:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "model_config.json").write_text(json.dumps({"type": "builtin-gpt", **model.config.to_dict()},
                                                          indent=2))
    if optimizer is not None:
        torch.save({"optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / "optimizer.pt")
    if rng is not None:
        torch.save(rng, tmp / "rng.pt")
    if ref_model is not None:
        ref = ref_model.hf if isinstance(ref_model, HFPolicy) else ref_model
        save_model(ref, str(tmp / "ref.safetensors"))   # save_model handles tied (shared) weights
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(trainer_state or {})}, indent=2))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from a checkpoint directory: a built-in GPT checkpoint, or any
    Hugging Face model directory (ours or one saved elsewhere)."""
    p = Path(path)
    cfg_file = p / "model_config.json"
    if not cfg_file.is_file():
        if (p / "config.json").is_file():
            return load_hf(str(p), dtype=dtype, device=device)
        raise FileNotFoundError(f"{str(p)!r} is not a checkpoint: no model_config.json (built-in GPT) "
                                f"or config.json (Hugging Face model)")
    meta = json.loads(cfg_file.read_text())
    meta.pop("type", None)
    model = GPT(GPTConfig(**meta))
    model.load_state_dict(load_file(str(p / "model.safetensors")))
    model.to(device).eval()
    return model, CharTokenizer()


def _step_of(p: Path) -> int:
    return int(p.name.split("_", 1)[1])


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoints (step_N; never the .tmp_ ones a crash may leave), oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()
             and (p / "trainer_state.json").is_file()]
    return sorted(found, key=_step_of)


def prune_checkpoints(ckpt_root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (keep 0 = keep all)."""
    if keep > 0:
        for p in list_checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(p)


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """train.resume: 'auto' -> the newest checkpoint under output_dir (None if there is none); else the path."""
    if resume == "auto":
        found = list_checkpoints(Path(output_dir) / "checkpoints")
        return found[-1] if found else None
    p = Path(resume)
    if not (p / "trainer_state.json").is_file() or not (p / "optimizer.pt").is_file():
        raise FileNotFoundError(f"train.resume: {resume!r} is not a training checkpoint (checkpoints/step_N "
                                f"with trainer_state.json and optimizer.pt)")
    return p


def load_training_state(path: str | Path, model=None, ref_model=None) -> dict:
    """Load a checkpoint's weights into `model` (skipped when None, e.g. a model just loaded from
    this checkpoint) and its reference into `ref_model`, in place; return optimizer, scheduler,
    RNG and trainer state."""
    p = Path(path)
    if model is not None:
        loaded, _ = load_model(p, device=str(next(model.parameters()).device))
        model.load_state_dict(loaded.state_dict())
    if ref_model is not None:
        target = ref_model.hf if isinstance(ref_model, HFPolicy) else ref_model
        if (p / "ref.safetensors").is_file():
            load_safetensors_model(target, str(p / "ref.safetensors"))
    opt = torch.load(p / "optimizer.pt", weights_only=False)
    rng = torch.load(p / "rng.pt", weights_only=False) if (p / "rng.pt").is_file() else {}
    trainer = json.loads((p / "trainer_state.json").read_text())
    return {"optimizer": opt["optimizer"], "scheduler": opt["scheduler"], "rng": rng, "trainer": trainer}
