"""Checkpoints: atomic save (temp dir, fsync, rename) and loading.

Layout of checkpoints/step_N/:
    model.safetensors      weights
    model_config.json      built-in GPT: architecture ({"type": "builtin-gpt", ...GPTConfig}); a reward
                           model of it (`grpolab rm`): type "builtin-rm", weights with the score head
    config.json, tokenizer Hugging Face models: the `save_pretrained` layout, so
    files, ...             `AutoModelForCausalLM.from_pretrained(step_N)` loads it (reward models:
                           AutoModelForSequenceClassification, LoRA merged; the adapter in adapter/)
    optimizer.pt           optimizer and scheduler state (present for training checkpoints), and the
                           float32 master weights of a bfloat16/float16 model
    rng.pt                 torch and sampler RNG states
    ref.safetensors        the reference model (when algorithm.beta > 0)
    critic.safetensors,    PPO's critic (algorithm.adv_estimator=gae): weights with the value head, and
    critic_optimizer.pt    its optimizer and scheduler state
    trainer_state.json     step, data position (and the wandb run id)

optimizer.pt and rng.pt hold tensors and plain containers only and are loaded with
torch.load(weights_only=True): a checkpoint cannot run code when it is loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file, save_model
from safetensors.torch import load_model as load_safetensors_model

from ..models import GPT, GPTConfig, CharTokenizer
from ..models.hf import HFPolicy, load_hf, load_hf_adapter
from ..models.lora import add_lora
from ..utils.files import write_atomic

TMP = ".tmp_"     # a checkpoint being written: .tmp_step_N
ASIDE = ".old_"   # an existing step_N moved aside while its re-save is swapped in: .old_step_N


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (e.g. it holds pickled objects); the message says which file and why."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: str | Path, step: int, model, *, tokenizer=None, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, rng: dict | None = None, ref_model=None,
                    full_states: dict | None = None, master_weights: list | None = None, extra=None) -> Path:
    """Write checkpoints/step_N atomically; an interrupted write never leaves a half checkpoint, and
    re-saving an existing step never leaves a moment without a complete one.

    full_states: for sharded models (train.strategy=fsdp), the gathered full 'model', 'ref' and
    'optimizer' state dicts, written in place of the modules' own (sharded) ones.
    extra: a callable that writes more files (e.g. PPO's critic) into the directory being staged."""
    root = Path(ckpt_root)
    final = root / f"step_{step}"
    tmp = _stage(root, step, model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                 trainer_state=trainer_state, rng=rng, ref_model=ref_model, full_states=full_states,
                 master_weights=master_weights, extra=extra)
    for _ in _install(tmp, final):
        pass
    return final


def _stage(root: Path, step: int, model, *, tokenizer=None, optimizer=None, scheduler=None,
           trainer_state: dict | None = None, rng: dict | None = None, ref_model=None,
           full_states: dict | None = None, master_weights: list | None = None, extra=None) -> Path:
    """Write the complete checkpoint to root/.tmp_step_N, fsynced; nothing else is touched."""
    root.mkdir(parents=True, exist_ok=True)
    recover_checkpoints(root)   # an earlier crash may have left a checkpoint aside, or a half-written one
    tmp = root / f"{TMP}step_{step}"
    tmp.mkdir()
    full_states = full_states or {}
    full = full_states.get("model")
    if hasattr(model, "save_checkpoint_files"):   # a reward model (models/reward_head.py) writes its own layout
        model.save_checkpoint_files(tmp)
    elif isinstance(model, HFPolicy):
        model.save(tmp, state_dict=_hf_keys(full) if full is not None else None)
        if tokenizer is not None:
            tokenizer.save(tmp)
    else:
        state = {k: v.detach().contiguous() for k, v in (full if full is not None else model.state_dict()).items()}
        save_file(state, str(tmp / "model.safetensors"))
        lora = {"lora": model.lora} if getattr(model, "lora", None) else {}   # its adapters' settings
        (tmp / "model_config.json").write_text(json.dumps({"type": "builtin-gpt", **model.config.to_dict(),
                                                           **lora}, indent=2))
    # optimizer.pt and rng.pt hold only tensors and plain containers: they load with weights_only=True
    if optimizer is not None:
        torch.save({"optimizer": full_states.get("optimizer") or optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    **({"master": master_weights} if master_weights is not None else {})}, tmp / "optimizer.pt")
    if rng is not None:
        torch.save(rng, tmp / "rng.pt")
    if full_states.get("ref") is not None:   # gathered, one name per tied weight (as save_model writes it)
        ref = full_states["ref"]
        save_file(_hf_keys(ref) if isinstance(ref_model, HFPolicy) else ref, str(tmp / "ref.safetensors"))
    elif ref_model is not None:
        ref = ref_model.hf if isinstance(ref_model, HFPolicy) else ref_model
        save_model(ref, str(tmp / "ref.safetensors"))   # save_model handles tied (shared) weights
    if extra is not None:
        extra(tmp)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(trainer_state or {})}, indent=2))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp)
    return tmp


def _hf_keys(state: dict) -> dict:
    """An HFPolicy's state dict in the Hugging Face model's own names (without the 'hf.' prefix)."""
    return {k.removeprefix("hf."): v for k, v in state.items()}


def read_ref_state(path: str | Path, ref_model) -> dict | None:
    """ref.safetensors of a checkpoint, named as `ref_model`'s state dict (None when absent)."""
    f = Path(path) / "ref.safetensors"
    if not f.is_file():
        return None
    sd = load_file(str(f))
    return {f"hf.{k}": v for k, v in sd.items()} if isinstance(ref_model, HFPolicy) else sd


def _install(tmp: Path, final: Path) -> Iterator[None]:
    """Move the staged `tmp` to `final`, one filesystem operation at a time, yielding after each
    (a crash can only fall between two of them; the tests stop there). An existing `final` is
    renamed aside first (.old_step_N) and deleted last, so at every moment a complete checkpoint
    for the step exists: `final`, or the aside copy that recover_checkpoints puts back."""
    root = final.parent
    if final.exists():
        aside = root / f"{ASIDE}{final.name}"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        _fsync_dir(root)
        yield
        os.rename(tmp, final)
        _fsync_dir(root)
        yield
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
        _fsync_dir(root)
    yield


def recover_checkpoints(ckpt_root: str | Path) -> None:
    """Clean up after a crash mid-save (called before a save and a resume; one writer per run
    directory): an aside .old_step_N goes back to step_N when step_N is missing and is deleted
    when the new step_N made it in; half-written .tmp_ directories are deleted."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.name.startswith(TMP) and p.is_dir():
            shutil.rmtree(p)
        elif p.name.startswith(ASIDE) and _is_step_name(p.name[len(ASIDE):]):
            final = root / p.name[len(ASIDE):]
            if _is_complete(final):
                shutil.rmtree(p)
            elif _is_complete(p):
                if final.exists():
                    shutil.rmtree(final)
                os.rename(p, final)
                _fsync_dir(root)


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from a checkpoint directory: a built-in GPT checkpoint, or any
    Hugging Face model directory (ours or one saved elsewhere)."""
    p = Path(path)
    cfg_file = p / "model_config.json"
    if not cfg_file.is_file():
        if (p / "config.json").is_file():
            return load_hf(str(p), dtype=dtype, device=device)
        if (p / "adapter_config.json").is_file():   # a LoRA checkpoint of a Hugging Face model
            return load_hf_adapter(str(p), dtype=dtype, device=device)
        raise FileNotFoundError(f"{str(p)!r} is not a checkpoint: no model_config.json (built-in GPT), "
                                f"config.json (Hugging Face model) or adapter_config.json (LoRA adapter)")
    meta = json.loads(cfg_file.read_text())
    meta.pop("type", None)
    lora = meta.pop("lora", None)
    model = GPT(GPTConfig(**meta))
    if lora:
        add_lora(model, lora)
    model.load_state_dict(load_file(str(p / "model.safetensors")))
    model.to(device).eval()
    return model, CharTokenizer()


def _step_of(p: Path) -> int:
    return int(p.name.rsplit("_", 1)[1])


def _is_step_name(name: str) -> bool:
    return name.startswith("step_") and name[5:].isdigit()


def _is_complete(p: Path) -> bool:
    return p.is_dir() and (p / "trainer_state.json").is_file()


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first: step_N, or the .old_step_N a crash mid-re-save left aside
    when step_N is missing (recover_checkpoints renames it back); never the .tmp_ ones."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = {}
    for p in root.iterdir():
        name = p.name[len(ASIDE):] if p.name.startswith(ASIDE) else p.name
        if _is_step_name(name) and _is_complete(p) and (p.name == name or name not in found):
            found[name] = p
    return sorted(found.values(), key=_step_of)


def prune_checkpoints(ckpt_root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (keep 0 = keep all)."""
    if keep > 0:
        for p in list_checkpoints(ckpt_root)[:-keep]:
            shutil.rmtree(p)


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """train.resume: 'auto' -> the newest checkpoint under output_dir (None if there is none), after
    cleaning up what a crash mid-save left there; else the path."""
    if resume == "auto":
        root = Path(output_dir) / "checkpoints"
        recover_checkpoints(root)
        found = list_checkpoints(root)
        return found[-1] if found else None
    p = Path(resume)
    aside = p.parent / f"{ASIDE}{p.name}"
    if _is_step_name(p.name) and not p.exists() and _is_complete(aside):
        p = aside   # a crash mid-re-save left it aside; read it there (another run's directory: don't move it)
    if not (p / "trainer_state.json").is_file() or not (p / "optimizer.pt").is_file():
        raise FileNotFoundError(f"train.resume: {resume!r} is not a training checkpoint (checkpoints/step_N "
                                f"with trainer_state.json and optimizer.pt)")
    return p


def load_ref_weights(path: str | Path, ref_model) -> None:
    """A checkpoint's ref.safetensors into `ref_model`, in place (nothing when the file is absent);
    save_model wrote one name per tied weight, and load_model reads it back that way."""
    f = Path(path) / "ref.safetensors"
    if f.is_file():
        load_safetensors_model(ref_model.hf if isinstance(ref_model, HFPolicy) else ref_model, str(f))


def checkpoint_job(path: str | Path) -> str | None:
    """The job that wrote a checkpoint (grpo, sft, dpo, rm, distill; older GRPO ones name none: grpo),
    or None when the directory has no trainer_state.json."""
    f = Path(path).expanduser() / "trainer_state.json"
    return json.loads(f.read_text()).get("job", "grpo") if f.is_file() else None


def load_training_state(path: str | Path, model=None, ref_model=None) -> dict:
    """Load a checkpoint's weights into `model` (skipped when None, e.g. a model just loaded from
    this checkpoint) and its reference into `ref_model`, in place; return optimizer, scheduler,
    RNG and trainer state."""
    p = Path(path)
    if model is not None:
        loaded, _ = load_model(p, device=str(next(model.parameters()).device))
        model.load_state_dict(loaded.state_dict())
    if ref_model is not None:
        load_ref_weights(p, ref_model)
    opt = _load_plain(p / "optimizer.pt")
    rng = _load_plain(p / "rng.pt") if (p / "rng.pt").is_file() else {}
    trainer = json.loads((p / "trainer_state.json").read_text())
    return {"optimizer": opt["optimizer"], "scheduler": opt["scheduler"], "rng": rng, "trainer": trainer,
            "master": opt.get("master")}


def _load_plain(path: Path):
    """torch.load with weights_only=True: tensors and plain containers only, so loading a
    checkpoint can never run code pickled into it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it holds {found.group(1)}" if found else str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: refusing to load it: {what}, but it must hold only tensors and plain "
                              f"containers (loaded with torch.load(weights_only=True), so loading can never run "
                              f"code); grpolab writes no such file: resume only from checkpoints you trust") from None
    except (RuntimeError, EOFError, OSError) as e:   # truncated or not a torch file at all
        raise CheckpointError(f"{path}: cannot be read ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
                              f"resume from an earlier checkpoint") from None


def cut_logs(run_dir: str | Path, step: int, names: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl")) -> None:
    """Drop the lines of a run's jsonl logs written after `step` (a resumed run writes them again)."""
    for name in names:
        path = Path(run_dir) / name
        if path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            write_atomic(path, "".join(ln + "\n" for ln in keep))
